"""The lease journal: a leased request's usage row on local disk before its answer ends.

A lease (proxy/ledger/lease.py) settles a request in memory and commits its usage row with
others a moment later (balance.lease_commit_ms, or lease_commit_rows). Between the two the row
exists only in this process; a SIGKILL there would leave an answer the client has in full
unbilled. The journal closes that window, the way a write-ahead log does:

    journal.write(usage, lease_id)   appends the row to the open segment; the answer's end
                                     waits for what it returns (None: nothing to wait for)
    journal.cut()                    at each lease commit: the rows written so far are that
                                     commit's; a new segment takes the next ones
    journal.done(segment, ok)        the commit is in the ledger (or its spool): the segment's
                                     file goes; a failed commit's segment stays for the restart
    await recover(folder, ledger)    at start: the segments a dead process left, committed
                                     with lease_commit, exactly once by request id (UNIQUE)

Durability (balance.lease_journal):
  * "fsync" (the default): the answer's end waits for the row's fsync, group-committed with
    every row written meanwhile (one fsync for all of them, in the journal's thread): on disk,
    as a per-request settlement is (SQLite synchronous FULL, PostgreSQL's fsync'd spool).
  * "write": the answer's end waits for nothing more than write(2) on the event loop (a
    page-cache copy, ~0.5 us): a crash of the proxy, a SIGKILL, an OOM kill lose nothing; a
    crash of the machine loses the rows since the last commit (each segment is fsync'd when
    it is cut). For an operator who prices one thread round trip per request above that.
  * "off": no journal; a SIGKILL loses the rows of the last lease_commit_ms (as before it).

Layout: `<folder>/<owner>.lock` (flock'd by its live process; a lock nobody holds is a dead
process's) and `<folder>/<owner>.<segment>.jsonl`, one spool record per line
(proxy/ledger/spool.py's format, kind "lease_usage"). Processes sharing a folder (--workers, a
restart beside a live one) recover only the dead ones' segments, so a live process's own
commit never finds its rows taken from under its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from proxy.ledger.base import UsageRecord
from proxy.ledger.interface import RequestLedger
from proxy.ledger.spool import decode, usage_of

log = logging.getLogger("proxy.ledger")

MODES = ("fsync", "write", "off")
_RECOVER_BATCH = 256

__all__ = ["LeaseJournal", "recover", "MODES"]


class LeaseJournal:
    def __init__(self, folder: str | Path, *, fsync: bool = True) -> None:
        self.folder = Path(folder)
        self.fsync = fsync
        self.owner = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.segment = 0  # the open segment: rows written now belong to the next commit
        self._fds: dict[int, int] = {}  # segment -> its file, open while rows may still reach it
        self._syncing: dict[int, int] = {}  # segment -> fsyncs asked for and not done yet
        self._ended: dict[int, bool] = {}  # segment -> its commit ended (ok?), file not dealt with yet
        self._lock_fd: int | None = None
        self._jobs: list[tuple[int, int, asyncio.Future | None]] = []  # (segment, fd, waiter) to fsync
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._blocked: dict[int, list[asyncio.Future]] = {}  # segment -> rows waiting for its commit instead
        self.fault: OSError | None = None  # the last write or fsync that failed (None: none yet)
        # Set by the leases: start the commit of the rows written so far now (the journal failed them).
        self.commit_now: Callable[[OSError], None] = lambda exc: None
        self.stats = {"rows": 0, "fsyncs": 0, "segments": 0, "kept": 0}

    def __repr__(self) -> str:
        return f"LeaseJournal({str(self.folder)!r}, fsync={self.fsync})"

    # ------------------------------------------------------------------ the request path

    def write(self, usage: UsageRecord, lease_id: str, wait: bool = True) -> asyncio.Future | None:
        """Append the row. The future (fsync mode, `wait`) resolves once it is on disk; None:
        written, nothing more to wait for. A row the journal cannot keep (a full disk, an
        fsync that failed) is committed with the ledger at once instead (the `commit_now`
        hook): its future resolves when that commit ends. Never raises."""
        segment = self.segment
        try:
            fd = self._fds.get(segment)
            if fd is None:
                fd = self._open(segment)
            # Each row starts a line of its own: a row torn by a full disk never merges with the next.
            data = b"\n" + orjson.dumps({"kind": "lease_usage", "request_id": usage.request_id,
                                         "lease_id": lease_id, "usage": usage})
            if os.write(fd, data) != len(data):  # O_APPEND: one write, whole or (a full disk) short
                raise OSError(errno.ENOSPC, "short write")
        except OSError as exc:
            return self._fallback(segment, exc)
        self.stats["rows"] += 1
        if not self.fsync:
            return None
        waiter = self._loop.create_future() if wait and self._loop is not None else None
        self._ask_fsync(segment, fd, waiter)
        return waiter

    def _fallback(self, segment: int, exc: OSError) -> asyncio.Future:
        """The row's durability is its commit's: wait for it, and have it start now."""
        self.fault = exc
        waiter = asyncio.get_running_loop().create_future()
        if segment in self._ended:  # its commit has ended already (an fsync failed after it)
            waiter.set_result(None)
            return waiter
        self._blocked.setdefault(segment, []).append(waiter)
        self.commit_now(exc)
        return waiter

    def cut(self) -> int:
        """The segment the rows written until now are in (the commit about to start is theirs)."""
        segment = self.segment
        self.segment += 1
        fd = self._fds.get(segment)
        if fd is not None and not self.fsync:
            self._ask_fsync(segment, fd, None)  # write mode: each segment fsync'd when it is cut
        return segment

    def done(self, segment: int, ok: bool) -> None:
        """The commit of `segment`'s rows ended: its file goes (ok), or stays, fsync'd, for the
        next start's recovery (the commit failed: those rows are in no ledger yet)."""
        for waiter in self._blocked.pop(segment, ()):
            if not waiter.done():
                waiter.set_result(None)  # its row's durability was this commit's
        if segment not in self._fds:
            return  # no row was written to it
        self._ended[segment] = ok
        if not ok:
            self.stats["kept"] += 1
            log.error("lease journal segment %s kept for the next start: its commit failed",
                      self._path(segment))
        self._end_if_idle(segment)

    # ------------------------------------------------------------------ files

    def _path(self, segment: int) -> Path:
        return self.folder / f"{self.owner}.{segment}.jsonl"

    def _open(self, segment: int) -> int:
        if self._lock_fd is None:
            self._start()
        fd = os.open(self._path(segment), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._fds[segment] = fd
        self.stats["segments"] += 1
        return fd

    def _start(self) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.folder / f"{self.owner}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # ours for the process's lifetime: recover() leaves us alone
        self._lock_fd = fd
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._sync_forever, name="lease-journal", daemon=True)
        self._thread.start()

    def _end_if_idle(self, segment: int) -> None:
        """A segment whose commit ended and that no fsync still uses: closed, and unlinked if
        its commit went in (else left, whole and fsync'd, for recover())."""
        if segment not in self._ended or self._syncing.get(segment):
            return
        ok = self._ended.pop(segment)
        fd = self._fds.pop(segment)
        self._syncing.pop(segment, None)
        os.close(fd)
        if ok:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(segment))

    # ------------------------------------------------------------------ the fsync thread

    def _ask_fsync(self, segment: int, fd: int, waiter: asyncio.Future | None) -> None:
        self._syncing[segment] = self._syncing.get(segment, 0) + 1
        with self._wake:
            self._jobs.append((segment, fd, waiter))
            self._wake.notify()

    def _sync_forever(self) -> None:
        """Group commit: every job waiting when the thread wakes shares one fsync per file."""
        while True:
            with self._wake:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if not self._jobs:
                    return
                jobs, self._jobs = self._jobs, []
            errors: dict[int, OSError] = {}
            for fd in dict.fromkeys(fd for _, fd, _ in jobs):
                try:
                    os.fsync(fd)
                except OSError as exc:
                    errors[fd] = exc
            loop = self._loop
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(self._synced, jobs, errors)

    def _synced(self, jobs: list[tuple[int, int, asyncio.Future | None]], errors: dict[int, OSError]) -> None:
        self.stats["fsyncs"] += 1
        for segment, fd, waiter in jobs:
            if fd in errors:
                if waiter is not None and not waiter.done():
                    self._fallback(segment, errors[fd]).add_done_callback(_resolver(waiter))
            elif waiter is not None and not waiter.done():
                waiter.set_result(None)
            self._syncing[segment] -= 1
        for segment in {segment for segment, _, _ in jobs}:
            self._end_if_idle(segment)

    async def close(self) -> None:
        """After the leases' last commit: the thread stopped, the lock given up."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        await asyncio.sleep(0)  # the thread's last callbacks
        for segment, fd in list(self._fds.items()):
            os.close(fd)  # rows of a commit that never ended: left for recover()
            del self._fds[segment]
        if self._lock_fd is not None:
            if not any(self.folder.glob(f"{self.owner}.*.jsonl")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.folder / f"{self.owner}.lock")
            os.close(self._lock_fd)
            self._lock_fd = None


def _resolver(waiter: asyncio.Future) -> Callable[[asyncio.Future], None]:
    def resolve(_: asyncio.Future) -> None:
        if not waiter.done():
            waiter.set_result(None)
    return resolve


# ----------------------------------------------------------------------------- recovery


def _dead_owners(folder: Path) -> list[tuple[str, int]]:
    """(owner, its lock's fd, now held by us) of each journal no live process holds."""
    out: list[tuple[str, int]] = []
    names = {path.name.split(".", 1)[0] for path in folder.iterdir() if path.suffix in (".lock", ".jsonl")}
    for owner in sorted(names):
        fd = os.open(folder / f"{owner}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # a live process's journal
            continue
        out.append((owner, fd))
    return out


async def recover(folder: str | Path | None, ledger: RequestLedger) -> int:
    """Commit the rows dead processes left in their journals (lease_commit: exactly once by
    request id, so a row its process did commit before it died changes nothing); returns how
    many were new. A segment is removed only once its rows are in; a torn last line (the crash
    came mid-write: that answer never ended) is logged and dropped."""
    folder = Path(folder) if folder is not None else None
    if folder is None or not folder.is_dir():
        return 0
    applied = 0
    for owner, lock_fd in await asyncio.to_thread(_dead_owners, folder):
        try:
            segments = sorted(folder.glob(f"{owner}.*.jsonl"))
            for path in segments:
                records, bad = decode(await asyncio.to_thread(path.read_bytes))
                if bad:
                    log.warning("lease journal %s: %d torn line(s) dropped (their answers never ended)",
                                path, len(bad))
                applied += await _commit(ledger, records, path)
                await asyncio.to_thread(path.unlink)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / f"{owner}.lock")
        finally:
            os.close(lock_fd)
    if applied:
        log.warning("lease journal: %d usage row(s) of a process that died recovered", applied)
    return applied


async def _commit(ledger: RequestLedger, records: list[dict[str, Any]], path: Path) -> int:
    applied = 0
    for start in range(0, len(records), _RECOVER_BATCH):
        part = records[start:start + _RECOVER_BATCH]
        rows: list[tuple[str, UsageRecord]] = []
        for record in part:
            try:
                rows.append((str(record.get("lease_id") or ""), usage_of(record)))
            except (KeyError, TypeError) as exc:
                log.error("lease journal %s: a row that is no usage record dropped (%s): %r", path, exc, record)
        results, _ = await ledger.lease_commit(rows, [])
        for (_, usage), result in zip(rows, results):
            if isinstance(result, BaseException):
                log.error("lease journal: usage of request %s not recorded: %s", usage.request_id, result)
            elif result is not None:
                applied += 1
    return applied
