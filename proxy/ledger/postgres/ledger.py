"""The PostgreSQL ledger backend (asyncpg): the same interface and rules as the SQLite
ledger (proxy/ledger/sqlite/ledger.py), shared by every replica of the proxy.

Locking: row locks, not SERIALIZABLE. Every operation that moves money or reserves it
(hold, hold_up_to, settle, lease_grow, lease_commit) begins its READ COMMITTED transaction
with `SELECT ... FROM keys WHERE key_id = ... FOR UPDATE` on the key row(s) (several keys
in key_id order, so two batches cannot deadlock), and reads the holds and usage of that key
only in the NEXT statement. So all money moves of one key are serialised across every
replica, with no retry loop and no false conflicts between keys; SERIALIZABLE would abort
and retry whole transactions under exactly the contention a busy key creates. The two
statements matter: in READ COMMITTED the statement after the lock takes a fresh snapshot,
which sees every hold committed before the lock was granted (a subquery in the locking
statement itself would use the older snapshot and could miss one). A transaction that still
fails on a deadlock or serialisation error (expire_holds meeting a commit) is retried.
Releases and expiry only delete holds (they can only raise what is available) and take no
key lock; expire_holds skips rows another transaction has locked.

Exactly once: UNIQUE(usage.request_id) and PRIMARY KEY(holds.request_id); inserts use
ON CONFLICT DO NOTHING, so a duplicate is an answer (False / DuplicateRequest), not an
aborted transaction. Debits are clamped at the balance and at the request's own hold.

Time: the proxy's clock (time.time()), passed as a parameter, as the SQLite ledger does,
never the database's now(); expire_holds(now) and the tests' times mean the same thing on
both backends. Replicas need synchronised clocks (NTP); a skew of s seconds makes holds
expire up to s early or late on the skewed replica, nothing else.

Unavailable database: a connection error, a connect or statement timeout, a shutting-down
server become `LedgerUnavailable` (HTTP 503 with Retry-After). settle, release and
lease_commit do not raise it: they append their record to the spool (proxy/ledger/spool.py,
fsync'd) and report success; a background task replays the spool when the database answers
(idempotent by request id), and start() replays a non-empty spool before serving. A spooled
lease row counts as debited in lease_commit's answer, so proxy/ledger/lease.py does not put
its cost back into the lease's free part; its replay is lease_commit of that one row (the
debit, and the same amount off the lease row, if the row is still there), so the lease row
reserves at least what memory believes until then (never an overdraft), and after the replay
exactly that. A lease row whose renewal could not be committed just expires.

Key changes NOTIFY every replica (proxy/ledger/postgres/listen.py); the schema is migrated by
the proxy under an advisory lock (proxy/ledger/postgres/schema.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg

import proxy.ledger.commit_rules as commit_rules  # the rules both backends commit by
from proxy.config import settings as config_settings
from proxy.ledger.base import (
    USAGE_RECORD_COLUMNS,
    DuplicateRequest,
    Hold,
    InsufficientBalance,
    KeyRecord,
    LedgerDataRefused,
    LedgerError,
    LedgerFault,
    LedgerUnavailable,
    UnknownKey,
    UsageRecord,
)
from proxy.ledger.interface import Ledger
from proxy.ledger.key_rules import presented_key, previous_key
from proxy.ledger.levels import chain_room
from proxy.ledger.postgres.console import PgConsoleOps
from proxy.ledger.postgres.errors import FAULT, RETRY, classify, describe
from proxy.ledger.postgres.faults import PgFaults
from proxy.ledger.postgres.keys import KEY_COLUMNS, PgKeyOps
from proxy.ledger.postgres.levels import (
    LOCK_KEY_CHAIN,
    PgLevelOps,
    chain_of_row,
    debit_levels,
    hold_chained,
    levels_balance,
    lock_levels,
    purses,
)
from proxy.ledger.postgres.listen import KeyListener
from proxy.ledger.postgres.schema import migrate
from proxy.ledger.postgres.spool import PgSpoolOps
from proxy.ledger.postgres.usage import USAGE_COLUMNS, insert_usage_batch, lease_changes
from proxy.ledger.schema import KEY_CHAIN_COLUMNS, as_int, hash_secret
from proxy.ledger.spool import Spool, release_record, settle_record
from proxy.ledger.usage import MAX_AMOUNT

log = logging.getLogger("proxy.ledger")


class _OncePerMinute(logging.Filter):
    """asyncpg's own warnings (its pool re-opening its floor of connections every second or so
    while the database is away) said once a minute each, not at every try."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[tuple[str, object], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.exc_info is None:
            return True
        key = (record.name, record.msg)
        now = time.monotonic()
        if now - self.last.get(key, float("-inf")) < 60.0:
            return False
        if len(self.last) > 1000:
            self.last.clear()
        self.last[key] = now
        record.exc_info = record.exc_text = None  # one line: the cause, not a traceback each minute
        return True


def _quiet_asyncpg() -> None:
    # A logger's filters see only what is logged to it, not what its children propagate.
    for name in ("asyncpg", "asyncpg.pool"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OncePerMinute) for f in logger.filters):
            logger.addFilter(_OncePerMinute())
_DEFAULTS = config_settings.of("ledger")  # config.yaml `ledger`'s, for a ledger opened without one

_LOCK_KEY = "SELECT balance_micros FROM keys WHERE key_id = $1 FOR UPDATE"
_LOCK_KEY_CHAIN = LOCK_KEY_CHAIN
_HOLD = "SELECT outcome, amount FROM ledger_hold($1, $2, $3, $4, $5, $6, $7, $8)"
TOMBSTONE_S = 900.0  # how long a released request's tombstone stands in the way of its late hold


def redact(dsn: str) -> str:
    """host:port/database of a DSN, never its password."""
    try:
        parts = urlsplit(dsn)
        return f"{parts.hostname or ''}:{parts.port or 5432}{parts.path or ''}"
    except ValueError:
        return "?"


class PostgresLedger(PgKeyOps, PgLevelOps, PgConsoleOps, PgSpoolOps, PgFaults, Ledger):
    supports_leases = True

    def __init__(self, dsn: str, *, pool_min: int = _DEFAULTS.pool_min, pool_max: int = _DEFAULTS.pool_max,
                 statement_timeout_ms: int = _DEFAULTS.statement_timeout_ms,
                 connect_timeout_s: float = _DEFAULTS.connect_timeout_s, spool_path: str | Path = _DEFAULTS.spool_path,
                 unavailable_retry_after_s: float = _DEFAULTS.unavailable_retry_after_s, replay_interval_s: float = 1.0,
                 listen_ping_s: float = 2.0) -> None:
        if not dsn:
            raise LedgerError("ledger.dsn is required for the postgres backend")
        self.dsn = dsn
        self.pool_min = max(0, int(pool_min))
        self.pool_max = max(1, self.pool_min, int(pool_max))
        self.statement_timeout_ms = int(statement_timeout_ms)
        self.connect_timeout_s = float(connect_timeout_s)
        self.retry_after_s = float(unavailable_retry_after_s)
        self.replay_interval_s = float(replay_interval_s)
        self.spool = Spool(spool_path)
        self.lease_journal_path = str(spool_path) + ".leased"
        self.key_generation = 0
        self.stats = {"unavailable": 0, "spooled": 0, "replayed": 0, "retries": 0}
        self._settings = {"statement_timeout": str(self.statement_timeout_ms), "application_name": "responses-proxy"}
        self._listener = KeyListener(dsn, self._key_changed, connect_timeout_s=self.connect_timeout_s,
                                     ping_s=listen_ping_s, server_settings=self._settings)
        self._pool: asyncpg.Pool | None = None
        self._replayer: asyncio.Task | None = None
        self._connecting: asyncio.Task | None = None  # start() found the database down: retries
        self._owner: asyncio.Task | None = None  # the task connecting (it alone uses the database)
        self._closed = False
        # A fault no retry fixes (postgres.errors.FAULT): its cause while it lasts; new holds are
        # refused meanwhile (503 ledger_fault) and leases are not spent (proxy/ledger/lease.py).
        # Set by the failing call, cleared only by a probe that passes (_probe).
        self.fault: str | None = None
        self._fault_logged = (None, 0.0)
        self._kept_logged: set[str] = set()  # spool records that wait, logged once each

    def __repr__(self) -> str:
        return f"PostgresLedger({redact(self.dsn)!r})"

    def _key_changed(self) -> None:
        self.key_generation += 1

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._pool is not None or self._connecting is not None:
            return
        if self._closed:
            raise LedgerError("ledger is closed")
        try:
            await self._connect()
        except LedgerFault:
            raise  # a wrong password, a missing database: the operator must fix it (exit 2)
        except LedgerUnavailable as exc:
            # A replica (re)started while the database is down still comes up: it answers
            # 503 (and /readyz says not ready) until the database is back, then replays its
            # spool before any request reaches the database.
            log.warning("%s; answering 503 until it is back", exc)
            self._connecting = asyncio.create_task(self._connect_forever(), name="ledger-connect")
            return
        self._replayer = asyncio.create_task(self._drain_forever(), name="ledger-spool-drain")

    async def _connect(self) -> None:
        """Pool, migrations, listener, the spool replayed, stale holds dropped. Until it has
        returned, only the task running it may use the database (`_db` refuses the others
        with LedgerUnavailable): a spool of settlements is replayed before any new hold."""
        self._owner = asyncio.current_task()
        _quiet_asyncpg()
        try:
            # command_timeout: the client's own bound on every statement, past the server's
            # statement_timeout, for a server that cannot even answer that (frozen, or a
            # network that drops packets): a request gets its 503 instead of hanging.
            self._pool = await asyncpg.create_pool(
                self.dsn, min_size=self.pool_min, max_size=self.pool_max, timeout=self.connect_timeout_s,
                command_timeout=self.statement_timeout_ms / 1000 + 1.0, server_settings=self._settings)
            async with self._pool.acquire(timeout=self.connect_timeout_s) as conn:
                await migrate(conn)
            await self._listener.start()
            if self.spool.pending():  # settlements of a previous run first, before serving
                await self.replay_spool()
            await self.expire_holds()
        except BaseException as exc:
            await self._close_pool()
            failure = classify(exc)
            if failure is None:
                raise
            what = f"{describe(failure, exc)} [{redact(self.dsn)}]"
            if failure.kind == FAULT:
                raise LedgerFault(what, self.retry_after_s, failure.cause) from None
            raise LedgerUnavailable(what, self.retry_after_s) from None
        finally:
            self._owner = None
        self.fault = None

    async def _connect_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(min(self.retry_after_s, 1.0))
            try:
                await self._connect()
            except LedgerFault as exc:
                self._note_fault(exc.cause, str(exc))
                continue
            except LedgerUnavailable:
                continue
            except Exception:
                log.exception("ledger start-up failed; trying again")
                continue
            log.info("ledger database %s reachable: serving", redact(self.dsn))
            self._replayer = asyncio.create_task(self._drain_forever(), name="ledger-spool-drain")
            return

    async def _close_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), 10)
            except (TimeoutError, Exception):
                pool.terminate()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in (self._connecting, self._replayer):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        await self._listener.close()
        if self._pool is not None and self.spool.pending():
            try:
                await self.replay_spool()  # a last chance; what stays is replayed by the next start()
            except LedgerError:
                pass
        await self._close_pool()

    # ------------------------------------------------------------------ the connection

    async def _db(self, fn: Callable[[asyncpg.Connection], Awaitable[Any]], *, transaction: bool = True) -> Any:
        """fn(conn) on a pooled connection, in a transaction; LedgerUnavailable when the
        database cannot be reached; retried on a deadlock or serialisation failure."""
        pool = self._pool
        if self._closed:
            raise LedgerError("ledger is closed")
        if pool is None or (self._owner is not None and asyncio.current_task() is not self._owner):
            if pool is None and self._connecting is None:
                raise LedgerError("ledger is not started")
            self.stats["unavailable"] += 1
            raise LedgerUnavailable("the ledger database is unreachable (connecting)", self.retry_after_s)
        for attempt in range(4):
            try:
                async with pool.acquire(timeout=self.connect_timeout_s) as conn:
                    if not transaction:
                        return await fn(conn)
                    async with conn.transaction():
                        return await fn(conn)
            except Exception as exc:
                if isinstance(exc, asyncpg.DataError):  # 22xxx: this operation's data, not the ledger
                    self.stats["data_refused"] = self.stats.get("data_refused", 0) + 1
                    raise LedgerDataRefused(f"the ledger database refused the data of one operation "
                                            f"({type(exc).__name__} {getattr(exc, 'sqlstate', '')})",
                                            self.retry_after_s) from None
                failure = classify(exc)
                if failure is None:
                    raise  # ours: UnknownKey, a ValueError
                if failure.kind == RETRY and attempt < 3:
                    self.stats["retries"] += 1
                    await asyncio.sleep(0.005 * (attempt + 1))
                    continue
                if self._closed:
                    raise LedgerError("ledger is closed") from None
                raise self._failed(failure, exc) from None
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ the request path

    async def lookup_key(self, secret: str) -> KeyRecord | None:
        if not isinstance(secret, str) or not secret:
            return None
        try:
            digest = hash_secret(secret)
        except UnicodeEncodeError:
            return None

        async def op(conn: asyncpg.Connection) -> Any:
            row = await conn.fetchrow(f"SELECT secret_sha256, {KEY_COLUMNS} FROM keys WHERE secret_sha256 = $1",
                                      digest)
            found = presented_key(digest, row)
            if found is None:  # a rotated key's previous secret, during its grace (and after: told why)
                row = await conn.fetchrow(f"SELECT prev_secret_sha256, {KEY_COLUMNS} FROM keys"
                                          " WHERE prev_secret_sha256 = $1", digest)
                found = previous_key(digest, row) if row else None
            return found

        return await self._db(op, transaction=False)

    async def available(self, key_id: str) -> int:
        await self.settled()  # a client asking after its answer sees it settled

        async def op(conn: asyncpg.Connection) -> int:
            now = time.time()
            row = await conn.fetchrow(
                "SELECT balance_micros, (SELECT COALESCE(SUM(amount_micros), 0)::bigint FROM holds"
                f" WHERE holds.key_id = keys.key_id AND expires_at > $2), {KEY_CHAIN_COLUMNS}"
                " FROM keys WHERE key_id = $1", key_id, now)
            if row is None:
                raise UnknownKey(key_id)
            chain = chain_of_row(*tuple(row)[2:])
            if chain is None:
                return row[0] - row[1]
            locked = await lock_levels(conn, chain[1])  # a read: the locks end with it
            return chain_room(row[0] - row[1] if chain[0] else None, await purses(conn, locked, chain[1], now))[0]

        return await self._db(op)

    async def hold(self, request_id: str, key_id: str, amount_micros: int, ttl_s: float) -> Hold:
        amount = as_int(amount_micros, "amount_micros")
        return await self._hold(request_id, key_id, amount, amount, ttl_s, None)

    async def hold_up_to(self, request_id: str, key_id: str, min_micros: int, max_micros: int, ttl_s: float,
                         *, lease_return: tuple[str, int] | None = None) -> Hold:
        """`lease_return` as SQLiteLedger.hold_up_to: that much of a lease goes back first, in
        the same transaction, kept even when the hold is refused."""
        low, high = commit_rules.hold_range(min_micros, max_micros)
        if lease_return is not None and lease_return[1] <= 0:
            lease_return = None
        return await self._hold(request_id, key_id, low, high, ttl_s, lease_return)

    async def _hold(self, request_id: str, key_id: str, low: int, high: int, ttl_s: float,
                    lease_return: tuple[str, int] | None) -> Hold:
        ttl = commit_rules.hold_ttl(request_id, ttl_s)
        self._refuse_if_faulty()

        lease_id, give_back = lease_return if lease_return is not None else (None, 0)
        now = time.time()

        async def op(conn: asyncpg.Connection) -> tuple[str, int | None]:
            # One statement (migration 5): its own transaction, one round trip; a refusal
            # commits the lease give-back too, as it should.
            return tuple(await conn.fetchrow(_HOLD, request_id, key_id, low, high, now, ttl, lease_id,
                                             int(give_back)))

        async def chained(conn: asyncpg.Connection) -> tuple[str, int | None]:
            return await hold_chained(conn, request_id, key_id, low, high, now, ttl, lease_id, int(give_back))

        try:
            outcome, amount = await self._db(op, transaction=False)
            if outcome == "levels":  # a key under levels: the proxy's own transaction
                outcome, amount = await self._db(chained)
        except LedgerUnavailable:
            # The hold may have committed and only its reply been lost: it is released when
            # the database answers again (releasing one never made changes nothing). Not a
            # line of the log per refused request: the outage is said once a minute.
            try:
                await self.spool.write([release_record(request_id)])
                self.stats["spooled"] += 1
            except OSError as exc:
                self._spool_failed(exc)
            raise
        if outcome == "held":
            return Hold(request_id, key_id, amount, now + ttl)
        if outcome.startswith("insufficient"):
            refused = InsufficientBalance(amount, low)
            refused.level = outcome.partition(":")[2] or None  # a level's room was the smallest
            raise refused
        if outcome == "unknown_key":
            raise UnknownKey(key_id)
        raise DuplicateRequest(request_id)

    async def _settle_db(self, request_id: str, usage: UsageRecord) -> int | None:
        row = commit_rules.usage_row(usage, request_id)

        async def op(conn: asyncpg.Connection) -> int | None:
            key = await conn.fetchrow(_LOCK_KEY_CHAIN, usage.key_id)
            chain = chain_of_row(*tuple(key)[1:]) if key is not None else None
            locked = await lock_levels(conn, chain[1]) if chain is not None else {}
            settled, held = await conn.fetchrow(
                "SELECT EXISTS (SELECT 1 FROM usage WHERE request_id = $1),"
                " (SELECT amount_micros FROM holds WHERE request_id = $1)", request_id)
            if settled:
                return None
            if key is None:
                raise UnknownKey(usage.key_id)
            own = chain is None or chain[0]
            balance = key[0] if own else MAX_AMOUNT
            if chain is not None:  # the smallest balance on the way bounds the debit (never a budget)
                balance = min(balance, levels_balance(locked, chain[1]))
            debit = commit_rules.settle_debit(usage.cost_micros, balance, held)
            status = await conn.execute(
                f"INSERT INTO usage ({USAGE_COLUMNS}) VALUES ({', '.join(f'${i + 1}' for i in range(len(row)))})"
                " ON CONFLICT (request_id) DO NOTHING", *row[:8], debit, *row[9:])
            if status.endswith(" 0"):
                return None
            if debit and own:
                await conn.execute("UPDATE keys SET balance_micros = balance_micros - $1 WHERE key_id = $2",
                                   debit, usage.key_id)
            if chain is not None:
                await debit_levels(conn, locked, dict.fromkeys(chain[1], debit), time.time())
            await conn.execute("DELETE FROM holds WHERE request_id = $1", request_id)
            return debit

        return await self._db(op)

    async def settle(self, request_id: str, usage: UsageRecord, *, linger: bool = True) -> bool:
        commit_rules.check_settle(request_id, usage)
        try:
            debited = await self._settle_db(request_id, usage)
        except Exception as exc:  # whatever the reason, a settlement is never dropped
            await self._spool([settle_record(request_id, usage)], exc)
            return True  # recorded (in the spool): replayed exactly once by request id
        if debited is None:
            return False
        usage.debited_micros = debited
        return True

    async def release(self, request_id: str, *, linger: bool = True, key_id: str | None = None) -> bool:
        async def op(conn: asyncpg.Connection) -> bool:
            return (await conn.execute("DELETE FROM holds WHERE request_id = $1", request_id)) != "DELETE 0"

        async def closed(conn: asyncpg.Connection) -> bool:
            # Under the key's row lock, which ledger_hold takes first: a hold of this request in
            # flight has committed (and is dropped here) or has not begun, and then meets the
            # zero tombstone left in its place (ON CONFLICT: 'duplicate'), never held after all.
            await conn.fetchval(_LOCK_KEY, key_id)
            if (await conn.execute("DELETE FROM holds WHERE request_id = $1", request_id)) != "DELETE 0":
                return True
            await conn.execute("INSERT INTO holds (request_id, key_id, amount_micros, expires_at) "
                               "VALUES ($1, $2, 0, $3) ON CONFLICT (request_id) DO NOTHING",
                               request_id, key_id, time.time() + TOMBSTONE_S)
            return False

        try:
            return await (self._db(closed) if key_id is not None else self._db(op, transaction=False))
        except Exception as exc:
            await self._spool([release_record(request_id)], exc)
            return True

    async def expire_holds(self, now: float | None = None) -> int:
        cutoff = time.time() if now is None else float(now)

        async def op(conn: asyncpg.Connection) -> int:
            status = await conn.execute(
                "DELETE FROM holds WHERE request_id IN (SELECT request_id FROM holds WHERE expires_at <= $1"
                " FOR UPDATE SKIP LOCKED)", cutoff)
            return int(status.split()[-1])

        return await self._db(op, transaction=False)

    async def usage(self, request_id: str) -> UsageRecord | None:
        await self.settled()
        row = await self._db(lambda conn: conn.fetchrow(
            f"SELECT {USAGE_RECORD_COLUMNS} FROM usage WHERE request_id = $1", request_id), transaction=False)
        return UsageRecord(*tuple(row)) if row else None

    async def list_usage(self, key_id: str | None = None, limit: int = 50) -> list[UsageRecord]:
        limit = max(0, int(limit))
        await self.settled()

        async def op(conn: asyncpg.Connection) -> list:
            if key_id is None:
                return await conn.fetch(f"SELECT {USAGE_RECORD_COLUMNS} FROM usage ORDER BY seq DESC LIMIT $1", limit)
            return await conn.fetch(f"SELECT {USAGE_RECORD_COLUMNS} FROM usage WHERE key_id = $1"
                                    " ORDER BY seq DESC LIMIT $2", key_id, limit)

        return [UsageRecord(*tuple(r)) for r in await self._db(op, transaction=False)]

    # ------------------------------------------------------------------ leases (proxy/ledger/lease.py)

    async def lease_grow(self, lease_id: str, key_id: str, min_micros: int, max_micros: int, ttl_s: float,
                         share: int = 2) -> tuple[int, bool]:
        """As SQLiteLedger.lease_grow: add min(max, available // share) (available without
        the lease itself) to the lease row, push its expiry; nothing below min_micros."""
        low, high, ttl, share = commit_rules.lease_grow_args(min_micros, max_micros, ttl_s, share)
        self._refuse_if_faulty()

        async def op(conn: asyncpg.Connection) -> tuple[int, bool]:
            key = await conn.fetchrow(_LOCK_KEY_CHAIN, key_id)
            if key is None:
                raise UnknownKey(key_id)
            chain = chain_of_row(*tuple(key)[1:])
            locked = await lock_levels(conn, chain[1]) if chain is not None else {}
            now = time.time()
            others, own = await conn.fetchrow(
                "SELECT (SELECT COALESCE(SUM(amount_micros), 0)::bigint FROM holds WHERE key_id = $1"
                " AND expires_at > $2 AND request_id <> $3),"
                " (SELECT amount_micros FROM holds WHERE request_id = $3 AND expires_at > $2)", key_id, now, lease_id)
            available = key[0] - others - (own or 0)
            if chain is not None:  # the levels' room (this lease counted as held, as above)
                available = chain_room(available if chain[0] else None,
                                       await purses(conn, locked, chain[1], now))[0]
            grant = commit_rules.lease_grant(available, low, high, share)
            if own is None:  # absent, or expired (then it counts for nothing: start afresh)
                if not grant:
                    await conn.execute("DELETE FROM holds WHERE request_id = $1", lease_id)
                    return 0, False
                await conn.execute(
                    "INSERT INTO holds (request_id, key_id, amount_micros, expires_at) VALUES ($1, $2, $3, $4)"
                    " ON CONFLICT (request_id) DO UPDATE SET amount_micros = EXCLUDED.amount_micros,"
                    " expires_at = EXCLUDED.expires_at", lease_id, key_id, grant, now + ttl)
            else:
                await conn.execute("UPDATE holds SET amount_micros = amount_micros + $1, expires_at = $2"
                                   " WHERE request_id = $3", grant, now + ttl, lease_id)
            return grant, own is not None

        return await self._db(op)

    async def lease_commit(
        self,
        usages: list[tuple[str, UsageRecord]],
        leases: list[tuple[str, int, float | None, bool]],
    ) -> tuple[list[int | BaseException | None], set[str]]:
        """As SQLiteLedger.lease_commit, in one transaction. When the database cannot be
        reached, each valid row is spooled (with its lease id) and answered as debited at
        its cost: its replay debits it (clamped) and takes it off the lease row."""
        rows = commit_rules.checked_rows(usages)
        try:
            return await self._lease_commit_db(usages, leases, rows)
        except Exception as exc:
            results: list[int | BaseException | None] = []
            spooled: list[dict[str, Any]] = []
            for (lease_id, usage), row in zip(usages, rows):
                if isinstance(row, ValueError):
                    results.append(row)
                    continue
                spooled.append(settle_record(usage.request_id, usage, lease_id=lease_id))
                results.append(usage.cost_micros)
            await self._spool(spooled, exc)
            return results, set()

    async def _lease_commit_db(
        self,
        usages: list[tuple[str, UsageRecord]],
        leases: list[tuple[str, int, float | None, bool]],
        rows: list[tuple | ValueError],
    ) -> tuple[list[int | BaseException | None], set[str]]:
        lease_ids = [lease_id for lease_id, _ in usages]

        async def op(conn: asyncpg.Connection) -> tuple[list, set[str]]:
            results, taken = await insert_usage_batch(conn, rows, lease_ids)
            lapsed = await lease_changes(conn, taken, leases, time.time())
            return results, lapsed

        results, lapsed = await self._db(op)
        commit_rules.note_debits(usages, results)
        return results, lapsed
