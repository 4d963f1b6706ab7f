"""The PostgreSQL ledger's key management: create, list, top up, limits, revoke, rotate.

A mixin of PostgresLedger (proxy/ledger/postgres.py), which supplies `_db` (a pooled
connection in a transaction) and `key_generation`. The values are checked by the same
rules as the SQLite ledger's (proxy/ledger/key_rules.py). A change a cached
lookup could miss (limits, revoke, rotate) NOTIFYs every replica in its own transaction
(proxy/ledger/pg_listen.py) and bumps this object's key_generation after the commit (also
on error: a cache flush is always safe). A top-up does not: no cached field depends on it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from proxy.ledger.base import UNSET, KeyRecord, LedgerError, UnknownKey
from proxy.ledger.key_rules import limit_changes, new_key, topped_up
from proxy.ledger.pg_listen import CHANNEL
from proxy.ledger.schema import KEY_COLUMNS, _int, _key_record, hash_secret, new_secret

_NOTIFY = f"SELECT pg_notify('{CHANNEL}', $1)"


async def _get_key(conn: Any, key_id: str) -> KeyRecord | None:
    row = await conn.fetchrow(f"SELECT {KEY_COLUMNS} FROM keys WHERE key_id = $1", key_id)
    return _key_record(tuple(row)) if row else None


class PgKeyOps:
    """Key management over the pool; mixed into PostgresLedger."""

    key_generation: int
    # PostgresLedger's, which mixes this in (declared for the type checker: no value here)
    _db: Callable[..., Awaitable[Any]]

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

        async def op(conn: Any) -> KeyRecord:
            now = time.time()
            await conn.execute(
                "INSERT INTO keys (key_id, name, prefix, secret_sha256, balance_micros, allowed_models,"
                " concurrency, rate_per_min, expires_at, tokens_per_min, daily_budget_micros,"
                " monthly_budget_micros, revoked, created_at)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, FALSE, $13)",
                key_id, key.name, key.secret[:12], key.digest, balance, *key.limits, now)
            if balance:
                await conn.execute("INSERT INTO topups (key_id, micros, created_at) VALUES ($1, $2, $3)",
                                   key_id, balance, now)
            return cast(KeyRecord, await _get_key(conn, key_id))  # written just above

        return key.secret, await self._db(op)

    async def get_key(self, key_id: str) -> KeyRecord | None:
        return await self._db(lambda conn: _get_key(conn, key_id), transaction=False)

    async def list_keys(self) -> list[KeyRecord]:
        async def op(conn: Any) -> list[KeyRecord]:
            rows = await conn.fetch(f"SELECT {KEY_COLUMNS} FROM keys ORDER BY created_at, key_id")
            return [_key_record(tuple(r)) for r in rows]

        return await self._db(op, transaction=False)

    async def top_up(self, key_id: str, micros: int) -> int:
        amount = _int(micros, "micros", minimum=None)

        async def op(conn: Any) -> int:
            balance = await conn.fetchval("SELECT balance_micros FROM keys WHERE key_id = $1 FOR UPDATE", key_id)
            if balance is None:
                raise UnknownKey(key_id)
            after = topped_up(balance, amount)
            await conn.execute("UPDATE keys SET balance_micros = balance_micros + $1 WHERE key_id = $2",
                               amount, key_id)
            await conn.execute("INSERT INTO topups (key_id, micros, created_at) VALUES ($1, $2, $3)",
                               key_id, amount, time.time())
            return after

        return await self._db(op)

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

        async def op(conn: Any) -> KeyRecord:
            if changes:
                assignments = ", ".join(f"{column} = ${i + 2}" for i, column in enumerate(changes))  # fixed names
                status = await conn.execute(f"UPDATE keys SET {assignments} WHERE key_id = $1",
                                            key_id, *changes.values())
                if status.endswith(" 0"):
                    raise UnknownKey(key_id)
                await conn.execute(_NOTIFY, key_id)
            record = await _get_key(conn, key_id)
            if record is None:
                raise UnknownKey(key_id)
            return record

        try:
            return await self._db(op)
        finally:
            self.key_generation += 1

    async def revoke(self, key_id: str) -> None:
        async def op(conn: Any) -> None:
            if (await conn.execute("UPDATE keys SET revoked = TRUE WHERE key_id = $1", key_id)).endswith(" 0"):
                raise UnknownKey(key_id)
            await conn.execute(_NOTIFY, key_id)

        try:
            await self._db(op)
        finally:
            self.key_generation += 1  # after the commit: caches filled before it are stale

    async def rotate_key(self, key_id: str) -> tuple[str, KeyRecord]:
        secret = new_secret()
        digest = hash_secret(secret)

        async def op(conn: Any) -> KeyRecord:
            revoked = await conn.fetchval("SELECT revoked FROM keys WHERE key_id = $1 FOR UPDATE", key_id)
            if revoked is None:
                raise UnknownKey(key_id)
            if revoked:
                raise LedgerError(f"key {key_id!r} is revoked: create a new key instead")
            await conn.execute("UPDATE keys SET secret_sha256 = $1, prefix = $2 WHERE key_id = $3",
                               digest, secret[:12], key_id)
            await conn.execute(_NOTIFY, key_id)
            return cast(KeyRecord, await _get_key(conn, key_id))  # written just above

        try:
            return secret, await self._db(op)
        finally:
            self.key_generation += 1
