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

from proxy.ledger.base import USAGE_ROW_COLUMNS, AuditEntry, UsageRecord, UsageTotals, page_limit
from proxy.ledger.key_rules import AUDIT_COLUMNS, AUDIT_INSERT_COLUMNS, audit_entry, audit_values
from proxy.ledger.rollup import Filters, merge_totals, totals_dialect, totals_queries, usage_filters, where_sql
from proxy.ledger.sqlite.writer import Durability

READ = Durability.READ

def _where(filters: Filters, statuses: tuple[str, ...] | None = None) -> tuple[str, list[Any]]:
    # "?" placeholders; SQLite has no arrays, so one placeholder a status.
    return where_sql(filters, statuses, mark=lambda n: "?",
                     status_in=lambda given, n: (f"status IN ({', '.join('?' for _ in given)})", list(given)))


_TOTALS = totals_dialect(day="CAST(created_at / 86400 AS INTEGER) * 86400",
                         hour="CAST(created_at / 3600 AS INTEGER) * 3600",
                         rollup_day="CAST(hour / 86400 AS INTEGER) * 86400", cast="", where=_where)


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
                         statuses: tuple[str, ...] | None = None,
                         endpoint: str | None = None) -> list[tuple[int, UsageRecord]]:
        where, params = _where(usage_filters(since, until, key_id, model, before_seq, endpoint), statuses)

        def op(conn: sqlite3.Connection) -> list[tuple[int, UsageRecord]]:
            rows = conn.execute(f"SELECT {USAGE_ROW_COLUMNS} FROM usage{where} ORDER BY seq DESC LIMIT ?",
                                (*params, page_limit(limit)))
            return [(r[0], UsageRecord(*r[1:])) for r in rows]

        return await self._run(op, READ)

    async def usage_totals(self, group_by: tuple[str, ...], *, since: float | None = None,
                           until: float | None = None, key_id: str | None = None,
                           model: str | None = None, statuses: tuple[str, ...] | None = None) -> list[UsageTotals]:
        queries = totals_queries(_TOTALS, group_by, since, until, key_id, model, statuses)

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
