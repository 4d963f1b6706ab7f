"""The money rules of the request path, shared by both backends (sqlite.py, postgres.py,
postgres/usage.py): what a hold, a settle and a lease grow may be asked for, what a settle debits,
what a lease grows by, the row a usage record is inserted as, each usage checked once into its
row, and what a lease commit changes on the lease rows. Pure: values in, rows and changes out;
the backends hold the SQL.

A usage row, in the INSERT order of both backends (sqlite/usage.py _INSERT_USAGE, postgres/usage.py
USAGE_COLUMNS; rollup.py reads the same positions): request_id, key_id, model, input_tokens,
cached_tokens, output_tokens, reasoning_tokens, cost_micros, debited_micros, status,
created_at, worker, served_model, endpoint, transport, latency_ms.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from proxy.ledger.base import UnknownKey, UsageRecord
from proxy.ledger.schema import as_int, check_usage, check_usage_values

__all__ = ["hold_range", "hold_ttl", "check_settle", "settle_debit", "lease_grow_args", "lease_grant", "usage_row",
           "checked_rows", "plan_batch", "lease_row_changes", "note_debits"]

COST = 7  # a usage row's cost_micros (and debited_micros next to it, DEBITED)
DEBITED = 8


def hold_range(min_micros: Any, max_micros: Any) -> tuple[int, int]:
    """hold_up_to's (min, max), checked: integers, min <= max."""
    low = as_int(min_micros, "min_micros")
    high = as_int(max_micros, "max_micros")
    if low > high:
        raise ValueError("min_micros must not exceed max_micros")
    return low, high


def hold_ttl(request_id: str, ttl_s: Any) -> float:
    """A hold's ttl, checked with its request id (required)."""
    if not request_id:
        raise ValueError("request_id is required")
    ttl = float(ttl_s)
    if not ttl > 0:
        raise ValueError("ttl_s must be positive")
    return ttl


def check_settle(request_id: str, usage: UsageRecord) -> None:
    """ValueError unless `usage` can be settled as `request_id`."""
    if not request_id:
        raise ValueError("request_id is required")
    check_usage_values(usage)


def settle_debit(cost: int, balance: int, held: int | None) -> int:
    """What a settle debits: its cost, never more than the balance, nor than the request's own
    hold while it exists (the money others hold stays theirs). A hold that expired meanwhile
    (None) no longer bounds it."""
    return max(0, min(cost, balance) if held is None else min(cost, balance, held))


def lease_grow_args(min_micros: Any, max_micros: Any, ttl_s: Any, share: Any) -> tuple[int, int, float, int]:
    """lease_grow's (min, max, ttl, share), checked."""
    return as_int(min_micros, "min_micros"), as_int(max_micros, "max_micros"), float(ttl_s), max(1, int(share))


def lease_grant(available: int, low: int, high: int, share: int) -> int:
    """What a lease grows by: min(high, available // share), `available` without the lease
    itself, so other processes keep the rest; nothing when that is below `low` (less than one
    request like the current one: the key stays on the exact path)."""
    grant = min(high, max(0, available) // share)
    return grant if grant >= low else 0


def usage_row(usage: UsageRecord, request_id: str | None = None) -> tuple:
    """The row of `usage`, debited = cost (the caller clamps)."""
    cost = usage.cost_micros
    return (request_id or usage.request_id, usage.key_id, str(usage.model), usage.input_tokens, usage.cached_tokens,
            usage.output_tokens, usage.reasoning_tokens, cost, cost, usage.status, float(usage.created_at),
            None if usage.worker is None else str(usage.worker),
            None if usage.served_model is None else str(usage.served_model),
            None if usage.endpoint is None else str(usage.endpoint),
            None if usage.transport is None else str(usage.transport),
            None if usage.latency_ms is None else float(usage.latency_ms))


def checked_rows(usages: list[tuple[str, UsageRecord]]) -> list[tuple | ValueError]:
    """Each (lease id, usage) checked once: its ready-made row, or why it cannot be recorded."""
    rows: list[tuple | ValueError] = []
    for _, usage in usages:
        try:
            check_usage(usage)
        except ValueError as exc:
            rows.append(exc)
            continue
        rows.append(usage_row(usage))
    return rows


def plan_batch(rows: list, balances: Mapping[str, int | None]
               ) -> tuple[list[int | BaseException | None], list[int], bool]:
    """A lease commit's batch of checked_rows against its keys' balances (None or absent: no
    such key): (per row: its error, else None for now; the indexes of the rows to insert, in
    order; whether a debit may clamp, i.e. some key's costs exceed its balance, so that each
    debit depends on those before it and the rows go one at a time). `type(row) is tuple`
    tells a row from its ValueError, which mypy cannot narrow on."""
    results: list[int | BaseException | None] = [None] * len(rows)
    wanted: dict[str, int] = defaultdict(int)  # the costs per known key
    todo: list[int] = []
    for i, row in enumerate(rows):
        if type(row) is not tuple:
            results[i] = row
        elif balances.get(row[1]) is None:
            results[i] = UnknownKey(row[1])
        else:
            wanted[row[1]] += row[COST]
            todo.append(i)
    clamps = any(cost > balances[key_id] for key_id, cost in wanted.items())  # type: ignore[operator]  # known keys
    return results, todo, clamps


def lease_row_changes(taken: dict[str, int], leases: list[tuple[str, int, float | None, bool]],
                      now: float) -> dict[str, list]:
    """Per lease id, [what comes off its row, its new expiry (None: left as it is), dropped?]:
    the debits `taken` off each lease, then each (lease id, give back, ttl, drop) of `leases`."""
    changes: dict[str, list] = {lease_id: [total, None, False] for lease_id, total in taken.items()}
    for lease_id, give_back, ttl, drop in leases:
        change = changes.setdefault(lease_id, [0, None, False])
        change[0] += max(0, int(give_back))
        if ttl is not None:
            change[1] = now + float(ttl)
        change[2] = change[2] or bool(drop)
    return changes


def note_debits(usages: list[tuple[str, UsageRecord]], results: list) -> None:
    """What each usage recorded now was debited, written back on its record (debited_micros)."""
    for (_, usage), result in zip(usages, results):
        if isinstance(result, int):
            usage.debited_micros = result
