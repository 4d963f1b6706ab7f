"""`make bench` rewrites bench/results.md but keeps its hand-kept "Design measurements" section
(the numbers the code's comments point to)."""

from __future__ import annotations


from bench.__main__ import BACKENDS_HEADING, KEPT_HEADING, with_backends_section, with_kept_section
from tests.support.paths import REPO


def test_a_run_keeps_the_design_measurements():
    old = "## Benchmark (old)\n| a |\n\n" + KEPT_HEADING + "\n\n| choice | figure |\n"
    assert with_kept_section("## Benchmark (new)\n| b |\n", old) == (
        "## Benchmark (new)\n| b |\n\n" + KEPT_HEADING + "\n\n| choice | figure |\n")
    assert with_kept_section("## Benchmark (new)\n", "") == "## Benchmark (new)\n"


def test_the_committed_results_have_the_section():
    text = (REPO / "bench" / "results.md").read_text()
    assert KEPT_HEADING in text and "ClientSession" in text


def test_the_backend_rows_replace_only_their_section():
    """`python -m bench --backends-only` rewrites its own section and keeps the rest of the file."""
    block = BACKENDS_HEADING + "\n\n| new |\n"
    main = "## Benchmark (old)\n| a |\n\n"
    kept = KEPT_HEADING + "\n\n| choice |\n\n### Ledger backends (issue 16)\n\n| b |\n"
    fresh = with_backends_section(main + kept, block)
    assert fresh == main + BACKENDS_HEADING + "\n\n| new |\n\n" + kept
    again = with_backends_section(fresh.replace("| new |", "| old |"), block)
    assert again == fresh
    assert with_backends_section(main + BACKENDS_HEADING + "\n\n| old |\n", block) == main + block
    assert with_backends_section("", block) == block


def test_the_committed_results_have_the_backend_rows():
    text = (REPO / "bench" / "results.md").read_text()
    at = text.find(BACKENDS_HEADING)
    assert 0 <= at < text.find(KEPT_HEADING)  # in the part a full run writes
    assert "fsync" in text[at:text.find(KEPT_HEADING)]
