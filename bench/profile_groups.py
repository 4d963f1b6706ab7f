"""Where the proxy's time goes, by module, from a py-spy profile.

    py-spy record -p <proxy pid> -d 8 -r 500 -f raw -o raw.txt   # while `make bench`-like load runs
    python -m bench.profile_groups raw.txt

Each sample goes to the innermost frame that belongs to one of the groups below (the event loop
when uvloop's C code itself is running); the ledger's writer thread is left out (py-spy cannot
tell its waits on the queue and on fsync from work: read its CPU from /proc/<pid>/task instead).
"""

from __future__ import annotations

import collections
import sys

GROUPS = [
    ("upstream client (proxy/upstream/client.py)", ["upstream.py"]),
    ("rewriter + SSE decoder", ["rewriter.py", "sse.py", "protocol/deltas.py", "protocol/assembler.py",
                                "protocol/encoder.py", "protocol/response.py"]),
    ("middleware chain + leases + pricing", ["stateless.py", "auth.py", "limits.py", "tools.py", "balance.py",
                                             "lease.py", "pricing.py", "ledger/__init__.py", "sqlite.py"]),
    ("translate + body", ["translate.py", "request.py", "netguard.py"]),
    ("routing + affinity", ["routing.py", "affinity.py", "workers.py"]),
    ("access log + metrics", ["logs.py", "metrics.py", "_output.py"]),
    ("responses handler + app middleware", ["responses_handler.py", "app.py"]),
    ("aiohttp server", ["aiohttp/"]),
]


def main(path: str) -> None:
    total = 0
    by: collections.Counter[str] = collections.Counter()
    with open(path) as f:
        for line in f:
            if not line.strip() or line.startswith("Thread._bootstrap"):
                continue
            stack, n = line.rstrip("\n").rsplit(" ", 1)
            count = int(n)
            total += count
            frames = stack.split(";")
            if frames[-1].startswith("run_app"):
                by["event loop (uvloop: epoll, syscalls, callbacks)"] += count
                continue
            for frame in reversed(frames):
                group = next((g for g, keys in GROUPS if any(k in frame for k in keys)), None)
                if group:
                    by[group] += count
                    break
            else:
                by["other"] += count
    for group, count in by.most_common():
        print(f"| {group} | {100 * count / max(total, 1):.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1])
