"""The PostgreSQL ledger's key management: the SQL of each key change, and the key reads.

A mixin of PostgresLedger (proxy/ledger/postgres/ledger.py), which supplies `_db` (a pooled
connection in a transaction). What a change means (the checks, key_generation) is
proxy/ledger/key_rules.py's `RuledKeyStore`, shared with the SQLite ledger. A change a cached
lookup could miss (limits, revoke, rotate) also NOTIFYs every replica in its own transaction
(proxy/ledger/postgres/listen.py). A top-up does not: no cached field depends on it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from proxy.ledger.base import KeyRecord, UnknownKey
from proxy.ledger.key_rules import INSERT_COLUMNS, NewKey, RuledKeyStore, check_rotatable, topped_up
from proxy.ledger.postgres.listen import CHANNEL
from proxy.ledger.schema import KEY_COLUMNS, key_record_of

_NOTIFY = f"SELECT pg_notify('{CHANNEL}', $1)"
_INSERT_KEY = (f"INSERT INTO keys ({', '.join(INSERT_COLUMNS)})"
               f" VALUES ({', '.join(f'${i + 1}' for i in range(len(INSERT_COLUMNS)))})")
_INSERT_TOPUP = "INSERT INTO topups (key_id, micros, created_at) VALUES ($1, $2, $3)"


async def _get_key(conn: Any, key_id: str) -> KeyRecord | None:
    row = await conn.fetchrow(f"SELECT {KEY_COLUMNS} FROM keys WHERE key_id = $1", key_id)
    return key_record_of(tuple(row)) if row else None


class PgKeyOps(RuledKeyStore):
    """Key management over the pool; mixed into PostgresLedger."""

    # PostgresLedger's, which mixes this in (declared for the type checker: no value here)
    _db: Callable[..., Awaitable[Any]]

    async def get_key(self, key_id: str) -> KeyRecord | None:
        return await self._db(lambda conn: _get_key(conn, key_id), transaction=False)

    async def list_keys(self) -> list[KeyRecord]:
        async def op(conn: Any) -> list[KeyRecord]:
            rows = await conn.fetch(f"SELECT {KEY_COLUMNS} FROM keys WHERE NOT deleted ORDER BY created_at, key_id")
            return [key_record_of(tuple(r)) for r in rows]

        return await self._db(op, transaction=False)

    async def _write_new_key(self, key: NewKey) -> KeyRecord:
        async def op(conn: Any) -> KeyRecord:
            now = time.time()
            await conn.execute(_INSERT_KEY, *key.row(now))
            if key.balance:
                await conn.execute(_INSERT_TOPUP, key.key_id, key.balance, now)
            return cast(KeyRecord, await _get_key(conn, key.key_id))  # written just above

        return await self._db(op)

    async def _write_top_up(self, key_id: str, amount: int) -> int:
        async def op(conn: Any) -> int:
            balance = await conn.fetchval("SELECT balance_micros FROM keys WHERE key_id = $1 FOR UPDATE", key_id)
            after = topped_up(key_id, balance, amount)
            await conn.execute("UPDATE keys SET balance_micros = balance_micros + $1 WHERE key_id = $2",
                               amount, key_id)
            await conn.execute(_INSERT_TOPUP, key_id, amount, time.time())
            return after

        return await self._db(op)

    async def _write_limits(self, key_id: str, changes: dict[str, Any]) -> KeyRecord:
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

        return await self._db(op)

    async def _write_revoked(self, key_id: str) -> None:
        async def op(conn: Any) -> None:
            if (await conn.execute("UPDATE keys SET revoked = TRUE WHERE key_id = $1", key_id)).endswith(" 0"):
                raise UnknownKey(key_id)
            await conn.execute(_NOTIFY, key_id)

        await self._db(op)

    async def _write_secret(self, key_id: str, prefix: str, digest: bytes, grace_s: float) -> KeyRecord:
        async def op(conn: Any) -> KeyRecord:
            revoked = await conn.fetchval("SELECT revoked FROM keys WHERE key_id = $1 FOR UPDATE", key_id)
            check_rotatable(key_id, revoked)
            # The old secret stays findable as the previous one until the grace ends (none: gone now).
            await conn.execute("UPDATE keys SET prev_secret_sha256 = CASE WHEN $4 > 0 THEN secret_sha256 END,"
                               " prev_secret_until = CASE WHEN $4 > 0 THEN $5::float8 END,"
                               " secret_sha256 = $1, prefix = $2 WHERE key_id = $3",
                               digest, prefix, key_id, grace_s, time.time() + grace_s)
            await conn.execute(_NOTIFY, key_id)
            return cast(KeyRecord, await _get_key(conn, key_id))  # written just above

        return await self._db(op)

    async def _write_deleted(self, key_id: str) -> None:
        async def op(conn: Any) -> None:
            status = await conn.execute("UPDATE keys SET revoked = TRUE, deleted = TRUE, prev_secret_sha256 = NULL"
                                        " WHERE key_id = $1", key_id)
            if status.endswith(" 0"):
                raise UnknownKey(key_id)
            await conn.execute(_NOTIFY, key_id)

        await self._db(op)
