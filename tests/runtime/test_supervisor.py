"""`serve --workers N`: "listening" is printed once, when every process accepts; a script that
waits for the line may connect at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.support.paths import REPO

ROOT = REPO


@pytest.mark.parametrize("workers", [2, 3])
def test_listening_is_printed_once_every_worker_answers(tmp_path, workers):
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(f"ledger: {{path: {tmp_path / 'ledger.db'}}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "--config", str(config), "serve", "--port", str(port),
                             "--workers", str(workers)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = []
        deadline = time.monotonic() + 120  # a bound only: a machine under load starts slowly
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(seen)  # the server exited before saying it listens
            seen.append(line)
            if "listening on" in line:
                break
        assert f"({workers} processes)" in seen[-1]
        # at once, each of many new connections (SO_REUSEPORT spreads them over the processes)
        for _ in range(4 * workers):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=30) as answer:
                assert answer.status == 200
        assert sum("listening on" in line for line in seen) == 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
