"""The SQLite ledger backend: the SQL of keys, holds, settles, leases and usage; keys stored hashed.

Every operation is a plain function of a connection run by the group-commit writer
(proxy/ledger/sqlite/writer.py: one thread, one connection, group commit), with the durability it
needs: READ for reads, HOLD for holds and lease growth (committed without fsync, see there
why that is safe), SYNC for settles and key changes, LINGER for a settle nobody waits for.

Atomicity. One thread serialises all writes of this process, and each group runs in
BEGIN IMMEDIATE (the database write lock), so "check available, then insert the hold"
cannot interleave with another hold, in this process or in another worker process
sharing the file. Exactly-once settle is the UNIQUE(request_id) constraint of the usage
table, inserted in the same savepoint as the debit and the hold release.

Durability. Holds are rows: after a SIGKILL nothing is lost (every acknowledged
operation was committed) and nothing is double-charged (usage is UNIQUE per request id);
holds of the dead process are dropped by expire_holds once their ttl passes.

Leases. lease_grow() and lease_commit() back proxy/ledger/lease.py: a lease is one ordinary
hold row per process and busy key ("lease:<pid>:<nonce>..."), grown like a hold (HOLD, no
fsync) and reduced in the same fsync'd transaction that inserts a batch of usage rows and
debits their costs, so balance - holds does not move when a leased request settles. Holds
taken from a lease and their settles never reach this thread one by one. That commit is this
thread's main work under load, so it is kept lean: the rows are validated and built on the
event loop, inserted with one executemany (row by row only when a balance runs out and the
debits clamp), and a lease row whose expiry stays is updated without touching its indexes.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import proxy.ledger.commit_rules as commit_rules  # the rules both backends commit by
from proxy.config import settings as config_settings
from proxy.ledger.base import (
    USAGE_RECORD_COLUMNS,
    DuplicateRequest,
    Hold,
    InsufficientBalance,
    KeyRecord,
    LedgerError,
    UnknownKey,
    UsageRecord,
)
from proxy.ledger.interface import Ledger
from proxy.ledger.key_rules import presented_key, previous_key
from proxy.ledger.levels import chain_room
from proxy.ledger.schema import (
    DEBIT_KEY,
    KEY_CHAIN_COLUMNS,
    KEY_COLUMNS as _KEY_COLUMNS,
    REDUCE_AND_RENEW_LEASE,
    REDUCE_LEASE,
    apply_schema,
    as_int,
    hash_secret,
    key_record_of,
    roll_up,
    usage_record_of,
)
from proxy.ledger.sqlite.console import ConsoleOps
from proxy.ledger.sqlite.keys import KeyOps
from proxy.ledger.sqlite.levels import LevelDebits, LevelOps, purses
from proxy.ledger.sqlite.usage import record_usage
from proxy.ledger.sqlite.writer import Durability, GroupWriter
from proxy.ledger.usage import MAX_AMOUNT

READ, HOLD, SYNC, LINGER = Durability.READ, Durability.HOLD, Durability.SYNC, Durability.LINGER

log = logging.getLogger("proxy.ledger")

_DEFAULTS = config_settings.of("ledger")  # config.yaml `ledger`'s, for a ledger opened without one




class SQLiteLedger(KeyOps, LevelOps, ConsoleOps, Ledger):
    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: str = _DEFAULTS.synchronous,
        hold_synchronous: str = _DEFAULTS.hold_synchronous,
        busy_timeout_ms: int = _DEFAULTS.busy_timeout_ms,
        max_batch: int = _DEFAULTS.max_batch,
        settle_linger_s: float = _DEFAULTS.settle_linger_ms / 1000,
    ) -> None:
        self.path = str(path)
        self.lease_journal_path = None if self.path == ":memory:" else self.path + ".leased"
        self._writer = GroupWriter(
            self.path,
            apply_schema,
            synchronous=synchronous,
            hold_synchronous=hold_synchronous,
            busy_timeout_ms=busy_timeout_ms,
            max_batch=max_batch,
            settle_linger_s=settle_linger_s,
        )
        self.synchronous = self._writer.synchronous
        self.hold_synchronous = self._writer.hold_synchronous
        self.stats = self._writer.stats  # the writer's own dict: ops, groups, max_group, failed_groups
        # Bound directly, not wrapped: a wrapper would add a coroutine frame to every operation.
        self._run = self._writer.run

    def __repr__(self) -> str:
        return f"SQLiteLedger({self.path!r})"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if await self._writer.start():
            await self.expire_holds()

    async def close(self) -> None:
        await self._writer.close()

    # ------------------------------------------------------------------ helpers (writer thread)

    @staticmethod
    def _available(conn: sqlite3.Connection, key_id: str, now: float) -> tuple[int, int]:
        """(balance, available) for a key, its levels' room included; UnknownKey if missing."""
        row = conn.execute(
            "SELECT balance_micros, (SELECT COALESCE(SUM(amount_micros), 0) FROM holds"
            f" WHERE holds.key_id = keys.key_id AND expires_at > ?), {KEY_CHAIN_COLUMNS} FROM keys WHERE key_id = ?",
            (now, key_id),
        ).fetchone()
        if row is None:
            raise UnknownKey(key_id)
        available = row[0] - row[1]
        if row[3] or row[4] or row[5] or not row[2]:  # levels above it (proxy/ledger/levels.py)
            available = chain_room(available if row[2] else None, purses(conn, row[3:6], now))[0]
        return row[0], available

    @staticmethod
    def _get_key(conn: sqlite3.Connection, key_id: str) -> KeyRecord | None:
        row = conn.execute(f"SELECT {_KEY_COLUMNS} FROM keys WHERE key_id = ?", (key_id,)).fetchone()
        return key_record_of(row) if row else None

    # ------------------------------------------------------------------ the request path

    async def lookup_key(self, secret: str) -> KeyRecord | None:
        if not isinstance(secret, str) or not secret:
            return None
        digest = hash_secret(secret)

        def op(conn: sqlite3.Connection) -> KeyRecord | None:
            row = conn.execute(
                f"SELECT secret_sha256, {_KEY_COLUMNS} FROM keys WHERE secret_sha256 = ?", (digest,)
            ).fetchone()
            found = presented_key(digest, row)
            if found is None:  # a rotated key's previous secret, during its grace (and after: told why)
                row = conn.execute(f"SELECT prev_secret_sha256, {_KEY_COLUMNS} FROM keys"
                                   " WHERE prev_secret_sha256 = ?", (digest,)).fetchone()
                found = previous_key(digest, row) if row else None
            return found

        return await self._run(op, READ)

    async def available(self, key_id: str) -> int:
        return await self._run(lambda conn: self._available(conn, key_id, time.time())[1], READ)

    async def hold(self, request_id: str, key_id: str, amount_micros: int, ttl_s: float) -> Hold:
        amount = as_int(amount_micros, "amount_micros")
        ttl = commit_rules.hold_ttl(request_id, ttl_s)
        return await self._run(self._hold_op(request_id, key_id, amount, amount, ttl), HOLD, atomic=True)

    async def hold_up_to(
        self, request_id: str, key_id: str, min_micros: int, max_micros: int, ttl_s: float,
        *, lease_return: tuple[str, int] | None = None,
    ) -> Hold:
        """`lease_return` = (lease id, micros): first give that much of a lease back (its
        amount, never below 0), in the same transaction, kept even when the hold is refused
        (proxy/ledger/lease.py: a request its process's lease cannot cover)."""
        low, high = commit_rules.hold_range(min_micros, max_micros)
        ttl = commit_rules.hold_ttl(request_id, ttl_s)
        if lease_return is None or lease_return[1] <= 0:
            return await self._run(self._hold_op(request_id, key_id, low, high, ttl), HOLD, atomic=True)
        result = await self._run(self._hold_op(request_id, key_id, low, high, ttl, lease_return), HOLD)
        if isinstance(result, LedgerError):
            raise result
        return result

    def _hold_op(
        self, request_id: str, key_id: str, low: int, high: int, ttl: float,
        lease_return: tuple[str, int] | None = None,
    ) -> Callable[[sqlite3.Connection], Hold | LedgerError]:
        """Hold min(available, high) if available >= low: check and insert in one
        transaction under the write lock (BEGIN IMMEDIATE), so nothing can interleave.
        With a lease_return the refusals are returned, not raised, so the give-back commits."""

        def op(conn: sqlite3.Connection) -> Hold | LedgerError:
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
                f" EXISTS (SELECT 1 FROM usage WHERE request_id = ?), {KEY_CHAIN_COLUMNS} FROM keys WHERE key_id = ?",
                (now, request_id, key_id),
            ).fetchone()
            if row is None:
                raise UnknownKey(key_id)
            if row[2]:
                raise DuplicateRequest(request_id)
            available, binding = row[0] - row[1], None
            if row[4] or row[5] or row[6] or not row[3]:  # every level above the key must admit it
                available, binding = chain_room(available if row[3] else None, purses(conn, row[4:7], now))
            if available < low:
                refused = InsufficientBalance(max(available, 0), low)
                refused.level = binding
                raise refused
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
        commit_rules.check_settle(request_id, usage)
        counts = (usage.input_tokens, usage.cached_tokens, usage.output_tokens, usage.reasoning_tokens)
        cost = usage.cost_micros
        key_id, model, status = usage.key_id, str(usage.model), usage.status
        created_at = float(usage.created_at)
        worker = None if usage.worker is None else str(usage.worker)
        served = usage.served_model
        endpoint = None if usage.endpoint is None else str(usage.endpoint)
        carried = None if usage.transport is None else str(usage.transport)
        latency = None if usage.latency_ms is None else float(usage.latency_ms)

        def op(conn: sqlite3.Connection) -> int | None:
            settled, held, balance, own, *chain = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM usage WHERE request_id = ?),"
                " (SELECT amount_micros FROM holds WHERE request_id = ?),"
                f" balance_micros, {KEY_CHAIN_COLUMNS} FROM keys WHERE key_id = ?",
                (request_id, request_id, key_id),
            ).fetchone() or (False, None, None, 1, None, None, None)
            levels = tuple(chain)
            if settled:
                return None
            if balance is None:
                raise UnknownKey(key_id)
            chained = LevelDebits() if not own or levels != (None, None, None) else None
            if chained is not None:  # the smallest balance on the way bounds the debit (never a budget)
                balance = min(balance if own else MAX_AMOUNT, chained.balance(conn, levels))
            debit = commit_rules.settle_debit(cost, balance, held)
            try:
                # The exactly-once guarantee: UNIQUE(request_id), in this same transaction.
                conn.execute(
                    "INSERT INTO usage (request_id, key_id, model, input_tokens, cached_tokens, output_tokens,"
                    " reasoning_tokens, cost_micros, debited_micros, status, created_at, worker, served_model,"
                    " endpoint, transport, latency_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (request_id, key_id, model, *counts, cost, debit, status, created_at, worker, served, endpoint,
                     carried, latency),
                )
            except sqlite3.IntegrityError:
                if conn.execute("SELECT 1 FROM usage WHERE request_id = ?", (request_id,)).fetchone():
                    return None
                raise
            if debit and own:
                conn.execute(DEBIT_KEY, (debit, key_id))
            if chained is not None:
                chained.add(levels, debit)
                chained.apply(conn, time.time())
            conn.execute("DELETE FROM holds WHERE request_id = ?", (request_id,))
            roll_up(conn, [((request_id, key_id, model, *counts, cost, debit, status, created_at, worker, served,
                             endpoint, carried, latency),
                            debit)])
            return debit

        debited = await self._run(op, LINGER if linger else SYNC)
        if debited is None:
            return False
        usage.debited_micros = debited  # only once committed
        return True

    async def release(self, request_id: str, *, linger: bool = True, key_id: str | None = None) -> bool:
        return await self._run(
            lambda conn: conn.execute("DELETE FROM holds WHERE request_id = ?", (request_id,)).rowcount > 0,
            LINGER if linger else SYNC,
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
        low, high, ttl, share = commit_rules.lease_grow_args(min_micros, max_micros, ttl_s, share)

        def op(conn: sqlite3.Connection) -> tuple[int, bool]:
            now = time.time()
            row = conn.execute(
                "SELECT balance_micros, (SELECT COALESCE(SUM(amount_micros), 0) FROM holds"
                " WHERE holds.key_id = keys.key_id AND expires_at > ? AND request_id != ?),"
                " (SELECT amount_micros FROM holds WHERE request_id = ? AND expires_at > ?),"
                f" {KEY_CHAIN_COLUMNS} FROM keys WHERE key_id = ?",
                (now, lease_id, lease_id, now, key_id),
            ).fetchone()
            if row is None:
                raise UnknownKey(key_id)
            own = row[2]
            available = row[0] - row[1] - (own or 0)
            if row[4] or row[5] or row[6] or not row[3]:  # the levels' room (this lease counted as held, as above)
                available = chain_room(available if row[3] else None,
                                       purses(conn, row[4:7], now))[0]
            grant = commit_rules.lease_grant(available, low, high, share)
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

        return await self._run(op, HOLD, atomic=True)  # its one write is its last statement

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
        rows: list[Any] = commit_rules.checked_rows(usages)  # as record_usage takes them
        lease_ids = [lease_id for lease_id, _ in usages]

        def op(conn: sqlite3.Connection) -> tuple[list, set[str]]:
            now = time.time()
            results, debits, taken = record_usage(conn, rows, lease_ids)
            roll_up(conn, [(row, debit) for row, debit in zip(rows, results) if type(debit) is int])
            for key_id, debit in debits.items():  # keys with a purse of their own (record_usage)
                if debit:
                    conn.execute(DEBIT_KEY, (debit, key_id))
            lapsed: set[str] = set()
            for lease_id, (total, expires_at, drop) in commit_rules.lease_row_changes(taken, leases, now).items():
                if drop:
                    conn.execute("DELETE FROM holds WHERE request_id = ?", (lease_id,))
                    continue
                if expires_at is None:  # the common case: leaves the expiry indexes untouched
                    done = conn.execute(REDUCE_LEASE, (total, lease_id, now)).rowcount
                else:
                    done = conn.execute(REDUCE_AND_RENEW_LEASE, (total, expires_at, lease_id, now)).rowcount
                if not done:
                    lapsed.add(lease_id)
            return results, lapsed

        results, lapsed = await self._run(op)
        commit_rules.note_debits(usages, results)
        return results, lapsed

    async def expire_holds(self, now: float | None = None) -> int:
        def op(conn: sqlite3.Connection) -> int:
            cutoff = time.time() if now is None else now
            return conn.execute("DELETE FROM holds WHERE expires_at <= ?", (cutoff,)).rowcount

        return await self._run(op, atomic=True)

    async def usage(self, request_id: str) -> UsageRecord | None:
        def op(conn: sqlite3.Connection) -> UsageRecord | None:
            row = conn.execute(f"SELECT {USAGE_RECORD_COLUMNS} FROM usage WHERE request_id = ?",
                               (request_id,)).fetchone()
            return usage_record_of(row) if row else None

        return await self._run(op, READ)

    async def list_usage(self, key_id: str | None = None, limit: int = 50) -> list[UsageRecord]:
        limit = max(0, int(limit))

        def op(conn: sqlite3.Connection) -> list[UsageRecord]:
            if key_id is None:
                rows = conn.execute(f"SELECT {USAGE_RECORD_COLUMNS} FROM usage ORDER BY seq DESC LIMIT ?", (limit,))
            else:
                rows = conn.execute(
                    f"SELECT {USAGE_RECORD_COLUMNS} FROM usage WHERE key_id = ? ORDER BY seq DESC LIMIT ?",
                    (key_id, limit),
                )
            return [usage_record_of(r) for r in rows]

        return await self._run(op, READ)

    async def holds(self, key_id: str | None = None) -> list[Hold]:
        """Open holds (expired ones included until expire_holds drops them)."""

        def op(conn: sqlite3.Connection) -> list[Hold]:
            sql = "SELECT request_id, key_id, amount_micros, expires_at FROM holds"
            rows = conn.execute(sql + " WHERE key_id = ?", (key_id,)) if key_id else conn.execute(sql)
            return [Hold(*r) for r in rows]

        return await self._run(op, READ)

    async def audit(self) -> list[tuple[str, int, int]]:
        """Per key: (key_id, balance, sum(topups) - sum(debited)); the two must be equal."""

        def op(conn: sqlite3.Connection) -> list[tuple[str, int, int]]:
            return list(
                conn.execute(
                    "SELECT k.key_id, k.balance_micros,"
                    " (SELECT COALESCE(SUM(micros), 0) FROM topups t WHERE t.key_id = k.key_id)"
                    " - (SELECT COALESCE(SUM(debited_micros), 0) FROM usage u WHERE u.key_id = k.key_id)"
                    " FROM keys k WHERE k.own_balance ORDER BY k.key_id"
                )
            )

        return await self._run(op, READ)
