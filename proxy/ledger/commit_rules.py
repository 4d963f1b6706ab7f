"""The lease commit's rules, shared by both backends (sqlite.py, postgres.py): the row a usage
record is inserted as, each usage checked once into its row, and what a commit changes on the
lease rows. Pure: values in, rows and changes out; the backends hold the SQL.

A usage row, in the INSERT order of both backends (schema.py _INSERT_USAGE, pg_usage.py
USAGE_COLUMNS; rollup.py reads the same positions): request_id, key_id, model, input_tokens,
cached_tokens, output_tokens, reasoning_tokens, cost_micros, debited_micros, status,
created_at, worker, served_model, endpoint.
"""

from __future__ import annotations

from proxy.ledger.base import UsageRecord
from proxy.ledger.schema import _check_usage

__all__ = ["usage_row", "checked_rows", "lease_row_changes", "note_debits"]


def usage_row(usage: UsageRecord, request_id: str | None = None) -> tuple:
    """The row of `usage`, debited = cost (the caller clamps)."""
    cost = usage.cost_micros
    return (request_id or usage.request_id, usage.key_id, str(usage.model), usage.input_tokens, usage.cached_tokens,
            usage.output_tokens, usage.reasoning_tokens, cost, cost, usage.status, float(usage.created_at),
            None if usage.worker is None else str(usage.worker),
            None if usage.served_model is None else str(usage.served_model),
            None if usage.endpoint is None else str(usage.endpoint))


def checked_rows(usages: list[tuple[str, UsageRecord]]) -> list[tuple | ValueError]:
    """Each (lease id, usage) checked once: its ready-made row, or why it cannot be recorded."""
    rows: list[tuple | ValueError] = []
    for _, usage in usages:
        try:
            _check_usage(usage)
        except ValueError as exc:
            rows.append(exc)
            continue
        rows.append(usage_row(usage))
    return rows


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
