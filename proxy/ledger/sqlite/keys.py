"""The SQLite ledger's key management: the SQL of each key change, and the key reads.

A mixin of SQLiteLedger (proxy/ledger/sqlite/ledger.py), which supplies `_run` (the group-commit
writer) and `_get_key`. What a change means (the checks, key_generation) is
proxy/ledger/key_rules.py's `RuledKeyStore`, shared with the PostgreSQL ledger. Every change
commits fsync'd (SYNC, the writer's default).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from proxy.ledger.base import KeyRecord, UnknownKey
from proxy.ledger.key_rules import INSERT_COLUMNS, NewKey, RuledKeyStore, check_rotatable, topped_up
from proxy.ledger.schema import KEY_COLUMNS, key_record_of
from proxy.ledger.sqlite.writer import Durability

READ = Durability.READ
_INSERT_KEY = f"INSERT INTO keys ({', '.join(INSERT_COLUMNS)}) VALUES ({', '.join('?' for _ in INSERT_COLUMNS)})"
_INSERT_TOPUP = "INSERT INTO topups (key_id, micros, created_at) VALUES (?, ?, ?)"


class KeyOps(RuledKeyStore):
    """Key management over the writer; mixed into SQLiteLedger."""

    # SQLiteLedger's, which mixes this in (declared for the type checker: no value here)
    _run: Callable[..., Awaitable[Any]]
    _get_key: Callable[[sqlite3.Connection, str], KeyRecord | None]

    async def get_key(self, key_id: str) -> KeyRecord | None:
        return await self._run(lambda conn: self._get_key(conn, key_id), READ)

    async def list_keys(self) -> list[KeyRecord]:
        def op(conn: sqlite3.Connection) -> list[KeyRecord]:
            rows = conn.execute(f"SELECT {KEY_COLUMNS} FROM keys WHERE NOT deleted ORDER BY created_at, key_id")
            return [key_record_of(r) for r in rows]

        return await self._run(op, READ)

    async def _write_new_key(self, key: NewKey) -> KeyRecord:
        def op(conn: sqlite3.Connection) -> KeyRecord:
            now = time.time()
            conn.execute(_INSERT_KEY, key.row(now))
            if key.balance:
                conn.execute(_INSERT_TOPUP, (key.key_id, key.balance, now))
            return cast(KeyRecord, self._get_key(conn, key.key_id))  # written just above

        return await self._run(op)

    async def _write_top_up(self, key_id: str, amount: int) -> int:
        def op(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT balance_micros FROM keys WHERE key_id = ?", (key_id,)).fetchone()
            balance = topped_up(key_id, row[0] if row else None, amount)
            conn.execute("UPDATE keys SET balance_micros = balance_micros + ? WHERE key_id = ?", (amount, key_id))
            conn.execute(_INSERT_TOPUP, (key_id, amount, time.time()))
            return balance

        return await self._run(op)

    async def _write_limits(self, key_id: str, changes: dict[str, Any]) -> KeyRecord:
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

        return await self._run(op)

    async def _write_revoked(self, key_id: str) -> None:
        def op(conn: sqlite3.Connection) -> None:
            if conn.execute("UPDATE keys SET revoked = 1 WHERE key_id = ?", (key_id,)).rowcount == 0:
                raise UnknownKey(key_id)

        await self._run(op)

    async def _write_secret(self, key_id: str, prefix: str, digest: bytes, grace_s: float) -> KeyRecord:
        def op(conn: sqlite3.Connection) -> KeyRecord:
            row = conn.execute("SELECT revoked FROM keys WHERE key_id = ?", (key_id,)).fetchone()
            check_rotatable(key_id, row[0] if row else None)
            # The old secret stays findable as the previous one until the grace ends (none: gone now).
            conn.execute("UPDATE keys SET prev_secret_sha256 = CASE WHEN ? > 0 THEN secret_sha256 END,"
                         " prev_secret_until = CASE WHEN ? > 0 THEN ? END, secret_sha256 = ?, prefix = ?"
                         " WHERE key_id = ?", (grace_s, grace_s, time.time() + grace_s, digest, prefix, key_id))
            return cast(KeyRecord, self._get_key(conn, key_id))  # written just above

        return await self._run(op)

    async def _write_deleted(self, key_id: str) -> None:
        def op(conn: sqlite3.Connection) -> None:
            if conn.execute("UPDATE keys SET revoked = 1, deleted = 1, prev_secret_sha256 = NULL WHERE key_id = ?",
                            (key_id,)).rowcount == 0:
                raise UnknownKey(key_id)

        await self._run(op)
