"""`make bench` rewrites bench/results.md but keeps its hand-kept "Design measurements" section
(the numbers the code's comments point to)."""

from __future__ import annotations

from pathlib import Path

from bench.__main__ import KEPT_HEADING, with_kept_section


def test_a_run_keeps_the_design_measurements():
    old = "## Benchmark (old)\n| a |\n\n" + KEPT_HEADING + "\n\n| choice | figure |\n"
    assert with_kept_section("## Benchmark (new)\n| b |\n", old) == (
        "## Benchmark (new)\n| b |\n\n" + KEPT_HEADING + "\n\n| choice | figure |\n")
    assert with_kept_section("## Benchmark (new)\n", "") == "## Benchmark (new)\n"


def test_the_committed_results_have_the_section():
    text = (Path(__file__).resolve().parent.parent / "bench" / "results.md").read_text()
    assert KEPT_HEADING in text and "ClientSession" in text
