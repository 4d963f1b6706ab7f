"""The SQLite ledger's usage rows: lease_commit's batch inserted exactly once, each debit
clamped at what is left of its key's balance. The same contract as proxy/ledger/postgres/usage.py
(tests/ledger/test_lease_commit.py checks both against one model), by the same rules
(proxy/ledger/commit_rules.py: the row, which rows go in, the clamp); run by the writer
thread (proxy/ledger/sqlite/ledger.py lease_commit).
"""

from __future__ import annotations

import sqlite3
import time
from collections import defaultdict
from typing import Any, cast

from proxy.ledger.commit_rules import COST, DEBITED, plan_batch, settle_debit
from proxy.ledger.schema import KEY_CHAIN_COLUMNS
from proxy.ledger.sqlite.levels import LevelDebits
from proxy.ledger.usage import MAX_AMOUNT

_KEY_BALANCE = f"SELECT balance_micros, {KEY_CHAIN_COLUMNS} FROM keys WHERE key_id = ?"
_INSERT_USAGE = (
    "INSERT OR IGNORE INTO usage (request_id, key_id, model, input_tokens, cached_tokens,"
    " output_tokens, reasoning_tokens, cost_micros, debited_micros, status, created_at, worker, served_model,"
    " endpoint, transport, latency_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_NEWEST_USAGE = "SELECT request_id FROM usage ORDER BY seq DESC LIMIT ?"


def record_usage(
    conn: sqlite3.Connection, rows: list[Any], lease_ids: list[str]
) -> tuple[list[int | BaseException | None], dict[str, int], dict[str, int]]:
    """Insert the usage rows (or their validation errors) in order, each exactly once
    (UNIQUE request_id), debiting its cost clamped at what is left of its key's balance.
    Returns (per row: the debit, None if already recorded, or the error; the debits per
    key; per lease id of an inserted row, its debits). `rows` are checked_rows'; which go in
    and whether a debit clamps is commit_rules.plan_batch's rule, shared with PostgreSQL."""
    balances: dict[str, int | None] = {}
    chains: dict[str, tuple] = {}  # keys with levels above them (or no purse of their own)
    for row in rows:
        if type(row) is tuple and row[1] not in balances:
            found = conn.execute(_KEY_BALANCE, (row[1],)).fetchone()
            balances[row[1]] = found[0] if found else None
            if found and (not found[1] or found[2:] != (None, None, None)):
                chains[row[1]] = (bool(found[1]), found[2:])
    results, todo, clamps = plan_batch(rows, balances)
    debits: dict[str, int] = defaultdict(int)
    taken: dict[str, int] = defaultdict(int)
    if chains:
        _record_chained(conn, rows, lease_ids, todo, balances, chains, results, debits, taken)
        return results, debits, taken
    if not clamps:
        # No clamping, whichever rows turn out to be recorded already: every debit is
        # its cost, which the rows already say. One executemany for all of them.
        for i in _insert_unclamped(conn, rows, todo):
            cost = rows[i][COST]
            results[i] = cost
            debits[rows[i][1]] += cost
            taken[lease_ids[i]] += cost
        return results, debits, taken
    # A balance runs out: each debit depends on those before it, one row at a time.
    for i in todo:
        row = rows[i]
        key_id = row[1]
        balance = cast(int, balances[key_id])  # a known key: plan_batch kept it
        debit = settle_debit(row[COST], balance, None)
        if not conn.execute(_INSERT_USAGE, (*row[:DEBITED], debit, *row[DEBITED + 1:])).rowcount:
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


def _record_chained(conn: sqlite3.Connection, rows: list, lease_ids: list[str], todo: list[int],
                    balances: dict[str, int | None], chains: dict[str, tuple], results: list,
                    debits: dict[str, int], taken: dict[str, int]) -> None:
    """A batch with keys under levels (proxy/ledger/levels.py): one row at a time, each debit
    clamped at the smallest balance on its way (the key's own when it has one, each level's as
    it is after the rows before it), the levels written once at the end; `debits` keeps the
    keys' own purses' only (the caller takes those off the keys)."""
    on_levels = LevelDebits()  # each level read once, written once
    for i in todo:
        row = rows[i]
        key_id = row[1]
        own, levels = chains.get(key_id, (True, (None, None, None)))
        balance = cast(int, balances[key_id]) if own else MAX_AMOUNT
        if levels != (None, None, None):
            balance = min(balance, on_levels.balance(conn, levels))
        debit = settle_debit(row[COST], balance, None)
        if not conn.execute(_INSERT_USAGE, (*row[:DEBITED], debit, *row[DEBITED + 1:])).rowcount:
            continue  # recorded already: None
        if own:
            balances[key_id] = cast(int, balances[key_id]) - debit
            debits[key_id] += debit
        on_levels.add(levels, debit)
        results[i] = debit
        taken[lease_ids[i]] += debit
    on_levels.apply(conn, time.time())
