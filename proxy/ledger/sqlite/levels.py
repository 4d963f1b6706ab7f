"""The SQLite ledger's levels (proxy/ledger/levels.py): the money of a key's levels read and
debited inside a hold's or a settle's transaction (`purses`, `LevelDebits`), and the level
store (LevelOps, a mixin of SQLiteLedger). Every write runs on the one writer thread under
BEGIN IMMEDIATE, so a level's check and its hold cannot interleave with another key's.
"""

from __future__ import annotations

import sqlite3
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from proxy.ledger.base import LedgerError, UnknownKey
from proxy.ledger.levels import (
    KEY_COLUMN,
    LEVEL_COLUMNS,
    LevelRecord,
    Purse,
    debit_changes,
    kind_of,
    level_record_of,
    new_clock,
    spent_now,
)
from proxy.ledger.sqlite.writer import Durability
from proxy.ledger.usage import MAX_AMOUNT

READ = Durability.READ

_MONEY = ("SELECT level_id, balance_micros, budget_micros, budget_period, budget_reset, period_spent, period_end"
          " FROM levels WHERE level_id IN (?, ?, ?)")  # a key has at most three levels (NULL matches none)
# The open holds of every key under a level, by the key column of its kind (an index each).
_HELD = {kind: ("SELECT COALESCE(SUM(h.amount_micros), 0) FROM keys k JOIN holds h ON h.key_id = k.key_id"
                f" WHERE k.{column} = ? AND h.expires_at > ? AND h.request_id != ?")
         for kind, column in KEY_COLUMN.items()}
_DEBIT = "UPDATE levels SET balance_micros = ?, period_spent = ?, period_end = ? WHERE level_id = ?"
_INSERT_TOPUP = "INSERT INTO level_topups (level_id, micros, created_at) VALUES (?, ?, ?)"


def money_rows(conn: sqlite3.Connection, levels: tuple[str | None, ...]) -> dict[str, tuple]:
    """The money columns of a key's levels (None entries skipped), by id: one statement."""
    wanted = [level_id for level_id in levels if level_id is not None]
    found = {row[0]: tuple(row) for row in conn.execute(_MONEY, (*wanted, None, None, None)[:3])}
    if len(found) != len(set(wanted)):
        raise LedgerError(f"levels {sorted(set(wanted) - set(found))} of a key are missing")
    return found


def purses(conn: sqlite3.Connection, levels: tuple[str | None, ...], now: float, exclude: str = "") -> list[Purse]:
    """The money of each level in `levels`, with the open holds of the keys under it (`exclude`,
    a hold row, left out)."""
    rows = money_rows(conn, levels)
    out = []
    for level_id, row in rows.items():
        held = conn.execute(_HELD[kind_of(level_id) or "team"], (level_id, now, exclude)).fetchone()[0]
        out.append(Purse(level_id, row[1], row[2], spent_now(row[5], row[6], now), held))
    return out


class LevelDebits:
    """The debits of one transaction's settles on the levels of their keys: each level's row read
    once, each debit clamped at what the levels have left after the ones before it (in memory),
    and every level written once at the end (`apply`), however many rows the transaction has."""

    __slots__ = ("rows", "debits")

    def __init__(self) -> None:
        self.rows: dict[str, tuple] = {}
        self.debits: dict[str, int] = defaultdict(int)

    def balance(self, conn: sqlite3.Connection, levels: tuple[str | None, ...]) -> int:
        """The smallest balance left among the levels (MAX_AMOUNT: none has one)."""
        if any(level_id not in self.rows for level_id in levels if level_id is not None):
            self.rows.update(money_rows(conn, levels))
        smallest = MAX_AMOUNT
        for level_id in levels:
            if level_id is not None and self.rows[level_id][1] is not None:
                smallest = min(smallest, self.rows[level_id][1] - self.debits[level_id])
        return smallest

    def add(self, levels: tuple[str | None, ...], debit: int) -> None:
        for level_id in levels:
            if level_id is not None:
                self.debits[level_id] += debit

    def apply(self, conn: sqlite3.Connection, now: float) -> None:
        changes = [(*debit_changes(self.rows[level_id], debit, now), level_id)
                   for level_id, debit in self.debits.items() if debit]
        if changes:
            conn.executemany(_DEBIT, changes)


class LevelOps:
    """The level store over the writer; mixed into SQLiteLedger."""

    _run: Callable[..., Awaitable[Any]]

    async def get_level(self, level_id: str) -> LevelRecord | None:
        def op(conn: sqlite3.Connection) -> LevelRecord | None:
            row = conn.execute(f"SELECT {LEVEL_COLUMNS} FROM levels WHERE level_id = ?", (level_id,)).fetchone()
            return level_record_of(row) if row else None

        return await self._run(op, READ)

    async def get_levels(self, level_ids: tuple[str, ...]) -> list[LevelRecord]:
        def op(conn: sqlite3.Connection) -> list[LevelRecord]:
            marks = ", ".join("?" for _ in level_ids)
            rows = conn.execute(f"SELECT {LEVEL_COLUMNS} FROM levels WHERE level_id IN ({marks})", level_ids)
            return [level_record_of(r) for r in rows]

        return await self._run(op, READ) if level_ids else []

    async def list_levels(self, kind: str | None = None, parent_id: str | None = None) -> list[LevelRecord]:
        def op(conn: sqlite3.Connection) -> list[LevelRecord]:
            where, args = [], []
            if kind is not None:
                where.append("kind = ?")
                args.append(kind)
            if parent_id is not None:
                where.append("parent_id = ?")
                args.append(parent_id)
            sql = f"SELECT {LEVEL_COLUMNS} FROM levels"
            if where:
                sql += " WHERE " + " AND ".join(where)
            return [level_record_of(r) for r in conn.execute(sql + " ORDER BY created_at, level_id", args)]

        return await self._run(op, READ)

    async def _write_new_level(self, level_id: str, kind: str, parent_id: str | None,
                               columns: dict[str, Any]) -> LevelRecord:
        def op(conn: sqlite3.Connection) -> LevelRecord:
            now = time.time()
            names = ["level_id", "kind", "parent_id", "created_at", *columns]
            conn.execute(f"INSERT INTO levels ({', '.join(names)}) VALUES ({', '.join('?' for _ in names)})",
                         (level_id, kind, parent_id, now, *columns.values()))
            if columns.get("balance_micros"):
                conn.execute(_INSERT_TOPUP, (level_id, columns["balance_micros"], now))
            row = conn.execute(f"SELECT {LEVEL_COLUMNS} FROM levels WHERE level_id = ?", (level_id,)).fetchone()
            return level_record_of(row)

        return await self._run(op)

    async def _write_level(self, level_id: str, columns: dict[str, Any]) -> LevelRecord:
        def op(conn: sqlite3.Connection) -> LevelRecord:
            if columns:
                sets = ", ".join(f"{c} = ?" for c in columns)  # checked column names
                clock = conn.execute("SELECT budget_period, budget_reset FROM levels WHERE level_id = ?",
                                     (level_id,)).fetchone()
                if clock is not None and new_clock(clock, columns):
                    sets += ", period_end = NULL, period_spent = 0"  # a new clock starts a new period
                conn.execute(f"UPDATE levels SET {sets} WHERE level_id = ?", (*columns.values(), level_id))
            row = conn.execute(f"SELECT {LEVEL_COLUMNS} FROM levels WHERE level_id = ?", (level_id,)).fetchone()
            if row is None:
                raise UnknownKey(level_id)
            return level_record_of(row)

        return await self._run(op)

    async def _write_level_top_up(self, level_id: str, amount: int, check: Callable[[int | None], int]) -> int:
        def op(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT balance_micros FROM levels WHERE level_id = ?", (level_id,)).fetchone()
            if row is None:
                raise UnknownKey(level_id)
            balance = check(row[0])
            conn.execute("UPDATE levels SET balance_micros = ? WHERE level_id = ?", (balance, level_id))
            conn.execute(_INSERT_TOPUP, (level_id, amount, time.time()))
            return balance

        return await self._run(op)

    async def level_audit(self) -> list[tuple[str, int | None, int]]:
        """Per level with a balance: (level_id, balance, sum(level_topups) - the debits of its
        keys' usage rows); the two must be equal."""

        def op(conn: sqlite3.Connection) -> list[tuple[str, int | None, int]]:
            out = []
            for level_id, kind, balance in conn.execute(
                    "SELECT level_id, kind, balance_micros FROM levels WHERE balance_micros IS NOT NULL"
                    " ORDER BY level_id").fetchall():
                column = KEY_COLUMN[kind]
                credits = conn.execute("SELECT COALESCE(SUM(micros), 0) FROM level_topups WHERE level_id = ?",
                                       (level_id,)).fetchone()[0]
                debits = conn.execute(f"SELECT COALESCE(SUM(u.debited_micros), 0) FROM usage u JOIN keys k"
                                      f" ON k.key_id = u.key_id WHERE k.{column} = ?", (level_id,)).fetchone()[0]
                out.append((level_id, balance, credits - debits))
            return out

        return await self._run(op, READ)
