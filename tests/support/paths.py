"""Where things are, for every test and helper wherever it sits under tests/."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository's root (pyproject.toml, proxy/, bench/)
TESTS = REPO / "tests"
FIXTURES = TESTS / "fixtures"  # metrics_exposition.txt, vllm-0.32-cpu/ (the repository's copy of ../shared)
SHARED = REPO.parent / "shared"  # the project's shared folder beside the repository (spec, fixtures)
