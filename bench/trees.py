"""A checkout's proxy, as the tools that compare checkouts run it (bench.opcodes, bench.paired).

`tree_config` is the config every tree runs: the default chain, written only with keys that
every checkout since the trust work reads (not make bench's per-policy switches, which older
ones lack), plus what the caller merges in. `tree_key` makes a key with a bottomless balance
by the tree's own ledger code, so the key's row matches that tree's schema.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench.__main__ import PY


def _merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def tree_config(port: int, upstream_port: int, db: Path, extra: dict | None = None) -> dict:
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "log_format": "json"},
        "workers": [{"name": "fake", "url": f"http://127.0.0.1:{upstream_port}", "dialect": "vllm",
                     "models": ["bench-json", "bench-coalesced", "bench-chunked"], "capacity": 100_000,
                     "timeouts": {"connect": 5, "first_byte": 60, "idle": 60, "total": 600}}],
        "auth": {"demo_key": False},
        "limits": {"global_concurrency": 4096},
        "ledger": {"path": str(db)},
    }
    return _merged(cfg, extra or {})


def write_tree_config(tmp: Path, port: int, upstream_port: int, extra: dict | None = None) -> Path:
    """tree_config on tmp/ledger.db, written to tmp/config.yaml."""
    path = tmp / "config.yaml"
    path.write_text(json.dumps(tree_config(port, upstream_port, tmp / "ledger.db", extra)))  # JSON is YAML
    return path


def tree_key(tree: Path, db: Path) -> str:
    code = ("import asyncio\nfrom proxy.ledger import open_ledger\nasync def m():\n"
            f"    l = open_ledger({{'path': {str(db)!r}}})\n    await l.start()\n"
            # KeyLimits where the tree has it; older trees took the limits as keywords
            "    try:\n        from proxy.ledger import KeyLimits\n"
            "        kw = {'limits': KeyLimits(concurrency=100000)}\n"
            "    except ImportError:\n        kw = {'concurrency': 100000}\n"
            "    s, _ = await l.create_key('bench', balance_micros=10**15, **kw)\n"
            "    await l.close()\n    print(s)\nasyncio.run(m())\n")
    return subprocess.run([PY, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True, check=True).stdout.strip()
