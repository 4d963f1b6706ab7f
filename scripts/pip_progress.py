"""`pip install ARGS` with one progress line per package instead of silence (make run, make test).

    .venv/bin/python scripts/pip_progress.py -e '.[test,fast]'

pip's own output is read line by line: each package it collects is printed as it comes
("  [12] aiohttp"), then one line when the wheels are built and one when all is installed,
with the time taken. Warnings and errors (pip's stderr) pass through unchanged; on failure
the last lines of pip's output are printed too, and the exit code is pip's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import deque

# "Collecting aiohttp>=3.12" (from an index), "Processing /wheels/yarl-1.25.1-...whl" (a local wheel).
_COLLECTING = re.compile(r"^(?:Collecting ([A-Za-z0-9._-]+)|Processing (?:\S*/)?([A-Za-z0-9_.]+?)-\d\S*\.whl\b)")
_INSTALLING = re.compile(r"^Installing collected packages: (.*)")


def main(args: list[str]) -> int:
    started = time.monotonic()
    print("==> installing responses-proxy and its dependencies into .venv (the first time: 78 packages, about 100 MB to "
          "download, about a minute; later runs skip this)", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "pip", "install", "--progress-bar", "off",
                             "--disable-pip-version-check", *args],
                            stdout=subprocess.PIPE, text=True, bufsize=1)
    tail: deque[str] = deque(maxlen=40)
    collected = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line.rstrip("\n"))
        found = _COLLECTING.match(line)
        if found:
            collected += 1
            print(f"    [{collected}] {found.group(1) or found.group(2)}", flush=True)
            continue
        found = _INSTALLING.match(line)
        if found:
            count = len([p for p in found.group(1).split(",") if p.strip()])
            print(f"==> installing {count} packages", flush=True)
    code = proc.wait()
    if code != 0:
        print("\n".join(tail), file=sys.stderr)
        print(f"pip install failed (exit {code})", file=sys.stderr)
        return code
    print(f"==> installed in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
