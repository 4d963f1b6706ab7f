"""The PostgreSQL ledger's reads and writes for the operator's console: the audit log,
usage rows over a time range (paginated by seq), usage totals grouped by key / model /
worker / day / hour, and a key's spend since a time (budgets).

A mixin of PostgresLedger (proxy/ledger/postgres.py), which supplies `_db`. The same answers
as proxy/ledger/sqlite_console.py, by the same rule (proxy/ledger/rollup.py): totals read the
hourly sums (usage_hourly, proxy/ledger/pg_schema.py migrations 3 and 4) for the whole UTC hours
of the range and the usage rows for its ragged ends (and for a status filter), over the
indexes usage_by_time(created_at) and usage_by_key_time(key_id, created_at) INCLUDE
(debited_micros), all in one REPEATABLE READ snapshot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from proxy.ledger.base import USAGE_GROUPS, USAGE_ROW_COLUMNS, AuditEntry, UsageRecord, UsageTotals, page_limit
from proxy.ledger.rollup import check_group_by, merge_totals, split_totals

# A row's model in totals and the model filter: the served model, else (rows from before it
# was kept) the client's string (UsageRecord.grouped_model; usage_hourly.model holds the same).
SERVED_MODEL_SQL = "COALESCE(served_model, model)"
_GROUP_SQL = {
    "key": "key_id",
    "model": SERVED_MODEL_SQL,
    "worker": "worker",
    "day": "(floor(created_at / 86400) * 86400)::bigint",
    "hour": "(floor(created_at / 3600) * 3600)::bigint",
}
assert set(_GROUP_SQL) == set(USAGE_GROUPS)
# The same groups over usage_hourly.
_ROLLUP_GROUP_SQL = {
    "key": "key_id",
    "model": "model",
    "worker": "NULLIF(worker, '')",
    "day": "hour / 86400 * 86400",
    "hour": "hour",
}
_ROLLUP_SUMS = (
    "COALESCE(SUM(requests), 0)::bigint, COALESCE(SUM(input_tokens), 0)::bigint,"
    " COALESCE(SUM(cached_tokens), 0)::bigint, COALESCE(SUM(output_tokens), 0)::bigint,"
    " COALESCE(SUM(reasoning_tokens), 0)::bigint, COALESCE(SUM(cost_micros), 0)::bigint,"
    " COALESCE(SUM(debited_micros), 0)::bigint"
)
_SUMS = (
    "COUNT(*), COALESCE(SUM(input_tokens), 0)::bigint, COALESCE(SUM(cached_tokens), 0)::bigint,"
    " COALESCE(SUM(output_tokens), 0)::bigint, COALESCE(SUM(reasoning_tokens), 0)::bigint,"
    " COALESCE(SUM(cost_micros), 0)::bigint, COALESCE(SUM(debited_micros), 0)::bigint"
)


def _where(since: float | None, until: float | None, key_id: str | None, model: str | None,
           before_seq: int | None = None, statuses: tuple[str, ...] | None = None) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    params: list[Any] = []
    for clause, value in (("key_id = ", key_id), ("created_at >= ", None if since is None else float(since)),
                          ("created_at < ", None if until is None else float(until)),
                          (f"{SERVED_MODEL_SQL} = ", model),
                          ("seq < ", None if before_seq is None else int(before_seq))):
        if value is not None:
            params.append(value)
            clauses.append(f"{clause}${len(params)}")
    if statuses:
        params.append(list(statuses))
        clauses.append(f"status = ANY(${len(params)}::text[])")
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


def _hourly_where(first: int | None, end: int | None, key_id: str | None, model: str | None
                  ) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    params: list[Any] = []
    for clause, value in (("key_id = ", key_id), ("model = ", model), ("hour >= ", first), ("hour < ", end)):
        if value is not None:
            params.append(value)
            clauses.append(f"{clause}${len(params)}")
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


def _totals_sql(group_by: tuple[str, ...], columns: dict[str, str], sums: str, table: str, where: str,
                params: list) -> tuple[str, list]:
    exprs = [columns[g] for g in group_by]
    grouping = f" GROUP BY {', '.join(str(i + 1) for i in range(len(exprs)))}" if exprs else ""
    return f"SELECT {', '.join([*exprs, sums])} FROM {table}{where}{grouping}", params


class PgConsoleOps:
    """The console's ledger operations over the pool; mixed into PostgresLedger."""

    # PostgresLedger's, which mixes this in (declared for the type checker: no value here)
    _db: Callable[..., Awaitable[Any]]

    async def append_audit(self, actor: str, action: str, key_id: str | None, details: dict[str, Any]) -> AuditEntry:
        text = json.dumps(details, sort_keys=True, default=str)

        async def op(conn: Any) -> AuditEntry:
            now = time.time()
            seq = await conn.fetchval(
                "INSERT INTO audit (created_at, actor, action, key_id, details) VALUES ($1, $2, $3, $4, $5)"
                " RETURNING seq", now, str(actor), str(action), key_id, text)
            return AuditEntry(seq, now, str(actor), str(action), key_id, json.loads(text))

        return await self._db(op, transaction=False)

    async def list_audit(self, *, key_id: str | None = None, since: float | None = None,
                         until: float | None = None, before_seq: int | None = None,
                         limit: int = 100) -> list[AuditEntry]:
        where, params = _where(since, until, key_id, None, before_seq)

        async def op(conn: Any) -> list[AuditEntry]:
            rows = await conn.fetch(f"SELECT seq, created_at, actor, action, key_id, details FROM audit{where}"
                                    f" ORDER BY seq DESC LIMIT ${len(params) + 1}", *params, page_limit(limit))
            return [AuditEntry(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

        return await self._db(op, transaction=False)

    async def usage_rows(self, *, since: float | None = None, until: float | None = None,
                         key_id: str | None = None, model: str | None = None,
                         before_seq: int | None = None, limit: int = 100,
                         statuses: tuple[str, ...] | None = None) -> list[tuple[int, UsageRecord]]:
        where, params = _where(since, until, key_id, model, before_seq, statuses)

        async def op(conn: Any) -> list[tuple[int, UsageRecord]]:
            rows = await conn.fetch(f"SELECT {USAGE_ROW_COLUMNS} FROM usage{where} ORDER BY seq DESC"
                                    f" LIMIT ${len(params) + 1}", *params, page_limit(limit))
            return [(r[0], UsageRecord(*tuple(r)[1:])) for r in rows]

        return await self._db(op, transaction=False)

    async def usage_totals(self, group_by: tuple[str, ...], *, since: float | None = None,
                           until: float | None = None, key_id: str | None = None,
                           model: str | None = None, statuses: tuple[str, ...] | None = None) -> list[UsageTotals]:
        check_group_by(group_by)
        raw, whole = split_totals(since, until, statuses)
        queries = [_totals_sql(group_by, _GROUP_SQL, _SUMS, "usage",
                               *_where(lo, hi, key_id, model, statuses=statuses)) for lo, hi in raw]
        if whole is not None:
            queries.append(_totals_sql(group_by, _ROLLUP_GROUP_SQL, _ROLLUP_SUMS, "usage_hourly",
                                       *_hourly_where(*whole, key_id, model)))

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
