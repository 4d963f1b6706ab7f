"""The SQLite ledger's reads and writes for the operator's console: the audit log, usage
rows over a time range (paginated by seq), usage totals grouped by key / model / worker /
day / hour, and a key's spend since a time (budgets).

A mixin of SQLiteLedger (proxy/ledger/sqlite/ledger.py), which supplies `_run`. Only SQL lives
here: what a group, a filter or a range means is proxy/ledger/rollup.py's (shared with the
PostgreSQL ledger) and the caller's (proxy/ledger/service.py); an audit row's encoding is
proxy/ledger/key_rules.py's.
The ranges use the indexes usage_by_time(created_at) and usage_by_key_time(key_id,
created_at) (proxy/ledger/schema.py; tests/ledger/test_console.py checks the query plans).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from proxy.ledger.base import USAGE_GROUPS, USAGE_ROW_COLUMNS, AuditEntry, UsageRecord, UsageTotals, page_limit
from proxy.ledger.key_rules import AUDIT_COLUMNS, AUDIT_INSERT_COLUMNS, audit_entry, audit_values
from proxy.ledger.rollup import (
    GROUP_SQL,
    ROLLUP_GROUP_SQL,
    Filters,
    check_group_by,
    hourly_filters,
    merge_totals,
    split_totals,
    sums_sql,
    usage_filters,
)
from proxy.ledger.sqlite.writer import Durability

READ = Durability.READ

# Each group's SQL expression; "day" and "hour" are the UTC bucket's start in Unix seconds.
_GROUP_SQL = {
    **GROUP_SQL,
    "day": "CAST(created_at / 86400 AS INTEGER) * 86400",
    "hour": "CAST(created_at / 3600 AS INTEGER) * 3600",
}
assert set(_GROUP_SQL) == set(USAGE_GROUPS)
# The same groups over usage_hourly (proxy/ledger/schema.py: ROLLUP).
_ROLLUP_GROUP_SQL = {**ROLLUP_GROUP_SQL, "day": "CAST(hour / 86400 AS INTEGER) * 86400"}
_ROLLUP_SUMS = sums_sql("COALESCE(SUM(requests), 0)")
_SUMS = sums_sql("COUNT(*)")


def _where(filters: Filters, statuses: tuple[str, ...] | None = None) -> tuple[str, list[Any]]:
    clauses = [f"{clause} ?" for clause, _ in filters]
    params = [value for _, value in filters]
    if statuses:
        clauses.append(f"status IN ({', '.join('?' for _ in statuses)})")
        params.extend(statuses)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


def _totals_sql(group_by: tuple[str, ...], columns: dict[str, str], table: str, where: str, params: list,
                rolled: bool = False) -> tuple[str, list]:
    exprs = [columns[g] for g in group_by]
    select = ", ".join([*exprs, _ROLLUP_SUMS if rolled else _SUMS])
    grouping = f" GROUP BY {', '.join(str(i + 1) for i in range(len(exprs)))}" if exprs else ""
    return f"SELECT {select} FROM {table}{where}{grouping}", params


class ConsoleOps:
    """The console's ledger operations over the writer; mixed into SQLiteLedger."""

    # SQLiteLedger's, which mixes this in (declared for the type checker: no value here)
    _run: Callable[..., Awaitable[Any]]

    async def append_audit(self, actor: str, action: str, key_id: str | None, details: dict[str, Any]) -> AuditEntry:
        def op(conn: sqlite3.Connection) -> AuditEntry:
            values = audit_values(time.time(), actor, action, key_id, details)
            cur = conn.execute(f"INSERT INTO audit ({AUDIT_INSERT_COLUMNS}) VALUES (?, ?, ?, ?, ?)", values)
            return audit_entry((cast(int, cur.lastrowid), *values))

        return await self._run(op)

    async def list_audit(self, *, key_id: str | None = None, since: float | None = None,
                         until: float | None = None, before_seq: int | None = None,
                         limit: int = 100) -> list[AuditEntry]:
        where, params = _where(usage_filters(since, until, key_id, None, before_seq))

        def op(conn: sqlite3.Connection) -> list[AuditEntry]:
            rows = conn.execute(f"SELECT {AUDIT_COLUMNS} FROM audit{where} ORDER BY seq DESC LIMIT ?",
                                (*params, page_limit(limit)))
            return [audit_entry(r) for r in rows]

        return await self._run(op, READ)

    async def usage_rows(self, *, since: float | None = None, until: float | None = None,
                         key_id: str | None = None, model: str | None = None,
                         before_seq: int | None = None, limit: int = 100,
                         statuses: tuple[str, ...] | None = None) -> list[tuple[int, UsageRecord]]:
        where, params = _where(usage_filters(since, until, key_id, model, before_seq), statuses)

        def op(conn: sqlite3.Connection) -> list[tuple[int, UsageRecord]]:
            rows = conn.execute(f"SELECT {USAGE_ROW_COLUMNS} FROM usage{where} ORDER BY seq DESC LIMIT ?",
                                (*params, page_limit(limit)))
            return [(r[0], UsageRecord(*r[1:])) for r in rows]

        return await self._run(op, READ)

    async def usage_totals(self, group_by: tuple[str, ...], *, since: float | None = None,
                           until: float | None = None, key_id: str | None = None,
                           model: str | None = None, statuses: tuple[str, ...] | None = None) -> list[UsageTotals]:
        check_group_by(group_by)
        # Whole hours come from the hourly sums; the ragged ends of the range, and any
        # status filter (the sums do not keep statuses), from the rows (proxy/ledger/rollup.py).
        raw, whole = split_totals(since, until, statuses)
        queries = [_totals_sql(group_by, _GROUP_SQL, "usage", *_where(usage_filters(lo, hi, key_id, model), statuses))
                   for lo, hi in raw]
        if whole is not None:
            queries.append(_totals_sql(group_by, _ROLLUP_GROUP_SQL, "usage_hourly",
                                       *_where(hourly_filters(whole, key_id, model)), rolled=True))

        def op(conn: sqlite3.Connection) -> list[UsageTotals]:
            return merge_totals(group_by, (conn.execute(sql, params) for sql, params in queries))

        return await self._run(op, READ)

    async def spend_since(self, key_id: str, since: float) -> int:
        def op(conn: sqlite3.Connection) -> int:
            return conn.execute(
                "SELECT COALESCE(SUM(debited_micros), 0) FROM usage WHERE key_id = ? AND created_at >= ?",
                (key_id, float(since)),
            ).fetchone()[0]

        return await self._run(op, READ)

    async def explain(self, sql: str, params: tuple = ()) -> list[str]:
        """SQLite's query plan of `sql` (tests check that the console's reads use the indexes)."""
        return await self._run(lambda conn: [r[-1] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params)], READ)
