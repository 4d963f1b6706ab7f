"""The SQLite ledger's key management: create, list, top up, limits, revoke, rotate.

A mixin of SQLiteLedger (proxy/ledger/sqlite.py), which supplies `_run` (the group-commit
writer) and `_get_key`. Every change commits fsync'd (SYNC, the writer's default); changes
that a cached lookup could miss bump `key_generation` after the commit (also on error:
a cache flush is always safe).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from proxy.ledger.base import UNSET, KeyRecord, LedgerError, UnknownKey
from proxy.ledger.key_rules import limit_changes, new_key, topped_up
from proxy.ledger.schema import KEY_COLUMNS, _int, _key_record, hash_secret, new_secret
from proxy.ledger.writer import Durability

READ = Durability.READ


class KeyOps:
    """Key management over the writer; mixed into SQLiteLedger."""

    key_generation: int
    # SQLiteLedger's, which mixes this in (declared for the type checker: no value here)
    _run: Callable[..., Awaitable[Any]]
    _get_key: Callable[[sqlite3.Connection, str], KeyRecord | None]

    async def create_key(
        self,
        name: str,
        balance_micros: int = 0,
        allowed_models: list[str] | tuple[str, ...] | None = None,
        concurrency: int | None = None,
        rate_per_min: int | None = None,
        *,
        tokens_per_min: int | None = None,
        daily_budget_micros: int | None = None,
        monthly_budget_micros: int | None = None,
        expires_at: float | None = None,
    ) -> tuple[str, KeyRecord]:
        key = new_key(name, balance_micros, {
            "allowed_models": allowed_models, "concurrency": concurrency, "rate_per_min": rate_per_min,
            "expires_at": expires_at, "tokens_per_min": tokens_per_min,
            "daily_budget_micros": daily_budget_micros, "monthly_budget_micros": monthly_budget_micros})
        key_id, balance = key.key_id, key.balance

        def op(conn: sqlite3.Connection) -> KeyRecord:
            now = time.time()
            conn.execute(
                "INSERT INTO keys (key_id, name, prefix, secret_sha256, balance_micros, allowed_models,"
                " concurrency, rate_per_min, expires_at, tokens_per_min, daily_budget_micros,"
                " monthly_budget_micros, revoked, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                (key_id, key.name, key.secret[:12], key.digest, balance, *key.limits, now),
            )
            if balance:
                conn.execute(
                    "INSERT INTO topups (key_id, micros, created_at) VALUES (?, ?, ?)", (key_id, balance, now)
                )
            return cast(KeyRecord, self._get_key(conn, key_id))  # written just above

        return key.secret, await self._run(op)

    async def get_key(self, key_id: str) -> KeyRecord | None:
        return await self._run(lambda conn: self._get_key(conn, key_id), READ)

    async def list_keys(self) -> list[KeyRecord]:
        def op(conn: sqlite3.Connection) -> list[KeyRecord]:
            rows = conn.execute(f"SELECT {KEY_COLUMNS} FROM keys ORDER BY created_at, key_id")
            return [_key_record(r) for r in rows]

        return await self._run(op, READ)

    async def top_up(self, key_id: str, micros: int) -> int:
        amount = _int(micros, "micros", minimum=None)

        def op(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT balance_micros FROM keys WHERE key_id = ?", (key_id,)).fetchone()
            if row is None:
                raise UnknownKey(key_id)
            balance = topped_up(row[0], amount)
            conn.execute("UPDATE keys SET balance_micros = balance_micros + ? WHERE key_id = ?", (amount, key_id))
            conn.execute(
                "INSERT INTO topups (key_id, micros, created_at) VALUES (?, ?, ?)", (key_id, amount, time.time())
            )
            return balance

        return await self._run(op)

    async def set_limits(
        self,
        key_id: str,
        *,
        allowed_models: Any = UNSET,
        concurrency: Any = UNSET,
        rate_per_min: Any = UNSET,
        tokens_per_min: Any = UNSET,
        daily_budget_micros: Any = UNSET,
        monthly_budget_micros: Any = UNSET,
        expires_at: Any = UNSET,
    ) -> KeyRecord:
        changes = limit_changes({
            "allowed_models": allowed_models, "concurrency": concurrency, "rate_per_min": rate_per_min,
            "tokens_per_min": tokens_per_min, "daily_budget_micros": daily_budget_micros,
            "monthly_budget_micros": monthly_budget_micros, "expires_at": expires_at})

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

    async def rotate_key(self, key_id: str) -> tuple[str, KeyRecord]:
        secret = new_secret()
        digest = hash_secret(secret)

        def op(conn: sqlite3.Connection) -> KeyRecord:
            row = conn.execute("SELECT revoked FROM keys WHERE key_id = ?", (key_id,)).fetchone()
            if row is None:
                raise UnknownKey(key_id)
            if row[0]:
                raise LedgerError(f"key {key_id!r} is revoked: create a new key instead")
            conn.execute("UPDATE keys SET secret_sha256 = ?, prefix = ? WHERE key_id = ?",
                         (digest, secret[:12], key_id))
            return cast(KeyRecord, self._get_key(conn, key_id))  # written just above

        try:
            return secret, await self._run(op)
        finally:
            self.key_generation += 1

