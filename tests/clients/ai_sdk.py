"""The Vercel AI SDK with its Open Responses provider (tests/clients/ai_sdk/), installed from npm
into a git-ignored cache inside the repository and run with node against a proxy.

    root = ensure_ai_sdk()                       # npm ci once per package-lock.json, reused
    result = await run_ai_sdk(root, proxy_url, api_key, model)

An install that fails raises AISDKUnavailable: the tests fail with it (never skip), so CI
without npm or its registry is a red build, not a silently thinner one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).resolve().parent / "ai_sdk"
CACHE_ROOT = Path(os.environ.get("AI_SDK_CACHE_DIR", REPO / ".cache" / "ai-sdk"))


class AISDKUnavailable(Exception):
    """node or npm missing, or npm could not install the pinned packages."""


def _lock_digest() -> str:
    h = hashlib.sha256()
    for name in ("package.json", "package-lock.json"):
        h.update((SOURCE / name).read_bytes())
    return h.hexdigest()[:16]


def ensure_ai_sdk() -> Path:
    """A folder holding run.mjs and its node_modules, installed with `npm ci` from the lock file."""
    root = CACHE_ROOT / _lock_digest()
    marker = root / ".installed"
    if not marker.exists():
        npm = shutil.which("npm")
        if npm is None or shutil.which("node") is None:
            raise AISDKUnavailable("node and npm are needed for the AI SDK client test")
        root.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(SOURCE / name, root / name)
        try:
            proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--prefix", str(root)],
                                  cwd=root, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AISDKUnavailable(f"npm ci failed: {exc}") from exc
        if proc.returncode != 0:
            raise AISDKUnavailable(f"npm ci failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
        marker.write_text("ok\n")
    shutil.copyfile(SOURCE / "run.mjs", root / "run.mjs")  # the script itself is never cached
    return root


async def run_ai_sdk(root: Path, proxy_url: str, api_key: str, model: str, *,
                     max_output_tokens: int = 256, timeout: float = 300) -> dict:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", str(root)),
           "PROXY_URL": proxy_url, "API_KEY": api_key, "MODEL": model,
           "MAX_OUTPUT_TOKENS": str(max_output_tokens), "NO_PROXY": "127.0.0.1,localhost"}
    proc = await asyncio.create_subprocess_exec(shutil.which("node") or "node", str(root / "run.mjs"), cwd=root,
                                                env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, f"node exited {proc.returncode}: {stderr.decode()[-2000:]}"
    return json.loads(stdout.decode().strip().splitlines()[-1])
