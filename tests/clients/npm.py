"""An npm package installed once into a cache directory of its own, for the CLI clients the
tests drive (Codex, Claude Code)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def npm_install(cache: Path, spec: str, timeout: float, unavailable: type[Exception]) -> None:
    """`npm install spec` into `cache`; raises `unavailable` (the client's skip reason) when npm
    is missing or the install fails."""
    npm = shutil.which("npm")
    if npm is None:
        raise unavailable("npm is not installed")
    cache.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(cache), spec],
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise unavailable(f"npm install {spec} failed: {exc}") from exc
    if proc.returncode != 0:
        raise unavailable(f"npm install {spec} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
