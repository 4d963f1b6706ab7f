"""The SQLite ledger backend: one writer thread, group commit, keys stored hashed.

Threading model. The event loop never touches SQLite. Every operation (reads too, for one
consistent view) is a plain function queued to ONE dedicated thread that owns the only
connection. The thread takes everything queued, runs it as one transaction (group
commit: one fsync for the whole group) with a SAVEPOINT around each operation, so one
failing operation rolls back alone and the others commit. After COMMIT it resolves each
operation's asyncio future with loop.call_soon_threadsafe (one call per loop per group).
A result is only ever delivered after it is committed, and after it is fsync'd except for
holds (see "Holds commit without fsync" below).

Atomicity. One thread serialises all writes of this process, and each group runs in
BEGIN IMMEDIATE (the database write lock), so "check available, then insert the hold"
cannot interleave with another hold, in this process or in another worker process
sharing the file. Exactly-once settle is the UNIQUE(request_id) constraint of the usage
table, inserted in the same savepoint as the debit and the hold release.

Durability. Holds are rows: after a SIGKILL nothing is lost (every acknowledged
operation was committed) and nothing is double-charged (usage is UNIQUE per request id);
holds of the dead process are dropped by expire_holds once their ttl passes.

Holds commit without fsync. Every queued batch is split in two groups: first the ops
that need no fsync (reads, and holds: the only ledger write on a request's response path),
committed at `hold_synchronous` (default NORMAL), then everything else (settle, release,
top-up, revoke, key changes...) at `synchronous` (default FULL). So no request waits for an
fsync before it is forwarded, and a hold never waits behind a settle's fsync. Why this is
safe (with WAL; NORMAL is never weaker than the process-crash guarantee above):
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

Leases. lease_grow() and lease_commit() back proxy/ledger/lease.py: a lease is one ordinary
hold row per process and busy key ("lease:<pid>:<nonce>..."), grown like a hold (fast, no
fsync) and reduced in the same fsync'd transaction that inserts a batch of usage rows and
debits their costs, so balance - holds does not move when a leased request settles. Holds
taken from a lease and their settles never reach this thread one by one. That commit is this
thread's main work under load, so it is kept lean: the rows are validated and built on the
event loop, inserted with one executemany (row by row only when a balance runs out and the
debits clamp), and a lease row whose expiry stays is updated without touching its indexes.

Settles linger. A settle() or release() nobody waits for (linger=True: the client of a
request that settles in the background has gone) is kept by the writer up to
`settle_linger_s` (default 5 ms) for others to share its fsync'd commit; the balance
middleware's settle before the end of an answer passes linger=False and commits at once. At low
concurrency that turns one commit + one writer wake-up + one event-loop wake-up per
request into one per few requests (~0.2 ms of CPU per request at concurrency 1); at high
concurrency groups are large anyway. They are committed at once when another op needs an
fsync'd commit, when max_batch of them are waiting, and on close(). The cost: a request's
hold stays up to 5 ms longer, and a SIGKILL in that window loses the settle (the request
goes unbilled, its hold expires: the same outcome as a kill a moment earlier).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import queue
import secrets
import sqlite3
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from proxy.ledger.base import (
    SECRET_PREFIX,
    UNSET,
    USAGE_STATUSES,
    DuplicateRequest,
    Hold,
    InsufficientBalance,
    KeyRecord,
    Ledger,
    LedgerError,
    UnknownKey,
    UsageRecord,
)

from proxy.ledger.usage import MAX_AMOUNT

log = logging.getLogger("proxy.ledger")

SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    key_id          TEXT PRIMARY KEY,
    name            TEXT NOT NULL,
    prefix          TEXT NOT NULL,
    secret_sha256   BLOB NOT NULL UNIQUE,
    balance_micros  INTEGER NOT NULL DEFAULT 0 CHECK (balance_micros >= 0),
    allowed_models  TEXT,            -- JSON array, NULL = every model
    concurrency     INTEGER,
    rate_per_min    INTEGER,
    revoked         INTEGER NOT NULL DEFAULT 0,
    created_at      REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS holds (
    request_id      TEXT PRIMARY KEY,
    key_id          TEXT NOT NULL REFERENCES keys(key_id),
    amount_micros   INTEGER NOT NULL CHECK (amount_micros >= 0),
    expires_at      REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS holds_by_key ON holds(key_id, expires_at);
CREATE INDEX IF NOT EXISTS holds_by_expiry ON holds(expires_at);
CREATE TABLE IF NOT EXISTS usage (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id       TEXT NOT NULL UNIQUE,
    key_id           TEXT NOT NULL REFERENCES keys(key_id),
    model            TEXT NOT NULL,
    input_tokens     INTEGER NOT NULL,
    cached_tokens    INTEGER NOT NULL,
    output_tokens    INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL,
    cost_micros      INTEGER NOT NULL CHECK (cost_micros >= 0),
    debited_micros   INTEGER NOT NULL CHECK (debited_micros >= 0 AND debited_micros <= cost_micros),
    status           TEXT NOT NULL,
    created_at       REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_by_key ON usage(key_id, seq);
CREATE TRIGGER IF NOT EXISTS usage_no_update BEFORE UPDATE ON usage
    BEGIN SELECT RAISE(ABORT, 'usage is append-only'); END;
CREATE TRIGGER IF NOT EXISTS usage_no_delete BEFORE DELETE ON usage
    BEGIN SELECT RAISE(ABORT, 'usage is append-only'); END;
-- Every credit, so that balance == sum(topups) - sum(usage.debited_micros) can be audited.
CREATE TABLE IF NOT EXISTS topups (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    key_id          TEXT NOT NULL REFERENCES keys(key_id),
    micros          INTEGER NOT NULL,
    created_at      REAL NOT NULL
);
"""

_KEY_COLUMNS = "key_id, name, prefix, balance_micros, allowed_models, concurrency, rate_per_min, revoked, created_at"
_USAGE_COLUMNS = (
    "request_id, key_id, model, input_tokens, cached_tokens, output_tokens, reasoning_tokens,"
    " cost_micros, status, created_at, debited_micros"
)
_SYNC_ORDER = ("OFF", "NORMAL", "FULL", "EXTRA")
_SYNCHRONOUS = set(_SYNC_ORDER)
# Compared against when the hash is unknown, so both paths do the same work.
_DUMMY_HASH = hashlib.sha256(b"responses-proxy: no such key").digest()


def hash_secret(secret: str) -> bytes:
    """sha256 of the secret. The secret carries 192 random bits, so a fast hash is right
    (a slow KDF protects low-entropy passwords; there is nothing to brute-force here)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(24)  # 24 bytes -> 32 urlsafe chars, 192 bits


def _key_record(row: tuple) -> KeyRecord:
    models = json.loads(row[4]) if row[4] is not None else None
    return KeyRecord(
        key_id=row[0],
        name=row[1],
        prefix=row[2],
        balance_micros=row[3],
        allowed_models=tuple(models) if models is not None else None,
        concurrency=row[5],
        rate_per_min=row[6],
        revoked=bool(row[7]),
        created_at=row[8],
    )


def _usage_record(row: tuple) -> UsageRecord:
    return UsageRecord(*row)


def _opt_limit(value: Any, what: str) -> int | None:
    """A concurrency or rate limit: a positive integer, or None (no limit). 0 is refused:
    it reads as "unlimited" to the limits middleware and as "nothing" to a person."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_AMOUNT:
        raise ValueError(f"{what} must be a positive integer (None: no limit), not {value!r}")
    return value


def _int(value: Any, what: str, *, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}")
    if not -MAX_AMOUNT <= value <= MAX_AMOUNT:
        # SQLite's INTEGER is 64-bit: beyond it the value would be stored as a REAL.
        raise ValueError(f"{what} must be at most {MAX_AMOUNT} in absolute value")
    return value


def _models_json(models: Any) -> str | None:
    if models is None:
        return None
    if isinstance(models, str):
        models = [m for m in (part.strip() for part in models.split(",")) if m]
    models = list(models)
    if not all(isinstance(m, str) and m for m in models):
        raise ValueError("allowed_models must be a list of model names")
    return json.dumps(models)


# The statements of lease_commit (one insert per usage row, then one update per key and lease).
_KEY_BALANCE = "SELECT balance_micros FROM keys WHERE key_id = ?"
_INSERT_USAGE = (
    "INSERT OR IGNORE INTO usage (request_id, key_id, model, input_tokens, cached_tokens,"
    " output_tokens, reasoning_tokens, cost_micros, debited_micros, status, created_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_COST, _DEBITED = 7, 8  # positions in an _INSERT_USAGE row
_NEWEST_USAGE = "SELECT request_id FROM usage ORDER BY seq DESC LIMIT ?"
_DEBIT_KEY = "UPDATE keys SET balance_micros = balance_micros - ? WHERE key_id = ?"
# Without a new expiry the update leaves expires_at, and so both indexes on it, alone:
# two fewer pages written (and fsync'd) per commit.
_REDUCE_LEASE = "UPDATE holds SET amount_micros = MAX(0, amount_micros - ?) WHERE request_id = ? AND expires_at > ?"
_REDUCE_AND_RENEW_LEASE = (
    "UPDATE holds SET amount_micros = MAX(0, amount_micros - ?), expires_at = ?"
    " WHERE request_id = ? AND expires_at > ?"
)


def _check_usage(usage: UsageRecord) -> None:
    """ValueError unless `usage` can be recorded (the first problem, in field order)."""
    if not usage.request_id:
        raise ValueError("request_id is required")
    _check_usage_values(usage)


def _check_usage_values(usage: UsageRecord) -> None:
    """ValueError unless usage's status and counts can be recorded (settle and lease_commit)."""
    if usage.status not in USAGE_STATUSES:
        raise ValueError(f"usage.status must be one of {sorted(USAGE_STATUSES)}")
    a, b, c, d, cost = (
        usage.input_tokens, usage.cached_tokens, usage.output_tokens, usage.reasoning_tokens, usage.cost_micros
    )
    # The common case in one test; _int says what is wrong (or accepts an int subclass).
    if not (type(a) is type(b) is type(c) is type(d) is type(cost) is int and min(a, b, c, d, cost) >= 0
            and max(a, b, c, d, cost) <= MAX_AMOUNT):
        for value, name in ((a, "input_tokens"), (b, "cached_tokens"), (c, "output_tokens"),
                            (d, "reasoning_tokens"), (cost, "cost_micros")):
            _int(value, name)


def _record_usage(
    conn: sqlite3.Connection, rows: list[tuple | ValueError], lease_ids: list[str]
) -> tuple[list[int | BaseException | None], dict[str, int], dict[str, int]]:
    """Insert the usage rows (or their validation errors) in order, each exactly once
    (UNIQUE request_id), debiting its cost clamped at what is left of its key's balance.
    Returns (per row: the debit, None if already recorded, or the error; the debits per
    key; per lease id of an inserted row, its debits)."""
    results: list[int | BaseException | None] = [None] * len(rows)
    balances: dict[str, int | None] = {}
    wanted: dict[str, int] = defaultdict(int)  # the costs per known key
    todo: list[int] = []
    for i, row in enumerate(rows):
        if type(row) is not tuple:
            results[i] = row
            continue
        key_id = row[1]
        if key_id not in balances:
            found = conn.execute(_KEY_BALANCE, (key_id,)).fetchone()
            balances[key_id] = found[0] if found else None
        if balances[key_id] is None:
            results[i] = UnknownKey(key_id)
            continue
        wanted[key_id] += row[_COST]
        todo.append(i)
    debits: dict[str, int] = defaultdict(int)
    taken: dict[str, int] = defaultdict(int)
    if all(cost <= balances[key_id] for key_id, cost in wanted.items()):
        # No clamping, whichever rows turn out to be recorded already: every debit is
        # its cost, which the rows already say. One executemany for all of them.
        for i in _insert_unclamped(conn, rows, todo):
            cost = rows[i][_COST]
            results[i] = cost
            debits[rows[i][1]] += cost
            taken[lease_ids[i]] += cost
        return results, debits, taken
    # A balance runs out: each debit depends on those before it, one row at a time.
    for i in todo:
        row = rows[i]
        key_id = row[1]
        balance = balances[key_id]
        debit = min(row[_COST], balance)
        if not conn.execute(_INSERT_USAGE, (*row[:_DEBITED], debit, *row[_DEBITED + 1:])).rowcount:
            continue  # recorded already: None
        balances[key_id] = balance - debit
        results[i] = debit
        debits[key_id] += debit
        taken[lease_ids[i]] += debit
    return results, debits, taken


def _insert_unclamped(conn: sqlite3.Connection, rows: list, todo: list[int]) -> list[int]:
    """Insert rows[i] for i in todo (INSERT OR IGNORE); the i actually inserted."""
    if not todo:
        return todo
    inserted = conn.executemany(_INSERT_USAGE, [rows[i] for i in todo]).rowcount
    if inserted == len(todo):
        return todo
    # Some were recorded before (a retried commit), or twice here. The inserted rows are
    # the newest `inserted` ones: AUTOINCREMENT seq, and this thread holds the write lock.
    fresh = {request_id for (request_id,) in conn.execute(_NEWEST_USAGE, (inserted,))}
    done = []
    for i in todo:
        request_id = rows[i][0]
        if request_id in fresh:
            fresh.discard(request_id)  # twice in this batch: only the first was inserted
            done.append(i)
    return done


@dataclass(slots=True)
class _Op:
    fn: Callable[[sqlite3.Connection], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    readonly: bool
    fast: bool  # may commit at hold_synchronous (reads and holds), see the module docstring
    atomic: bool  # writes at most one statement, last: a failure leaves nothing to roll back
    lazy: bool = False  # may wait up to settle_linger_s for others to share its commit


_STOP = object()


def _resolve_all(items: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for future, result, exc in items:
        if future.done():  # cancelled by the caller meanwhile
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)


class SQLiteLedger(Ledger):
    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: str = "FULL",
        hold_synchronous: str = "NORMAL",
        busy_timeout_ms: int = 5000,
        max_batch: int = 1024,
        settle_linger_s: float = 0.005,
    ) -> None:
        self.path = str(path)
        synchronous = synchronous.upper()
        if synchronous not in _SYNCHRONOUS:
            raise LedgerError(f"ledger.synchronous must be one of {sorted(_SYNCHRONOUS)}")
        hold_synchronous = hold_synchronous.upper()
        if hold_synchronous not in _SYNCHRONOUS:
            raise LedgerError(f"ledger.hold_synchronous must be one of {sorted(_SYNCHRONOUS)}")
        self.synchronous = synchronous
        # Never stronger than `synchronous` (a hold needs no more than a settle).
        self.hold_synchronous = min(hold_synchronous, synchronous, key=_SYNC_ORDER.index)
        self._conn_sync = ""  # the connection's current PRAGMA synchronous (writer thread)
        self.busy_timeout_ms = busy_timeout_ms
        self.max_batch = max(1, max_batch)
        self.settle_linger_s = max(0.0, float(settle_linger_s))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._closing: asyncio.Future | None = None
        # Observability (written by the writer thread only): operations, groups, largest group.
        self.stats = {"ops": 0, "groups": 0, "max_group": 0, "failed_groups": 0}

    def __repr__(self) -> str:
        return f"SQLiteLedger({self.path!r})"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._thread is not None:
            return
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
        await self.expire_holds()

    async def close(self) -> None:
        if self._thread is None:
            self._closed = True
            return
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        thread = self._thread
        await asyncio.get_running_loop().run_in_executor(None, thread.join)

    # ------------------------------------------------------------------ the writer thread

    def _connect(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
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
        # small (see the throughput test). Configurable as ledger.synchronous. Holds alone
        # commit at ledger.hold_synchronous (NORMAL): see the module docstring for why.
        conn.execute(f"PRAGMA synchronous = {self.synchronous}")
        self._conn_sync = self.synchronous
        conn.execute("PRAGMA foreign_keys = ON")
        conn.executescript(SCHEMA)
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

    async def _run(
        self,
        fn: Callable[[sqlite3.Connection], Any],
        *,
        readonly: bool = False,
        fast: bool = False,
        atomic: bool = False,
        lazy: bool = False,
    ) -> Any:
        """Queue `fn(conn)` to the writer thread; its result once the group has committed
        (fsync'd unless `fast`: reads and holds only). `atomic`: fn writes with at most one
        statement, its last, so a failure needs no savepoint."""
        if self._closed or self._thread is None:
            raise LedgerError("ledger is closed" if self._closed else "ledger is not started")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Op(fn, future, loop, readonly, fast or readonly, atomic, lazy and not fast))
        return await future

    # ------------------------------------------------------------------ helpers (writer thread)

    @staticmethod
    def _available(conn: sqlite3.Connection, key_id: str, now: float) -> tuple[int, int]:
        """(balance, available) for a key; UnknownKey if missing."""
        row = conn.execute(
            "SELECT balance_micros, (SELECT COALESCE(SUM(amount_micros), 0) FROM holds"
            " WHERE holds.key_id = keys.key_id AND expires_at > ?) FROM keys WHERE key_id = ?",
            (now, key_id),
        ).fetchone()
        if row is None:
            raise UnknownKey(key_id)
        return row[0], row[0] - row[1]

    @staticmethod
    def _get_key(conn: sqlite3.Connection, key_id: str) -> KeyRecord | None:
        row = conn.execute(f"SELECT {_KEY_COLUMNS} FROM keys WHERE key_id = ?", (key_id,)).fetchone()
        return _key_record(row) if row else None

    # ------------------------------------------------------------------ the request path

    async def lookup_key(self, secret: str) -> KeyRecord | None:
        if not isinstance(secret, str) or not secret:
            return None
        digest = hash_secret(secret)

        def op(conn: sqlite3.Connection) -> KeyRecord | None:
            row = conn.execute(
                f"SELECT secret_sha256, {_KEY_COLUMNS} FROM keys WHERE secret_sha256 = ?", (digest,)
            ).fetchone()
            stored = row[0] if row else _DUMMY_HASH
            # The index finds the row; the decision is a constant-time compare of the hashes,
            # done on both the found and the not-found path.
            if not hmac.compare_digest(stored, digest) or row is None:
                return None
            record = _key_record(row[1:])
            return None if record.revoked else record

        return await self._run(op, readonly=True)

    async def available(self, key_id: str) -> int:
        return await self._run(lambda conn: self._available(conn, key_id, time.time())[1], readonly=True)

    async def hold(self, request_id: str, key_id: str, amount_micros: int, ttl_s: float) -> Hold:
        amount = _int(amount_micros, "amount_micros")
        if not request_id:
            raise ValueError("request_id is required")
        ttl = float(ttl_s)
        if not ttl > 0:
            raise ValueError("ttl_s must be positive")

        return await self._run(self._hold_op(request_id, key_id, amount, amount, ttl), fast=True, atomic=True)

    async def hold_up_to(
        self, request_id: str, key_id: str, min_micros: int, max_micros: int, ttl_s: float,
        *, lease_return: tuple[str, int] | None = None,
    ) -> Hold:
        """`lease_return` = (lease id, micros): first give that much of a lease back (its
        amount, never below 0), in the same transaction, kept even when the hold is refused
        (proxy/ledger/lease.py: a request its process's lease cannot cover)."""
        low = _int(min_micros, "min_micros")
        high = _int(max_micros, "max_micros")
        if low > high:
            raise ValueError("min_micros must not exceed max_micros")
        if not request_id:
            raise ValueError("request_id is required")
        ttl = float(ttl_s)
        if not ttl > 0:
            raise ValueError("ttl_s must be positive")
        if lease_return is None or lease_return[1] <= 0:
            return await self._run(self._hold_op(request_id, key_id, low, high, ttl), fast=True, atomic=True)
        result = await self._run(self._hold_op(request_id, key_id, low, high, ttl, lease_return), fast=True)
        if isinstance(result, LedgerError):
            raise result
        return result

    def _hold_op(
        self, request_id: str, key_id: str, low: int, high: int, ttl: float,
        lease_return: tuple[str, int] | None = None,
    ) -> Callable[[sqlite3.Connection], Hold]:
        """Hold min(available, high) if available >= low: check and insert in one
        transaction under the write lock (BEGIN IMMEDIATE), so nothing can interleave.
        With a lease_return the refusals are returned, not raised, so the give-back commits."""

        def op(conn: sqlite3.Connection) -> Hold:
            if lease_return is not None:
                conn.execute(
                    "UPDATE holds SET amount_micros = MAX(0, amount_micros - ?) WHERE request_id = ?",
                    (int(lease_return[1]), lease_return[0]),
                )
                try:
                    return hold(conn)
                except (InsufficientBalance, DuplicateRequest, UnknownKey) as exc:
                    return exc
            return hold(conn)

        def hold(conn: sqlite3.Connection) -> Hold:
            now = time.time()
            # One statement: the balance, the open holds, and whether it was settled already.
            row = conn.execute(
                "SELECT balance_micros, (SELECT COALESCE(SUM(amount_micros), 0) FROM holds"
                " WHERE holds.key_id = keys.key_id AND expires_at > ?),"
                " EXISTS (SELECT 1 FROM usage WHERE request_id = ?) FROM keys WHERE key_id = ?",
                (now, request_id, key_id),
            ).fetchone()
            if row is None:
                raise UnknownKey(key_id)
            if row[2]:
                raise DuplicateRequest(request_id)
            available = row[0] - row[1]
            if available < low:
                raise InsufficientBalance(max(available, 0), low)
            amount = min(available, high)
            expires_at = now + ttl
            try:
                conn.execute(
                    "INSERT INTO holds (request_id, key_id, amount_micros, expires_at) VALUES (?, ?, ?, ?)",
                    (request_id, key_id, amount, expires_at),
                )
            except sqlite3.IntegrityError:
                raise DuplicateRequest(request_id) from None
            return Hold(request_id, key_id, amount, expires_at)

        return op

    async def settle(self, request_id: str, usage: UsageRecord, *, linger: bool = True) -> bool:
        if not request_id:
            raise ValueError("request_id is required")
        _check_usage_values(usage)
        counts = (usage.input_tokens, usage.cached_tokens, usage.output_tokens, usage.reasoning_tokens)
        cost = usage.cost_micros
        key_id, model, status = usage.key_id, str(usage.model), usage.status
        created_at = float(usage.created_at)

        def op(conn: sqlite3.Connection) -> int | None:
            settled, balance, held = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM usage WHERE request_id = ?),"
                " (SELECT balance_micros FROM keys WHERE key_id = ?),"
                " (SELECT amount_micros FROM holds WHERE request_id = ?)",
                (request_id, key_id, request_id),
            ).fetchone()
            if settled:
                return None
            if balance is None:
                raise UnknownKey(key_id)
            # Never more than the request's own hold (the money others hold stays theirs),
            # nor than the balance. A hold that expired meanwhile no longer bounds it.
            debit = min(cost, balance) if held is None else min(cost, balance, held)
            try:
                # The exactly-once guarantee: UNIQUE(request_id), in this same transaction.
                conn.execute(
                    "INSERT INTO usage (request_id, key_id, model, input_tokens, cached_tokens, output_tokens,"
                    " reasoning_tokens, cost_micros, debited_micros, status, created_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (request_id, key_id, model, *counts, cost, debit, status, created_at),
                )
            except sqlite3.IntegrityError:
                if conn.execute("SELECT 1 FROM usage WHERE request_id = ?", (request_id,)).fetchone():
                    return None
                raise
            if debit:
                conn.execute(_DEBIT_KEY, (debit, key_id))
            conn.execute("DELETE FROM holds WHERE request_id = ?", (request_id,))
            return debit

        debited = await self._run(op, lazy=linger)
        if debited is None:
            return False
        usage.debited_micros = debited  # only once committed
        return True

    async def release(self, request_id: str, *, linger: bool = True) -> bool:
        return await self._run(
            lambda conn: conn.execute("DELETE FROM holds WHERE request_id = ?", (request_id,)).rowcount > 0,
            lazy=linger,
            atomic=True,  # one statement: needs no savepoint of its own in a group
        )

    # ------------------------------------------------------------------ leases (proxy/ledger/lease.py)

    supports_leases = True

    async def lease_grow(
        self, lease_id: str, key_id: str, min_micros: int, max_micros: int, ttl_s: float, share: int = 2
    ) -> tuple[int, bool]:
        """Add min(max_micros, available // share) to the hold row `lease_id` (created if
        missing) and push its expiry to now + ttl_s; nothing when that is below min_micros.
        available excludes the lease itself. Returns (granted, whether the row was still
        there unexpired before). Commits without fsync, like every hold."""
        low = _int(min_micros, "min_micros")
        high = _int(max_micros, "max_micros")
        share = max(1, int(share))
        ttl = float(ttl_s)

        def op(conn: sqlite3.Connection) -> tuple[int, bool]:
            now = time.time()
            row = conn.execute(
                "SELECT balance_micros, (SELECT COALESCE(SUM(amount_micros), 0) FROM holds"
                " WHERE holds.key_id = keys.key_id AND expires_at > ? AND request_id != ?),"
                " (SELECT amount_micros FROM holds WHERE request_id = ? AND expires_at > ?)"
                " FROM keys WHERE key_id = ?",
                (now, lease_id, lease_id, now, key_id),
            ).fetchone()
            if row is None:
                raise UnknownKey(key_id)
            own = row[2]
            available = row[0] - row[1] - (own or 0)
            grant = min(high, max(0, available) // share)
            if grant < low:
                grant = 0
            if own is None:  # absent, or expired (then it counts for nothing: start afresh)
                if not grant:
                    conn.execute("DELETE FROM holds WHERE request_id = ?", (lease_id,))
                    return 0, False
                conn.execute(
                    "INSERT INTO holds (request_id, key_id, amount_micros, expires_at) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT(request_id) DO UPDATE SET amount_micros = excluded.amount_micros,"
                    " expires_at = excluded.expires_at",
                    (lease_id, key_id, grant, now + ttl),
                )
            else:
                conn.execute(
                    "UPDATE holds SET amount_micros = amount_micros + ?, expires_at = ? WHERE request_id = ?",
                    (grant, now + ttl, lease_id),
                )
            return grant, own is not None

        return await self._run(op, fast=True, atomic=True)  # its one write is its last statement

    async def lease_commit(
        self,
        usages: list[tuple[str, UsageRecord]],
        leases: list[tuple[str, int, float | None, bool]],
    ) -> tuple[list[int | BaseException | None], set[str]]:
        """One transaction (fsync'd): record each (lease id, usage) exactly once (UNIQUE
        request_id) and debit its cost from the balance (clamped at it), taking the debit off
        the lease's hold row too, so available = balance - holds does not move; then for each
        (lease id, give back, ttl, drop) of `leases`: give that much back (the row, never
        below 0), push the expiry to now + ttl (None: leave it), or drop the row.
        Returns (per usage: the debit, None if already recorded, or the error;
        the lease ids whose row had expired or vanished)."""
        # Validated here, on the event loop, into ready-made usage rows (debited = cost),
        # so that the writer thread only looks up the balances and inserts.
        rows: list[tuple | ValueError] = []
        for _, usage in usages:
            try:
                _check_usage(usage)
            except ValueError as exc:
                rows.append(exc)
                continue
            cost = usage.cost_micros
            rows.append((
                usage.request_id, usage.key_id, str(usage.model), usage.input_tokens, usage.cached_tokens,
                usage.output_tokens, usage.reasoning_tokens, cost, cost, usage.status, float(usage.created_at),
            ))
        lease_ids = [lease_id for lease_id, _ in usages]

        def op(conn: sqlite3.Connection) -> tuple[list, set[str]]:
            now = time.time()
            results, debits, taken = _record_usage(conn, rows, lease_ids)
            for key_id, debit in debits.items():
                if debit:
                    conn.execute(_DEBIT_KEY, (debit, key_id))
            lapsed: set[str] = set()
            changes = {lease_id: [total, None, False] for lease_id, total in taken.items()}
            for lease_id, give_back, ttl, drop in leases:
                change = changes.setdefault(lease_id, [0, None, False])
                change[0] += max(0, int(give_back))
                if ttl is not None:
                    change[1] = now + float(ttl)
                change[2] = change[2] or bool(drop)
            for lease_id, (total, expires_at, drop) in changes.items():
                if drop:
                    conn.execute("DELETE FROM holds WHERE request_id = ?", (lease_id,))
                    continue
                if expires_at is None:  # the common case: leaves the expiry indexes untouched
                    done = conn.execute(_REDUCE_LEASE, (total, lease_id, now)).rowcount
                else:
                    done = conn.execute(_REDUCE_AND_RENEW_LEASE, (total, expires_at, lease_id, now)).rowcount
                if not done:
                    lapsed.add(lease_id)
            return results, lapsed

        results, lapsed = await self._run(op)
        for (_, usage), result in zip(usages, results):
            if isinstance(result, int):
                usage.debited_micros = result
        return results, lapsed

    async def expire_holds(self, now: float | None = None) -> int:
        def op(conn: sqlite3.Connection) -> int:
            cutoff = time.time() if now is None else now
            return conn.execute("DELETE FROM holds WHERE expires_at <= ?", (cutoff,)).rowcount

        return await self._run(op, atomic=True)

    async def usage(self, request_id: str) -> UsageRecord | None:
        def op(conn: sqlite3.Connection) -> UsageRecord | None:
            row = conn.execute(f"SELECT {_USAGE_COLUMNS} FROM usage WHERE request_id = ?", (request_id,)).fetchone()
            return _usage_record(row) if row else None

        return await self._run(op, readonly=True)

    async def list_usage(self, key_id: str | None = None, limit: int = 50) -> list[UsageRecord]:
        limit = max(0, int(limit))

        def op(conn: sqlite3.Connection) -> list[UsageRecord]:
            if key_id is None:
                rows = conn.execute(f"SELECT {_USAGE_COLUMNS} FROM usage ORDER BY seq DESC LIMIT ?", (limit,))
            else:
                rows = conn.execute(
                    f"SELECT {_USAGE_COLUMNS} FROM usage WHERE key_id = ? ORDER BY seq DESC LIMIT ?",
                    (key_id, limit),
                )
            return [_usage_record(r) for r in rows]

        return await self._run(op, readonly=True)

    async def holds(self, key_id: str | None = None) -> list[Hold]:
        """Open holds (expired ones included until expire_holds drops them)."""

        def op(conn: sqlite3.Connection) -> list[Hold]:
            sql = "SELECT request_id, key_id, amount_micros, expires_at FROM holds"
            rows = conn.execute(sql + " WHERE key_id = ?", (key_id,)) if key_id else conn.execute(sql)
            return [Hold(*r) for r in rows]

        return await self._run(op, readonly=True)

    # ------------------------------------------------------------------ key management

    async def create_key(
        self,
        name: str,
        balance_micros: int = 0,
        allowed_models: list[str] | tuple[str, ...] | None = None,
        concurrency: int | None = None,
        rate_per_min: int | None = None,
    ) -> tuple[str, KeyRecord]:
        if not isinstance(name, str) or not name.strip():
            raise ValueError("a key needs a name")
        balance = _int(balance_micros, "balance_micros")
        models = _models_json(allowed_models)
        conc = _opt_limit(concurrency, "concurrency")
        rate = _opt_limit(rate_per_min, "rate_per_min")
        secret = new_secret()
        digest = hash_secret(secret)
        key_id = "key_" + secrets.token_hex(8)

        def op(conn: sqlite3.Connection) -> KeyRecord:
            now = time.time()
            conn.execute(
                "INSERT INTO keys (key_id, name, prefix, secret_sha256, balance_micros, allowed_models,"
                " concurrency, rate_per_min, revoked, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                (key_id, name.strip(), secret[:12], digest, balance, models, conc, rate, now),
            )
            if balance:
                conn.execute(
                    "INSERT INTO topups (key_id, micros, created_at) VALUES (?, ?, ?)", (key_id, balance, now)
                )
            return self._get_key(conn, key_id)

        return secret, await self._run(op)

    async def get_key(self, key_id: str) -> KeyRecord | None:
        return await self._run(lambda conn: self._get_key(conn, key_id), readonly=True)

    async def list_keys(self) -> list[KeyRecord]:
        def op(conn: sqlite3.Connection) -> list[KeyRecord]:
            rows = conn.execute(f"SELECT {_KEY_COLUMNS} FROM keys ORDER BY created_at, key_id")
            return [_key_record(r) for r in rows]

        return await self._run(op, readonly=True)

    async def top_up(self, key_id: str, micros: int) -> int:
        amount = _int(micros, "micros", minimum=None)

        def op(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT balance_micros FROM keys WHERE key_id = ?", (key_id,)).fetchone()
            if row is None:
                raise UnknownKey(key_id)
            if row[0] + amount < 0:
                raise ValueError(f"the balance would go below zero ({row[0]} + {amount})")
            if row[0] + amount > MAX_AMOUNT:
                raise ValueError(f"the balance would exceed {MAX_AMOUNT} micros ({row[0]} + {amount})")
            conn.execute("UPDATE keys SET balance_micros = balance_micros + ? WHERE key_id = ?", (amount, key_id))
            conn.execute(
                "INSERT INTO topups (key_id, micros, created_at) VALUES (?, ?, ?)", (key_id, amount, time.time())
            )
            return row[0] + amount

        return await self._run(op)

    async def set_limits(
        self,
        key_id: str,
        *,
        allowed_models: Any = UNSET,
        concurrency: Any = UNSET,
        rate_per_min: Any = UNSET,
    ) -> KeyRecord:
        changes: dict[str, Any] = {}
        if allowed_models is not UNSET:
            changes["allowed_models"] = _models_json(allowed_models)
        if concurrency is not UNSET:
            changes["concurrency"] = _opt_limit(concurrency, "concurrency")
        if rate_per_min is not UNSET:
            changes["rate_per_min"] = _opt_limit(rate_per_min, "rate_per_min")

        def op(conn: sqlite3.Connection) -> KeyRecord:
            if changes:
                assignments = ", ".join(f"{column} = ?" for column in changes)  # fixed column names
                cur = conn.execute(f"UPDATE keys SET {assignments} WHERE key_id = ?", (*changes.values(), key_id))
                if cur.rowcount == 0:
                    raise UnknownKey(key_id)
            record = self._get_key(conn, key_id)
            if record is None:
                raise UnknownKey(key_id)
            return record

        try:
            return await self._run(op)
        finally:
            self.key_generation += 1  # also on error: a cache flush is always safe

    async def revoke(self, key_id: str) -> None:
        def op(conn: sqlite3.Connection) -> None:
            if conn.execute("UPDATE keys SET revoked = 1 WHERE key_id = ?", (key_id,)).rowcount == 0:
                raise UnknownKey(key_id)

        try:
            await self._run(op)
        finally:
            self.key_generation += 1  # after the commit: caches filled before it are stale

    async def audit(self) -> list[tuple[str, int, int]]:
        """Per key: (key_id, balance, sum(topups) - sum(debited)); the two must be equal."""

        def op(conn: sqlite3.Connection) -> list[tuple[str, int, int]]:
            return list(
                conn.execute(
                    "SELECT k.key_id, k.balance_micros,"
                    " (SELECT COALESCE(SUM(micros), 0) FROM topups t WHERE t.key_id = k.key_id)"
                    " - (SELECT COALESCE(SUM(debited_micros), 0) FROM usage u WHERE u.key_id = k.key_id)"
                    " FROM keys k ORDER BY k.key_id"
                )
            )

        return await self._run(op, readonly=True)
