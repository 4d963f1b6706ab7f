"""The PostgreSQL ledger's levels (proxy/ledger/levels.py): a key's levels' money read and debited
in the transaction of its hold or settle, and the level store (PgLevelOps, a mixin of
PostgresLedger).

Lock order, everywhere money moves: the key rows first (in key_id order), then the level rows
(in level_id order). A hold of a key under a team locks its key, then the team; a batch of
settles locks all its keys, then all their levels. Two transactions never wait on each other
in a circle, so a team's keys on every replica serialise on the team's row and never deadlock.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from proxy.ledger.base import LedgerError, UnknownKey
from proxy.ledger.levels import (
    KEY_COLUMN,
    LEVEL_COLUMNS,
    LevelRecord,
    Purse,
    chain_room,
    debit_changes,
    kind_of,
    level_record_of,
    new_clock,
    spent_now,
)
from proxy.ledger.postgres.listen import CHANNEL
from proxy.ledger.schema import KEY_CHAIN_COLUMNS
from proxy.ledger.usage import MAX_AMOUNT

_NOTIFY = f"SELECT pg_notify('{CHANNEL}', $1)"
# A key's row locked with what a hold reads of it: its balance, whether it has a purse of its own, its levels.
LOCK_KEY_CHAIN = f"SELECT balance_micros, {KEY_CHAIN_COLUMNS} FROM keys WHERE key_id = $1 FOR UPDATE"
_LOCK = ("SELECT level_id, balance_micros, budget_micros, budget_period, budget_reset, period_spent, period_end"
         " FROM levels WHERE level_id = ANY($1::text[]) ORDER BY level_id FOR UPDATE")
_HELD = {kind: ("SELECT COALESCE(SUM(h.amount_micros), 0)::bigint FROM keys k JOIN holds h ON h.key_id = k.key_id"
                f" WHERE k.{column} = $1 AND h.expires_at > $2 AND h.request_id <> $3")
         for kind, column in KEY_COLUMN.items()}
_INSERT_TOPUP = "INSERT INTO level_topups (level_id, micros, created_at) VALUES ($1, $2, $3)"


def chain_of_row(own: Any, org: Any, team: Any, user: Any) -> tuple[bool, tuple[str, ...]] | None:
    """(own purse?, its level ids) of a key row's chain columns; None: the key stands alone."""
    levels = tuple(level for level in (org, team, user) if level is not None)
    return (bool(own), levels) if levels or not own else None


async def lock_levels(conn: Any, level_ids: Iterable[str]) -> dict[str, tuple]:
    """Lock the levels' rows in level_id order; their money columns by id."""
    ids = sorted(set(level_ids))
    if not ids:
        return {}
    rows = await conn.fetch(_LOCK, ids)
    found = {r[0]: tuple(r) for r in rows}
    missing = set(ids) - set(found)
    if missing:
        raise LedgerError(f"levels {sorted(missing)} of a key are missing")
    return found


async def purses(conn: Any, locked: dict[str, tuple], levels: tuple[str, ...], now: float,
                 exclude: str = "") -> list[Purse]:
    """Each level's money (locked by lock_levels), with the open holds of the keys under it."""
    out = []
    for level_id in levels:
        row = locked[level_id]
        held = await conn.fetchval(_HELD[kind_of(level_id) or "team"], level_id, now, exclude)
        out.append(Purse(level_id, row[1], row[2], spent_now(row[5], row[6], now), held))
    return out


def levels_balance(locked: dict[str, tuple], levels: tuple[str, ...], pending: dict[str, int] | None = None) -> int:
    """The smallest balance left among the levels (`pending`: debits not written yet)."""
    smallest = MAX_AMOUNT
    for level_id in levels:
        balance = locked[level_id][1]
        if balance is not None:
            smallest = min(smallest, balance - (pending.get(level_id, 0) if pending else 0))
    return smallest


async def debit_levels(conn: Any, locked: dict[str, tuple], debits: dict[str, int], now: float) -> None:
    """Take each level's debits off it (balance, this period's spend), in one round trip: a
    transaction's settles write each level once, however many rows it has."""
    changes = [(*debit_changes(locked[level_id], debit, now), level_id) for level_id, debit in debits.items() if debit]
    if changes:
        await conn.executemany("UPDATE levels SET balance_micros = $1, period_spent = $2, period_end = $3"
                               " WHERE level_id = $4", changes)


async def hold_chained(conn: Any, request_id: str, key_id: str, low: int, high: int, now: float, ttl: float,
                       lease_id: str | None, give_back: int) -> tuple[str, int | None]:
    """ledger_hold for a key under levels (proxy/ledger/levels.py), in the caller's
    transaction: the key's row locked, then its levels' (proxy/ledger/postgres/levels.py);
    the outcome and amount as ledger_hold answers them."""
    row = await conn.fetchrow(LOCK_KEY_CHAIN, key_id)
    if lease_id is not None:  # a lease's free part goes back first, kept even when refused
        await conn.execute("UPDATE holds SET amount_micros = GREATEST(0, amount_micros - $1)"
                           " WHERE request_id = $2", give_back, lease_id)
    if row is None:
        return "unknown_key", None
    own, levels = chain_of_row(*tuple(row)[1:]) or (True, ())
    locked = await lock_levels(conn, levels)
    held, settled = await conn.fetchrow(
        "SELECT (SELECT COALESCE(SUM(amount_micros), 0)::bigint FROM holds WHERE key_id = $1 AND expires_at > $2),"
        " EXISTS (SELECT 1 FROM usage WHERE request_id = $3)", key_id, now, request_id)
    if settled:
        return "duplicate", None
    room, binding = chain_room(row[0] - held if own else None, await purses(conn, locked, levels, now))
    if room < low:
        return f"insufficient:{binding or ''}", max(room, 0)
    amount = min(room, high)
    status = await conn.execute("INSERT INTO holds (request_id, key_id, amount_micros, expires_at)"
                                " VALUES ($1, $2, $3, $4) ON CONFLICT (request_id) DO NOTHING",
                                request_id, key_id, amount, now + ttl)
    return ("duplicate", None) if status.endswith(" 0") else ("held", amount)


class PgLevelOps:
    """The level store over the pool; mixed into PostgresLedger."""

    _db: Callable[..., Awaitable[Any]]

    async def get_level(self, level_id: str) -> LevelRecord | None:
        row = await self._db(lambda conn: conn.fetchrow(
            f"SELECT {LEVEL_COLUMNS} FROM levels WHERE level_id = $1", level_id), transaction=False)
        return level_record_of(row) if row else None

    async def get_levels(self, level_ids: tuple[str, ...]) -> list[LevelRecord]:
        if not level_ids:
            return []
        rows = await self._db(lambda conn: conn.fetch(
            f"SELECT {LEVEL_COLUMNS} FROM levels WHERE level_id = ANY($1::text[])", list(level_ids)),
            transaction=False)
        return [level_record_of(r) for r in rows]

    async def list_levels(self, kind: str | None = None, parent_id: str | None = None) -> list[LevelRecord]:
        rows = await self._db(lambda conn: conn.fetch(
            f"SELECT {LEVEL_COLUMNS} FROM levels WHERE ($1::text IS NULL OR kind = $1)"
            " AND ($2::text IS NULL OR parent_id = $2) ORDER BY created_at, level_id", kind, parent_id),
            transaction=False)
        return [level_record_of(r) for r in rows]

    async def _write_new_level(self, level_id: str, kind: str, parent_id: str | None,
                               columns: dict[str, Any]) -> LevelRecord:
        async def op(conn: Any) -> LevelRecord:
            now = time.time()
            names = ["level_id", "kind", "parent_id", "created_at", *columns]
            await conn.execute(f"INSERT INTO levels ({', '.join(names)})"
                               f" VALUES ({', '.join(f'${i + 1}' for i in range(len(names)))})",
                               level_id, kind, parent_id, now, *columns.values())
            if columns.get("balance_micros"):
                await conn.execute(_INSERT_TOPUP, level_id, columns["balance_micros"], now)
            return level_record_of(await conn.fetchrow(f"SELECT {LEVEL_COLUMNS} FROM levels WHERE level_id = $1",
                                                       level_id))

        return await self._db(op)

    async def _write_level(self, level_id: str, columns: dict[str, Any]) -> LevelRecord:
        async def op(conn: Any) -> LevelRecord:
            if columns:
                sets = ", ".join(f"{c} = ${i + 2}" for i, c in enumerate(columns))  # checked column names
                clock = await conn.fetchrow("SELECT budget_period, budget_reset FROM levels WHERE level_id = $1"
                                            " FOR UPDATE", level_id)
                if clock is not None and new_clock(tuple(clock), columns):
                    sets += ", period_end = NULL, period_spent = 0"  # a new clock starts a new period
                await conn.execute(f"UPDATE levels SET {sets} WHERE level_id = $1", level_id, *columns.values())
                await conn.execute(_NOTIFY, level_id)
            row = await conn.fetchrow(f"SELECT {LEVEL_COLUMNS} FROM levels WHERE level_id = $1", level_id)
            if row is None:
                raise UnknownKey(level_id)
            return level_record_of(row)

        return await self._db(op)

    async def _write_level_top_up(self, level_id: str, amount: int, check: Callable[[int | None], int]) -> int:
        async def op(conn: Any) -> int:
            row = await conn.fetchrow("SELECT balance_micros FROM levels WHERE level_id = $1 FOR UPDATE", level_id)
            if row is None:
                raise UnknownKey(level_id)
            balance = check(row[0])
            await conn.execute("UPDATE levels SET balance_micros = $1 WHERE level_id = $2", balance, level_id)
            await conn.execute(_INSERT_TOPUP, level_id, amount, time.time())
            return balance

        return await self._db(op)

    async def level_audit(self) -> list[tuple[str, int | None, int]]:
        """As SQLiteLedger.level_audit: per level with a balance, (id, balance, credits - debits)."""

        async def op(conn: Any) -> list[tuple[str, int | None, int]]:
            out = []
            for level_id, kind, balance in await conn.fetch(
                    "SELECT level_id, kind, balance_micros FROM levels WHERE balance_micros IS NOT NULL"
                    " ORDER BY level_id"):
                column = KEY_COLUMN[kind]
                credits = await conn.fetchval("SELECT COALESCE(SUM(micros), 0)::bigint FROM level_topups"
                                              " WHERE level_id = $1", level_id)
                debits = await conn.fetchval(f"SELECT COALESCE(SUM(u.debited_micros), 0)::bigint FROM usage u"
                                             f" JOIN keys k ON k.key_id = u.key_id WHERE k.{column} = $1", level_id)
                out.append((level_id, balance, credits - debits))
            return out

        return await self._db(op, transaction=False)
