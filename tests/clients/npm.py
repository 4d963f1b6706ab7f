"""What the CLI clients the tests drive (Codex, Claude Code) share: their npm package installed
once into a cache directory of its own, an environment that lets them reach loopback only, and
one run of the command with a timeout."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple


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


def loopback_only(egress_port: int) -> dict[str, str]:
    """Environment variables that send anything but loopback to a dead proxy (it fails at once),
    and a plain terminal."""
    trap = f"http://127.0.0.1:{egress_port}"
    return {
        "HTTPS_PROXY": trap, "HTTP_PROXY": trap, "ALL_PROXY": trap,
        "https_proxy": trap, "http_proxy": trap, "all_proxy": trap,
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        "NO_COLOR": "1", "TERM": "dumb",
    }


class Ran(NamedTuple):
    code: int  # -9 for a run killed at its timeout
    stdout: str
    stderr: str  # ends with "[timed out]" for a run killed at its timeout
    timed_out: bool


async def run_cli(args: list[str], workdir: Path, env: dict[str, str], timeout: float) -> Ran:
    """Run `args` in `workdir` with `env` and no stdin; a run past `timeout` is killed."""
    proc = await asyncio.create_subprocess_exec(
        *args, cwd=str(workdir), env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        return Ran(-9, out.decode(errors="replace"), err.decode(errors="replace") + "\n[timed out]", True)
    return Ran(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"), False)
