"""The refusals the console's Errors view lists: every request answered with an error status
(4xx but 499, a client that left; and 5xx), as its access line has it (time, request id,
method, path, transport, status, error code, key id, model, client address). The access log
itself is a stream on stderr that no process can read back, and a refusal never reaches the
ledger (a 401 has no key, a 402 or 429 never held anything), so the records are kept here:

  * one process (`serve`): in memory, the last CAPACITY refusals (a ring: a flood of 401s
    costs a bounded amount of memory and pushes out the oldest); a restart forgets them.
  * `serve --workers N` (any process with PROMETHEUS_MULTIPROC_DIR naming a directory, the
    one the supervisor makes for /metrics): each process also appends its records to its own
    file there, `refusals-<pid>.jsonl` (written once per turn of the event loop, like the
    access lines; at FILE_BYTES it becomes `.jsonl.1`, replacing the previous one, so a
    process keeps at most twice that), and the console, in whichever process answers, reads
    every process's files. The supervisor's own directory is removed when it exits; a
    directory the operator names keeps them across restarts (files untouched for
    KEEP_S are removed).

The console's own requests (its page, login, API: `ignore_prefix`) are not recorded: a
logged-out dashboard asking for its session is not an error of the service.
"""

from __future__ import annotations

import asyncio
import glob
import os
import time
from collections import deque
from typing import Any

import orjson
from aiohttp import web

CAPACITY = 1000
FILE_BYTES = 256 * 1024
KEEP_S = 31 * 86400  # the console's longest range, and a day
FILE_GLOB = "refusals-*.jsonl*"


def is_refusal(status: int) -> bool:
    return status >= 400 and status != 499


class Refusals:
    """The refusal records of this process, and of its siblings when `shared_dir` is set."""

    def __init__(self, shared_dir: str | None = None, capacity: int = CAPACITY, name: str | None = None) -> None:
        self.ring: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.capacity = capacity
        self.shared_dir = shared_dir
        self.ignore_prefix: str | None = None
        self._name = name  # the file's name (tests); else refusals-<pid>.jsonl
        self._pending: list[bytes] = []
        self._fd: int | None = None
        self._fd_pid = 0
        self._size = 0

    @property
    def scope(self) -> str:
        return "every process of this server" if self.shared_dir else "this process"

    def record(self, path: str, **fields: Any) -> None:
        if self.ignore_prefix is not None and (path == self.ignore_prefix or path.startswith(self.ignore_prefix + "/")):
            return
        entry = {"time": time.time(), "path": path, **fields}
        self.ring.append(entry)
        if self.shared_dir is None:
            return
        self._pending.append(orjson.dumps(entry) + b"\n")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if len(self._pending) == 1:
            loop.call_soon(self.flush)

    # ----------------------------------------------------------------- the shared files

    def _file(self) -> str:
        return os.path.join(self.shared_dir or "", self._name or f"refusals-{os.getpid()}.jsonl")

    def _open(self) -> int:
        if self._fd is not None and self._fd_pid == os.getpid():
            return self._fd
        self._fd = None  # a descriptor inherited across a fork is the parent's file
        path = self._file()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._fd, self._fd_pid, self._size = fd, os.getpid(), os.fstat(fd).st_size
        self._prune()
        return fd

    def _prune(self) -> None:
        """Files of processes long gone (a directory the operator keeps across restarts)."""
        cutoff = time.time() - KEEP_S
        for path in glob.glob(os.path.join(self.shared_dir or "", FILE_GLOB)):
            try:
                if os.stat(path).st_mtime < cutoff:
                    os.unlink(path)
            except OSError:
                pass

    def flush(self) -> None:
        """Write what waits, in one write; never raises (a full disk loses records, not requests)."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        try:
            fd = self._open()
            if self._size + len(data) > FILE_BYTES and self._size:
                os.close(fd)
                self._fd = None
                path = self._file()
                os.replace(path, path + ".1")
                fd = self._open()
            os.write(fd, data)
            self._size += len(data)
        except OSError:
            pass

    def close(self) -> None:
        self.flush()
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    # ----------------------------------------------------------------- reading

    def _shared_records(self, since: float) -> list[dict[str, Any]]:
        self.flush()
        found = []
        for path in glob.glob(os.path.join(self.shared_dir or "", FILE_GLOB)):
            try:
                with open(path, "rb") as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            for line in lines:
                try:
                    entry = orjson.loads(line)
                except orjson.JSONDecodeError:  # a line being written
                    continue
                if isinstance(entry, dict) and isinstance(entry.get("time"), (int, float)) and entry["time"] >= since:
                    found.append(entry)
        return found

    def since(self, since: float) -> list[dict[str, Any]]:
        """Every record from `since` on, newest first (in shared mode, read from the files:
        call it off the event loop, `asyncio.to_thread`)."""
        if self.shared_dir is not None:
            records = self._shared_records(since)
        else:
            records = [e for e in self.ring if e["time"] >= since]
        records.sort(key=lambda e: e["time"], reverse=True)
        return records

    async def recent(self, since: float) -> list[dict[str, Any]]:
        if self.shared_dir is None:
            return self.since(since)
        return await asyncio.to_thread(self.since, since)


REFUSALS = web.AppKey("refusals", Refusals)  # the app's records of refusals (the console's Errors view)
