"""The ledger's group-commit writer: one thread, one connection, a durability per operation.

It knows nothing of keys, holds or usage (proxy/ledger/sqlite/ledger.py is the SQL); it runs plain
functions of a connection, each with the `Durability` its caller needs, and resolves their
futures once they are committed that durably.

Threading model. The event loop never touches SQLite. Every operation (reads too, for one
consistent view) is a plain function queued to ONE dedicated thread that owns the only
connection. The thread takes everything queued, runs it as one transaction (group
commit: one fsync for the whole group) with a SAVEPOINT around each operation, so one
failing operation rolls back alone and the others commit. After COMMIT it resolves each
operation's asyncio future with loop.call_soon_threadsafe (one call per loop per group).
A result is only ever delivered after it is committed, and after it is fsync'd except for
READ and HOLD operations (see "HOLD commits without fsync" below). Every group runs in
BEGIN IMMEDIATE (the database write lock), so an operation's reads and writes cannot
interleave with another writer, in this process or in another process sharing the file.

HOLD commits without fsync. Every queued batch is split in two groups: first the ops
that need no fsync (READ, and HOLD: the ledger's holds, the only write on a request's
response path), committed at `hold_synchronous` (default NORMAL), then everything else
(SYNC and LINGER: settle, release, top-up, revoke, key changes...) at `synchronous`
(default FULL). So no request waits for an fsync before it is forwarded, and a hold never
waits behind a settle's fsync. Why this is safe (with WAL; NORMAL is never weaker than the
process-crash guarantee):
  * SIGKILL / process crash: a NORMAL commit is in the WAL in the OS page cache, exactly
    as durable as a FULL one. Holds survive and expire as before.
  * OS crash / power cut: the newest NORMAL commits may be lost, i.e. holds. Every process
    that could have served a request under such a hold died in the same crash (a WAL
    database is shared only by processes on one host), so no settle can ever follow a lost
    hold: losing it is the same as its expiring early, and a request in flight at a power
    cut goes unbilled exactly as it already did with FULL (its hold would have expired
    unsettled). Nothing is overdrawn: no request is running that the hold was protecting
    against, and a settle's debit is clamped at the balance in any case.
  * The WAL is append-only and an fsync covers every earlier frame, so a FULL commit
    (settle, top-up, revoke) made after a hold makes that hold durable too; an
    acknowledged settle, top-up or revoke is never lost, and a settle never survives
    without the usage row that made it exactly-once (they are one transaction).
Reordering the two groups is linearizable: all ops of one batch were pending at the same
time, none had been acknowledged, so any serial order of them is a valid one.

LINGER. A settle() or release() nobody waits for (linger=True: the client of a request
that settles in the background has gone) is kept by the writer up to `settle_linger_s`
(default 5 ms) for others to share its fsync'd commit; the balance middleware's settle
before the end of an answer passes linger=False (SYNC) and commits at once. At low
concurrency that turns one commit + one writer wake-up + one event-loop wake-up per
request into one per few requests (~0.2 ms of CPU per request at concurrency 1); at high
concurrency groups are large anyway. They are committed at once when another op needs an
fsync'd commit, when max_batch of them are waiting, and on close(). The cost: a request's
hold stays up to 5 ms longer, and a SIGKILL in that window loses the settle (the request
goes unbilled, its hold expires: the same outcome as a kill a moment earlier).

`atomic` (orthogonal to durability): the function writes with at most one statement, its
last, so a failure leaves nothing to roll back and it needs no SAVEPOINT of its own.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import queue
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.ledger.base import LedgerError

log = logging.getLogger("proxy.ledger")

SYNC_ORDER = ("OFF", "NORMAL", "FULL", "EXTRA")


class Durability(enum.Enum):
    """What an operation needs before its result may be delivered."""

    READ = "read"  # reads only: one consistent view, nothing to commit durably
    HOLD = "hold"  # a write that may commit at hold_synchronous (no fsync by default)
    SYNC = "sync"  # a write committed at synchronous (fsync'd) before its result
    LINGER = "linger"  # like SYNC, but may wait up to settle_linger_s to share the commit


# Durability -> (readonly, fast, lazy): the flags the writer loop tests per op, precomputed
# so the loop does no enum work per operation.
_FLAGS = {
    Durability.READ: (True, True, False),
    Durability.HOLD: (False, True, False),
    Durability.SYNC: (False, False, False),
    Durability.LINGER: (False, False, True),
}


@dataclass(slots=True)
class _Op:
    fn: Callable[[sqlite3.Connection], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    readonly: bool
    fast: bool  # commits at hold_synchronous (READ, HOLD)
    atomic: bool  # writes at most one statement, last: a failure leaves nothing to roll back
    lazy: bool = False  # LINGER: may wait up to settle_linger_s for others to share its commit


_STOP = object()


def _resolve_all(items: Sequence[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for future, result, exc in items:
        if future.done():  # cancelled by the caller meanwhile
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)


def private_files(path: Path) -> None:
    """The ledger (key names, hashes, balances, usage) readable by its owner alone: made 0600
    before SQLite opens it (its -wal and -shm files take the database file's mode), and an
    older one's files tightened."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    for each in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if each.stat().st_mode & 0o077:
                os.chmod(each, 0o600)
        except (FileNotFoundError, PermissionError):
            pass  # gone, or not ours to change: SQLite says what it can or cannot open


class GroupWriter:
    """The one thread that owns the ledger's connection; `run()` queues work to it."""

    def __init__(
        self,
        path: str,
        schema: str | Callable[[sqlite3.Connection], None],
        *,
        synchronous: str,
        hold_synchronous: str,
        busy_timeout_ms: int,
        max_batch: int,
        settle_linger_s: float,
    ) -> None:
        self.path = path
        self.schema = schema
        synchronous = synchronous.upper()
        if synchronous not in SYNC_ORDER:
            raise LedgerError(f"ledger.synchronous must be one of {sorted(SYNC_ORDER)}")
        hold_synchronous = hold_synchronous.upper()
        if hold_synchronous not in SYNC_ORDER:
            raise LedgerError(f"ledger.hold_synchronous must be one of {sorted(SYNC_ORDER)}")
        self.synchronous = synchronous
        # Never stronger than `synchronous` (a hold needs no more than a settle).
        self.hold_synchronous = min(hold_synchronous, synchronous, key=SYNC_ORDER.index)
        self._conn_sync = ""  # the connection's current PRAGMA synchronous (writer thread)
        self.busy_timeout_ms = busy_timeout_ms
        self.max_batch = max(1, max_batch)
        self.settle_linger_s = max(0.0, float(settle_linger_s))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Observability (written by the writer thread only): operations, groups, largest group.
        self.stats = {"ops": 0, "groups": 0, "max_group": 0, "failed_groups": 0}

    async def start(self) -> bool:
        """Open the database in the writer thread; False if it was already started."""
        if self._thread is not None:
            return False
        if self._closed:
            raise LedgerError("ledger is closed")
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()
        self._thread = threading.Thread(
            target=self._writer_main, args=(loop, ready), name="ledger-writer", daemon=True
        )
        self._thread.start()
        try:
            await ready
        except BaseException:
            self._thread.join()
            self._thread = None
            self._closed = True
            raise
        return True

    async def close(self) -> None:
        """Commit everything queued (lingering settles too), then stop the thread."""
        if self._thread is None:
            self._closed = True
            return
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        thread = self._thread
        await asyncio.get_running_loop().run_in_executor(None, thread.join)

    async def run(
        self,
        fn: Callable[[sqlite3.Connection], Any],
        durability: Durability = Durability.SYNC,
        *,
        atomic: bool = False,
    ) -> Any:
        """Queue `fn(conn)` to the writer thread; its result once its group has committed
        as durably as `durability` asks. `atomic`: see the module docstring."""
        if self._closed or self._thread is None:
            raise LedgerError("ledger is closed" if self._closed else "ledger is not started")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        readonly, fast, lazy = _FLAGS[durability]
        self._queue.put(_Op(fn, future, loop, readonly, fast, atomic, lazy))
        return await future

    # ------------------------------------------------------------------ the writer thread

    def _connect(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            private_files(Path(self.path))
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
        if self.path != ":memory:":
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise LedgerError(f"cannot put the ledger database in WAL mode (got {mode})")
        # synchronous=FULL, on purpose. In WAL mode NORMAL is safe against a process crash
        # (SIGKILL) but an OS crash or power cut may roll back the last commits: an
        # acknowledged settle would vanish (the request goes unbilled) and so might an
        # acknowledged top-up or revoke. FULL fsyncs the WAL at every COMMIT, and group
        # commit makes that one fsync per *group*, not per operation, so the price is
        # small (see the throughput test). Configurable as ledger.synchronous. HOLD ops
        # commit at ledger.hold_synchronous (NORMAL): see the module docstring for why.
        conn.execute(f"PRAGMA synchronous = {self.synchronous}")
        self._conn_sync = self.synchronous
        conn.execute("PRAGMA foreign_keys = ON")
        self.schema(conn) if callable(self.schema) else conn.executescript(self.schema)
        return conn

    def _writer_main(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future) -> None:
        try:
            conn = self._connect()
        except BaseException as exc:  # report start-up failures to start()
            err = exc if isinstance(exc, LedgerError) else LedgerError(f"cannot open the ledger: {exc}")
            loop.call_soon_threadsafe(_resolve_all, [(ready, None, err)])
            return
        loop.call_soon_threadsafe(_resolve_all, [(ready, None, None)])
        deferred: list[_Op] = []  # lazy ops (settles) waiting for company, see settle_linger_s
        try:
            stop = False
            deadline = 0.0
            while not stop:
                if deferred:
                    try:
                        item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        item = None
                else:
                    item = self._queue.get()
                batch: list[_Op] = []
                while item is not None:
                    if item is _STOP:
                        stop = True  # close() sets _closed first, so nothing follows _STOP
                    else:
                        batch.append(item)
                    # This thread is the only consumer, so empty() is exact (and cheaper
                    # than get_nowait() raising queue.Empty at the end of every batch).
                    if len(batch) >= self.max_batch or self._queue.empty():
                        break
                    item = self._queue.get_nowait()
                # Reads and holds first, without waiting for an fsync; then the rest.
                fast = [op for op in batch if op.fast]
                slow = [op for op in batch if not op.fast]  # in queue order
                if slow or deferred:
                    if not deferred:
                        deadline = time.monotonic() + self.settle_linger_s
                    pending = deferred + slow
                    if (stop or not all(op.lazy for op in slow) or len(pending) >= self.max_batch
                            or time.monotonic() >= deadline):
                        slow, deferred = pending, []  # an fsync is due anyway, or they waited enough
                    else:
                        slow, deferred = [], pending
                groups = [(fast, self.hold_synchronous)] if fast else []
                if slow:
                    groups.append((slow, self.synchronous))
                for group, level in groups:
                    try:
                        if level != self._conn_sync and not all(op.readonly for op in group):
                            conn.execute(f"PRAGMA synchronous = {level}")  # outside a transaction
                            self._conn_sync = level
                        self._run_group(conn, group)
                    except BaseException as exc:  # never leave a caller waiting forever
                        log.exception("ledger writer: unexpected error")
                        try:
                            if conn.in_transaction:
                                conn.execute("ROLLBACK")
                        except sqlite3.Error:
                            pass
                        self._deliver([(op, None, LedgerError(f"ledger error: {exc}")) for op in group])
                        if not isinstance(exc, Exception):
                            raise
        finally:
            # Anything left behind (only possible after an internal error) must not hang callers.
            leftovers = list(deferred)
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    leftovers.append(item)
            self._deliver([(op, None, LedgerError("ledger is closed")) for op in leftovers])
            conn.close()

    def _run_group(self, conn: sqlite3.Connection, batch: list[_Op]) -> None:
        results: list[tuple[_Op, Any, BaseException | None]] = []
        readonly = all(op.readonly for op in batch)
        try:
            # IMMEDIATE takes the write lock up front: no other writer (another worker
            # process) can slip in between an op's reads and its writes.
            conn.execute("BEGIN" if readonly else "BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self.stats["failed_groups"] += 1
            self._deliver([(op, None, LedgerError(f"ledger unavailable: {exc}")) for op in batch])
            return
        aborted: BaseException | None = None
        alone = len(batch) == 1
        rollback = False  # a lone op failed without a savepoint: roll the transaction back
        for op in batch:
            if op.future.cancelled():  # racy but harmless: a late cancel just drops the result
                results.append((op, None, None))
                continue
            # The savepoint isolates a failing op from the others of its group. Not needed
            # (two statements saved, each a GIL round trip) for a read-only op, an op whose
            # only write is its last statement (statement-level atomicity), or an op alone
            # in its group (then a failure rolls the whole transaction back instead).
            savepoint = not (op.readonly or op.atomic or alone)
            if savepoint:
                conn.execute("SAVEPOINT op")
            try:
                result = op.fn(conn)
            except Exception as exc:
                if not conn.in_transaction:
                    # A fatal error (disk full, I/O error) rolled back the whole transaction:
                    # the ops before this one are gone too, so the whole group fails.
                    aborted = exc
                    break
                if savepoint:
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                elif alone and not op.readonly and not op.atomic:
                    rollback = True
                if isinstance(exc, sqlite3.Error) and not isinstance(exc, sqlite3.IntegrityError):
                    exc = LedgerError(f"ledger error: {exc}")
                results.append((op, None, exc))
            else:
                if savepoint:
                    conn.execute("RELEASE op")
                results.append((op, result, None))
        if aborted is None:
            try:
                conn.execute("ROLLBACK" if rollback else "COMMIT")
            except sqlite3.Error as exc:
                aborted = exc
        if aborted is not None:
            self.stats["failed_groups"] += 1
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            log.error("ledger group of %d operations rolled back: %s", len(batch), aborted)
            error = LedgerError(f"ledger write failed: {aborted}")
            results = [(op, None, error) for op in batch]
        self.stats["ops"] += len(batch)
        self.stats["groups"] += 1
        if len(batch) > self.stats["max_group"]:
            self.stats["max_group"] = len(batch)
        self._deliver(results)

    @staticmethod
    def _deliver(results: list[tuple[_Op, Any, BaseException | None]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for op, result, exc in results:
            by_loop[op.loop].append((op.future, result, exc))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve_all, items)
            except RuntimeError:  # the caller's loop is closed; nobody is waiting
                pass
