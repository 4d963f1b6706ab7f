"""The PostgreSQL ledger's usage rows: the row of a UsageRecord, and lease_commit's batch
(insert exactly once, debit clamped at the balance, take the debits off the lease rows).
The same contract as proxy/ledger/sqlite/usage.py's record_usage (tests/ledger/test_lease_commit.py
checks both against one model), by the same rules (proxy/ledger/commit_rules.py), in
PostgreSQL: the key rows locked first, in key_id order.
The hourly sums of the rows inserted here are added by the database itself, in the same
transaction (the trigger of proxy/ledger/postgres/schema.py migration 3): nothing to call.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from proxy.ledger.base import UnknownKey
from proxy.ledger.commit_rules import COST, DEBITED, lease_row_changes, plan_batch, settle_debit
from proxy.ledger.postgres.levels import chain_of_row, debit_levels, levels_balance, lock_levels
from proxy.ledger.schema import KEY_CHAIN_COLUMNS
from proxy.ledger.usage import MAX_AMOUNT

USAGE_COLUMNS = ("request_id, key_id, model, input_tokens, cached_tokens, output_tokens, reasoning_tokens,"
                 " cost_micros, debited_micros, status, created_at, worker, served_model, endpoint, transport,"
                 " latency_ms")
_COST, _DEBITED = COST, DEBITED  # positions in a usage row (proxy/ledger/commit_rules.py)
_TYPES = ("text", "text", "text", "bigint", "bigint", "bigint", "bigint", "bigint", "bigint", "text",
          "float8", "text", "text", "text", "text", "float8")
_INSERT_ONE = (f"INSERT INTO usage ({USAGE_COLUMNS}) VALUES ({', '.join(f'${i + 1}' for i in range(len(_TYPES)))})"
               " ON CONFLICT (request_id) DO NOTHING")
# The whole batch in one statement: one array per column; RETURNING says which rows were new.
_INSERT_MANY = (f"INSERT INTO usage ({USAGE_COLUMNS}) SELECT * FROM unnest("
                + ", ".join(f"${i + 1}::{t}[]" for i, t in enumerate(_TYPES))
                + ") ON CONFLICT (request_id) DO NOTHING RETURNING request_id")
_DEBIT_KEY = "UPDATE keys SET balance_micros = balance_micros - $1 WHERE key_id = $2"


class _Purses:
    """The money a batch moves: its keys' rows locked (key_id order), then their levels' (level_id
    order, proxy/ledger/postgres/levels.py). `balances`: each key's own balance; `chains`: the keys
    under levels (or without a purse of their own), (own purse?, level ids)."""

    def __init__(self, balances: dict[str, int], chains: dict[str, tuple[bool, tuple[str, ...]]],
                 levels: dict[str, tuple]) -> None:
        self.balances, self.chains, self.levels = balances, chains, levels
        self.pending: dict[str, int] = defaultdict(int)  # the levels' debits, written by flush()

    def room(self, key_id: str) -> int:
        """The most the key's next debit may be: the smallest balance on its way."""
        own, level_ids = self.chains.get(key_id, (True, ()))
        return min(self.balances[key_id] if own else MAX_AMOUNT, levels_balance(self.levels, level_ids, self.pending))

    def debit(self, key_id: str, debit: int, debits: dict[str, int]) -> None:
        """Count `debit` against the key (its own purse: into `debits`, applied by the caller) and
        its levels (written by flush)."""
        own, level_ids = self.chains.get(key_id, (True, ()))
        if own:
            self.balances[key_id] -= debit
            debits[key_id] += debit
        for level_id in level_ids:
            self.pending[level_id] += debit

    async def flush(self, conn: Any) -> None:
        """Write the levels' debits: each level once."""
        if self.pending:
            await debit_levels(conn, self.levels, self.pending, time.time())


async def _lock_balances(conn: Any, rows: list) -> _Purses:
    key_ids = sorted({row[1] for row in rows if type(row) is tuple})
    if not key_ids:
        return _Purses({}, {}, {})
    locked = await conn.fetch(f"SELECT key_id, balance_micros, {KEY_CHAIN_COLUMNS} FROM keys"
                              " WHERE key_id = ANY($1::text[]) ORDER BY key_id FOR UPDATE", key_ids)
    chains = {r[0]: chain for r in locked if (chain := chain_of_row(*tuple(r)[2:])) is not None}
    levels = await lock_levels(conn, (level for _, ids in chains.values() for level in ids))
    return _Purses({r[0]: r[1] for r in locked}, chains, levels)


async def insert_usage_batch(conn: Any, rows: list[Any], lease_ids: list[str]
                             ) -> tuple[list[int | BaseException | None], dict[str, int]]:
    """Insert the rows (or their validation errors) in order, each exactly once, debiting
    its cost clamped at what is left of its key's balance. Returns (per row: the debit,
    None if recorded already, or the error; per lease id, the debits of its new rows).
    `rows` as proxy.ledger.sqlite.usage.record_usage takes them."""
    purses = await _lock_balances(conn, rows)
    balances = purses.balances
    results, todo, clamps = plan_batch(rows, balances)
    debits: dict[str, int] = defaultdict(int)
    taken: dict[str, int] = defaultdict(int)
    if purses.chains:  # keys under levels: one row at a time, each clamped at what the levels have left
        for i in todo:
            row = rows[i]
            debit = settle_debit(row[_COST], purses.room(row[1]), None)
            status = await conn.execute(_INSERT_ONE, *row[:_DEBITED], debit, *row[_DEBITED + 1:])
            if status.endswith(" 0"):
                continue
            purses.debit(row[1], debit, debits)
            results[i] = debit
            taken[lease_ids[i]] += debit
        await purses.flush(conn)
    elif todo and not clamps:
        # Nothing clamps, whichever rows turn out to be new: one statement for the batch.
        columns = [list(col) for col in zip(*(rows[i] for i in todo))]
        fresh = {r[0] for r in await conn.fetch(_INSERT_MANY, *columns)}
        for i in todo:
            row = rows[i]
            if row[0] in fresh:
                fresh.discard(row[0])  # twice in this batch: only the first was inserted
                results[i] = row[_COST]
                debits[row[1]] += row[_COST]
                taken[lease_ids[i]] += row[_COST]
    else:  # a balance runs out: each debit depends on those before it
        for i in todo:
            row = rows[i]
            debit = settle_debit(row[_COST], balances[row[1]], None)
            status = await conn.execute(_INSERT_ONE, *row[:_DEBITED], debit, *row[_DEBITED + 1:])
            if status.endswith(" 0"):
                continue
            balances[row[1]] -= debit
            results[i] = debit
            debits[row[1]] += debit
            taken[lease_ids[i]] += debit
    for key_id in sorted(debits):
        if debits[key_id]:
            await conn.execute(_DEBIT_KEY, debits[key_id], key_id)
    return results, taken


_HELD = "SELECT request_id, amount_micros FROM holds WHERE request_id = ANY($1::text[])"
_KNOWN = "SELECT request_id FROM usage WHERE request_id = ANY($1::text[])"


async def settle_batch(conn: Any, rows: list[tuple]) -> list[int | BaseException | None]:
    """Per-request settlements (each against its own hold), in order, each exactly once: the
    debit clamped at its hold (when the hold is still there) and at what is left of the
    balance; the holds deleted. Per row: the debit, None if recorded already, or UnknownKey.
    What PostgresLedger.settle does for one row, for a batch: the same locks first (the
    keys, in key_id order), then one read of the holds and the rows recorded, one insert."""
    results: list[int | BaseException | None] = [None] * len(rows)
    purses = await _lock_balances(conn, rows)
    balances = purses.balances
    ids = [row[0] for row in rows]
    held = {r[0]: r[1] for r in await conn.fetch(_HELD, ids)}
    known = {r[0] for r in await conn.fetch(_KNOWN, ids)}
    fresh: list[tuple] = []
    where: list[int] = []
    for i, row in enumerate(rows):
        request_id, key_id = row[0], row[1]
        if key_id not in balances:
            results[i] = UnknownKey(key_id)
            continue
        if request_id in known:
            continue
        known.add(request_id)
        debit = settle_debit(row[_COST], purses.room(key_id), held.get(request_id))
        purses.debit(key_id, debit, defaultdict(int))  # the keys' own: counted below
        fresh.append(row[:_DEBITED] + (debit,) + row[_DEBITED + 1:])
        where.append(i)
    debits: dict[str, int] = defaultdict(int)
    if fresh:
        inserted = {r[0] for r in await conn.fetch(_INSERT_MANY, *[list(col) for col in zip(*fresh)])}
        for i, row in zip(where, fresh):
            if row[0] in inserted:  # always, under the key locks every insert takes
                results[i] = row[_DEBITED]
                if purses.chains.get(row[1], (True,))[0]:  # a purse of its own (the levels: flushed below)
                    debits[row[1]] += row[_DEBITED]
    for key_id in sorted(debits):
        if debits[key_id]:
            await conn.execute(_DEBIT_KEY, debits[key_id], key_id)
    await purses.flush(conn)
    await conn.execute("DELETE FROM holds WHERE request_id = ANY($1::text[])",
                       [row[0] for row in rows if row[1] in balances])
    return results


async def lease_changes(conn: Any, taken: dict[str, int], leases: list[tuple[str, int, float | None, bool]],
                        now: float) -> set[str]:
    """Take the debits off their lease rows and apply each (lease id, give back, ttl, drop);
    the lease ids whose row had expired or vanished."""
    changes = lease_row_changes(taken, leases, now)
    lapsed: set[str] = set()
    for lease_id in sorted(changes):  # a fixed order: two commits never wait on each other's rows
        total, expires_at, drop = changes[lease_id]
        if drop:
            await conn.execute("DELETE FROM holds WHERE request_id = $1", lease_id)
            continue
        if expires_at is None:
            status = await conn.execute("UPDATE holds SET amount_micros = GREATEST(0, amount_micros - $1)"
                                        " WHERE request_id = $2 AND expires_at > $3", total, lease_id, now)
        else:
            status = await conn.execute("UPDATE holds SET amount_micros = GREATEST(0, amount_micros - $1),"
                                        " expires_at = $2 WHERE request_id = $3 AND expires_at > $4",
                                        total, expires_at, lease_id, now)
        if status.endswith(" 0"):
            lapsed.add(lease_id)
    return lapsed
