"""The PostgreSQL ledger's reads and writes for the operator's console: the audit log,
usage rows over a time range (paginated by seq), usage totals grouped by key / model /
worker / day / hour, and a key's spend since a time (budgets); and the reads of tests and tools
(open holds, the per-key audit of balances, a query's plan).

A mixin of PostgresLedger (proxy/ledger/postgres/ledger.py), which supplies `_db`. The same answers
as proxy/ledger/sqlite/console.py, by the same rule (proxy/ledger/rollup.py): totals read the
hourly sums (usage_hourly, proxy/ledger/postgres/schema.py migrations 3 and 4) for the whole UTC hours
of the range and the usage rows for its ragged ends (and for a status filter), over the
indexes usage_by_time(created_at) and usage_by_key_time(key_id, created_at) INCLUDE
(debited_micros), all in one REPEATABLE READ snapshot. What a filter selects is rollup.py's too,
an audit row's encoding proxy/ledger/key_rules.py's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from proxy.ledger.base import USAGE_ROW_COLUMNS, AuditEntry, Hold, UsageRecord, UsageTotals, page_limit
from proxy.ledger.key_rules import AUDIT_COLUMNS, AUDIT_INSERT_COLUMNS, audit_entry, audit_values
from proxy.ledger.rollup import Filters, merge_totals, totals_dialect, totals_queries, usage_filters, where_sql


def _where(filters: Filters, statuses: tuple[str, ...] | None = None) -> tuple[str, list[Any]]:
    # Numbered placeholders; the statuses as one text[] parameter.
    return where_sql(filters, statuses, mark=lambda n: f"${n}",
                     status_in=lambda given, n: (f"status = ANY(${n}::text[])", [list(given)]))


_TOTALS = totals_dialect(day="(floor(created_at / 86400) * 86400)::bigint",
                         hour="(floor(created_at / 3600) * 3600)::bigint",
                         rollup_day="hour / 86400 * 86400", cast="::bigint", where=_where)


class PgConsoleOps:
    """The console's ledger operations over the pool; mixed into PostgresLedger."""

    # PostgresLedger's, which mixes this in (declared for the type checker: no value here)
    _db: Callable[..., Awaitable[Any]]
    if TYPE_CHECKING:  # PgSpoolOps' (the ledger's); declared for the type checker only, never defined here
        async def settled(self, timeout: float = ...) -> None: ...

    async def append_audit(self, actor: str, action: str, key_id: str | None, details: dict[str, Any]) -> AuditEntry:
        async def op(conn: Any) -> AuditEntry:
            values = audit_values(time.time(), actor, action, key_id, details)
            seq = await conn.fetchval(
                f"INSERT INTO audit ({AUDIT_INSERT_COLUMNS}) VALUES ($1, $2, $3, $4, $5) RETURNING seq", *values)
            return audit_entry((seq, *values))

        return await self._db(op, transaction=False)

    async def list_audit(self, *, key_id: str | None = None, since: float | None = None,
                         until: float | None = None, before_seq: int | None = None,
                         limit: int = 100) -> list[AuditEntry]:
        where, params = _where(usage_filters(since, until, key_id, None, before_seq))

        async def op(conn: Any) -> list[AuditEntry]:
            rows = await conn.fetch(f"SELECT {AUDIT_COLUMNS} FROM audit{where}"
                                    f" ORDER BY seq DESC LIMIT ${len(params) + 1}", *params, page_limit(limit))
            return [audit_entry(r) for r in rows]

        return await self._db(op, transaction=False)

    async def usage_rows(self, *, since: float | None = None, until: float | None = None,
                         key_id: str | None = None, model: str | None = None,
                         before_seq: int | None = None, limit: int = 100,
                         statuses: tuple[str, ...] | None = None,
                         endpoint: str | None = None) -> list[tuple[int, UsageRecord]]:
        where, params = _where(usage_filters(since, until, key_id, model, before_seq, endpoint), statuses)

        async def op(conn: Any) -> list[tuple[int, UsageRecord]]:
            rows = await conn.fetch(f"SELECT {USAGE_ROW_COLUMNS} FROM usage{where} ORDER BY seq DESC"
                                    f" LIMIT ${len(params) + 1}", *params, page_limit(limit))
            return [(r[0], UsageRecord(*tuple(r)[1:])) for r in rows]

        return await self._db(op, transaction=False)

    async def usage_totals(self, group_by: tuple[str, ...], *, since: float | None = None,
                           until: float | None = None, key_id: str | None = None,
                           model: str | None = None, statuses: tuple[str, ...] | None = None) -> list[UsageTotals]:
        queries = totals_queries(_TOTALS, group_by, since, until, key_id, model, statuses)

        async def op(conn: Any) -> list[UsageTotals]:
            if len(queries) == 1:  # one statement is one snapshot already
                sql, params = queries[0]
                return merge_totals(group_by, [await conn.fetch(sql, *params)])
            async with conn.transaction(isolation="repeatable_read", readonly=True):  # one snapshot for the parts
                parts = [await conn.fetch(sql, *params) for sql, params in queries]
            return merge_totals(group_by, parts)

        return await self._db(op, transaction=False)

    async def spend_since(self, key_id: str, since: float) -> int:
        return await self._db(lambda conn: conn.fetchval(
            "SELECT COALESCE(SUM(debited_micros), 0)::bigint FROM usage WHERE key_id = $1 AND created_at >= $2",
            key_id, float(since)), transaction=False)

    # ------------------------------------------------------------------ tests and tools

    async def holds(self, key_id: str | None = None) -> list[Hold]:
        """Open holds (expired ones included until expire_holds drops them)."""
        # (not a released request's zero tombstone: it holds nothing, and only stands in the way
        # of a late hold of that request)
        sql = ("SELECT request_id, key_id, amount_micros, expires_at FROM holds"
               " WHERE (amount_micros > 0 OR request_id LIKE 'lease:%')")

        async def op(conn: Any) -> list[Hold]:
            found = await (conn.fetch(sql + " AND key_id = $1", key_id) if key_id else conn.fetch(sql))
            return [Hold(*r) for r in found]

        return await self._db(op, transaction=False)

    async def audit(self) -> list[tuple[str, int, int]]:
        """Per key: (key_id, balance, sum(topups) - sum(debited)); the two must be equal."""
        await self.settled()

        async def op(conn: Any) -> list[tuple[str, int, int]]:
            found = await conn.fetch(
                "SELECT k.key_id, k.balance_micros,"
                " (SELECT COALESCE(SUM(micros), 0) FROM topups t WHERE t.key_id = k.key_id)::bigint"
                " - (SELECT COALESCE(SUM(debited_micros), 0) FROM usage u WHERE u.key_id = k.key_id)::bigint"
                " FROM keys k WHERE k.own_balance ORDER BY k.key_id")
            return [tuple(r) for r in found]

        return await self._db(op, transaction=False)

    async def explain(self, sql: str, params: tuple = ()) -> list[str]:
        """PostgreSQL's query plan of `sql` ($n placeholders)."""
        async def op(conn: Any) -> list[str]:
            return [r[0] for r in await conn.fetch("EXPLAIN " + sql, *params)]

        return await self._db(op, transaction=False)
