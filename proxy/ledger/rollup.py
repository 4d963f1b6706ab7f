"""The hourly sums' rules, shared by both ledger backends (one home for each):

  * which usage rows a sum adds up: per UTC hour (its start, Unix seconds, floor), key,
    model and worker ('' for a row without one). The model is the served model (what
    resolve_model chose: one of the names the workers serve), or the client's string for a
    row recorded before it was kept (served_model NULL): SQL's COALESCE(served_model, model),
    UsageRecord.grouped_model. Never the client's string when a served model is known, so
    4,000 aliases of one model are one group, not 4,000; `hourly_sums` groups a batch of rows
    just inserted into one sum per group (the upsert SQLite's roll_up runs; PostgreSQL's
    is the same grouping in SQL, proxy/ledger/postgres/schema.py);
  * how a time range is answered: `split_totals` splits [since, until) into the whole UTC
    hours between (read from the sums) and the ragged ends (read from the rows); a status
    filter reads the rows only (the sums keep no status);
  * how the parts' answers combine into the totals (`merge_totals`);
  * what the console's filters select (`usage_filters` over the usage rows, `hourly_filters`
    over the sums) and the group columns the two backends spell alike.

Pure: no I/O, and only the SQL both dialects spell alike. proxy/ledger/sqlite/console.py and
postgres/console.py hold the rest of the SQL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from proxy.ledger.base import USAGE_GROUPS, UsageTotals
from proxy.ledger.levels import KEY_COLUMN, kind_of

HOUR = 3600
# Positions in a usage row as both backends insert it (sqlite/usage.py _INSERT_USAGE, postgres/usage.py
# USAGE_COLUMNS): request_id, key_id, model, input, cached, output, reasoning, cost, debited,
# status, created_at, worker, served_model, endpoint.
_KEY, _MODEL, _INPUT, _CREATED, _WORKER, _SERVED = 1, 2, 3, 10, 11, 12


def hour_of(created_at: float) -> int:
    return int(created_at // HOUR) * HOUR


def hourly_sums(inserted: Iterable[tuple[Sequence, int]]) -> list[tuple]:
    """(hour, key_id, model, worker, requests, input, cached, output, reasoning, cost, debited)
    per group of `inserted`: usage rows just inserted, each with its debit."""
    groups: dict[tuple, list[int]] = {}
    for row, debit in inserted:
        worker, served = row[_WORKER], row[_SERVED]
        group = (hour_of(row[_CREATED]), row[_KEY], row[_MODEL] if served is None else served,
                 "" if worker is None else worker)
        sums = groups.get(group)
        if sums is None:
            sums = groups[group] = [0, 0, 0, 0, 0, 0, 0]
        sums[0] += 1
        sums[1] += row[_INPUT]
        sums[2] += row[_INPUT + 1]
        sums[3] += row[_INPUT + 2]
        sums[4] += row[_INPUT + 3]
        sums[5] += row[_INPUT + 4]
        sums[6] += debit
    return [(*group, *sums) for group, sums in groups.items()]


# A row's model in totals and the model filter: the served model, else (rows from before it
# was kept) the client's string (UsageRecord.grouped_model; usage_hourly.model holds the same).
SERVED_MODEL_SQL = "COALESCE(served_model, model)"
# The groups over the usage rows and over usage_hourly that both backends write the same;
# each adds "day" and "hour" (the UTC bucket's start, Unix seconds) in its own SQL.

# The summed columns of a usage total, in the order both dialects' SELECT lists read them.
SUMMED = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens", "cost_micros", "debited_micros")


def sums_sql(count: str, cast: str = "") -> str:
    """A total's SELECT list: `count` (the requests), then each summed column as the dialect
    spells an integer sum of none as 0 (`cast`: PostgreSQL's "::bigint", whose SUM is numeric)."""
    return ", ".join([count, *(f"COALESCE(SUM({column}), 0){cast}" for column in SUMMED)])


# A row from before the endpoint was kept was a Responses request (UsageRecord.endpoint).
ENDPOINT_SQL = "COALESCE(endpoint, '/v1/responses')"
# A key's levels (proxy/ledger/levels.py) are on its row and never change: a row's team is its
# key's. Grouped by one, the rows are read joined to their keys (_totals_sql).
LEVEL_GROUP_SQL = dict(KEY_COLUMN)
GROUP_SQL = {"key": "key_id", "model": SERVED_MODEL_SQL, "worker": "worker", **LEVEL_GROUP_SQL,
             "endpoint": ENDPOINT_SQL}
# The hourly sums keep no endpoint: grouped by it, totals read the rows (ROWS_ONLY).
ROLLUP_GROUP_SQL = {"key": "key_id", "model": "model", "worker": "NULLIF(worker, '')", "hour": "hour",
                    **LEVEL_GROUP_SQL, "endpoint": "NULL"}
ROWS_ONLY = frozenset({"endpoint"})


def _whose(key_id: str | None) -> tuple[str, str | None]:
    """The filter of one key, or of every key under a level when `key_id` names one ("team_...",
    "user_...", "org_...": UsageQuery's team_id / user_id / org_id)."""
    kind = kind_of(key_id) if key_id is not None else None
    if kind is None:
        return "key_id =", key_id
    return f"key_id IN (SELECT key_id FROM keys WHERE {KEY_COLUMN[kind]} = %s)", key_id

Filters = list[tuple[str, Any]]  # (an SQL expression and its comparison, the value): the backend adds its placeholder




def usage_filters(since: float | None, until: float | None, key_id: str | None, model: str | None,
                  before_seq: int | None = None, endpoint: str | None = None) -> Filters:
    """The usage rows' filters given (None: not filtered): created_at in [since, until), one
    key, one model (the served one), one endpoint (the API path), seq < before_seq (a page's cursor)."""
    given = (_whose(key_id), ("created_at >=", None if since is None else float(since)),
             ("created_at <", None if until is None else float(until)), (f"{SERVED_MODEL_SQL} =", model),
             (f"{ENDPOINT_SQL} =", endpoint), ("seq <", None if before_seq is None else int(before_seq)))
    return [(clause, value) for clause, value in given if value is not None]


def hourly_filters(hours: Hours, key_id: str | None, model: str | None) -> Filters:
    """The hourly sums' filters given: one key, one model, the hours [first, end)."""
    given = (_whose(key_id), ("model =", model), ("hour >=", hours[0]), ("hour <", hours[1]))
    return [(clause, value) for clause, value in given if value is not None]


def check_group_by(group_by: tuple[str, ...]) -> None:
    unknown = [g for g in group_by if g not in USAGE_GROUPS]
    if unknown or len(set(group_by)) != len(group_by):
        raise ValueError(f"group_by must be distinct names of {', '.join(USAGE_GROUPS)}, not {list(group_by)}")


Rows = tuple[float | None, float | None]  # [lo, hi) of the usage rows' created_at; None: open
Hours = tuple[int | None, int | None]  # [first hour, end) of the hourly sums; None: open


def split_hours(since: float | None, until: float | None) -> tuple[list[Rows], Hours | None]:
    """[since, until) as (the ragged ends, each a (lo, hi) range of rows; the whole UTC hours
    between them as (first hour, end) for the hourly sums, None when there is none). A None
    bound is open: all the sums on that side."""
    lo = None if since is None else -(-math.ceil(since) // HOUR) * HOUR
    hi = None if until is None else math.floor(until) // HOUR * HOUR
    if lo is not None and hi is not None and lo >= hi:
        return [(since, until)], None
    raw: list[Rows] = []
    if since is not None and lo is not None and lo > since:  # lo is None only when since is
        raw.append((since, float(lo)))
    if until is not None and hi is not None and hi < until:
        raw.append((float(hi), until))
    return raw, (lo, hi)


def split_totals(since: float | None, until: float | None, rows_only: object) -> tuple[list[Rows], Hours | None]:
    """split_hours, except that a status filter, or a group the sums do not keep (endpoint),
    reads every row of the range (no sums): `rows_only` is truthy then."""
    return ([(since, until)], None) if rows_only else split_hours(since, until)


# A backend's WHERE builder: (filters, statuses or None) -> (" WHERE ..." or "", its parameters),
# with the dialect's placeholders.
Where = Callable[[Filters, "tuple[str, ...] | None"], tuple[str, list[Any]]]


def where_sql(filters: Filters, statuses: tuple[str, ...] | None, *, mark: Callable[[int], str],
              status_in: Callable[[tuple[str, ...], int], tuple[str, list[Any]]]) -> tuple[str, list[Any]]:
    """The WHERE clause of `filters` and of a status filter, and its parameters, as a dialect
    spells them: `mark(n)` the n-th parameter's placeholder, `status_in(statuses, n)` the status
    clause whose parameters start at the n-th and those parameters."""
    clauses = [clause.replace("%s", mark(i + 1)) if "%s" in clause else f"{clause} {mark(i + 1)}"
               for i, (clause, _) in enumerate(filters)]
    params: list[Any] = [value for _, value in filters]
    if statuses:
        clause, values = status_in(statuses, len(params) + 1)
        clauses.append(clause)
        params.extend(values)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


class TotalsDialect(NamedTuple):
    """The totals queries as one backend spells them; the queries themselves are made once
    (`totals_queries`)."""

    group_sql: dict[str, str]  # each group's expression over the usage rows
    rollup_group_sql: dict[str, str]  # the same over usage_hourly
    sums: str  # the SELECT list of a total over the rows
    rollup_sums: str  # the same over usage_hourly (its requests summed, not counted)
    where: Where


def totals_dialect(*, day: str, hour: str, rollup_day: str, cast: str, where: Where) -> TotalsDialect:
    """A backend's TotalsDialect from what differs between the dialects: the UTC day and hour
    (bucket start, Unix seconds) of a row's created_at, the day of an hourly sum's hour, the
    integer cast of a sum (PostgreSQL's SUM of BIGINT is numeric: "::bigint"; SQLite's: ""),
    and the WHERE builder (its placeholders)."""
    group_sql = {**GROUP_SQL, "day": day, "hour": hour}
    assert set(group_sql) == set(USAGE_GROUPS)
    return TotalsDialect(group_sql, {**ROLLUP_GROUP_SQL, "day": rollup_day}, sums_sql("COUNT(*)", cast),
                         sums_sql(f"COALESCE(SUM(requests), 0){cast}", cast), where)


def _totals_sql(group_by: tuple[str, ...], columns: dict[str, str], sums: str, table: str,
                where: str) -> str:
    exprs = [columns[g] for g in group_by]
    grouping = f" GROUP BY {', '.join(str(i + 1) for i in range(len(exprs)))}" if exprs else ""
    source = table
    if any(g in LEVEL_GROUP_SQL for g in group_by):  # the same rows, each with its key's levels
        source = (f"(SELECT t.*, k.org_id, k.team_id, k.user_id FROM {table} t"
                  f" LEFT JOIN keys k ON k.key_id = t.key_id) AS {table}")
    return f"SELECT {', '.join([*exprs, sums])} FROM {source}{where}{grouping}"


def totals_queries(dialect: TotalsDialect, group_by: tuple[str, ...], since: float | None, until: float | None,
                   key_id: str | None, model: str | None,
                   statuses: tuple[str, ...] | None) -> list[tuple[str, list[Any]]]:
    """The (sql, params) whose rows merge_totals adds up into the usage totals asked for. Whole
    hours come from the hourly sums; the ragged ends of the range, and any status filter (the
    sums do not keep statuses), from the rows."""
    check_group_by(group_by)
    raw, whole = split_totals(since, until, statuses or ROWS_ONLY.intersection(group_by))
    queries = []
    for lo, hi in raw:
        where, params = dialect.where(usage_filters(lo, hi, key_id, model), statuses)
        queries.append((_totals_sql(group_by, dialect.group_sql, dialect.sums, "usage", where), params))
    if whole is not None:
        where, params = dialect.where(hourly_filters(whole, key_id, model), None)
        queries.append((_totals_sql(group_by, dialect.rollup_group_sql, dialect.rollup_sums, "usage_hourly", where),
                        params))
    return queries


def merge_totals(group_by: tuple[str, ...], parts: Iterable[Iterable[Sequence]]) -> list[UsageTotals]:
    """The totals from each part's rows (group values, then the 7 sums), added up by group,
    in group order (None first); one zero total when nothing matched and nothing is grouped."""
    n = len(group_by)
    sums: dict[tuple, list[int]] = {}
    for rows in parts:
        for raw in rows:
            row = tuple(raw)
            found = sums.get(row[:n])
            if found is None:
                sums[row[:n]] = [int(v) for v in row[n:]]
            else:
                for i, value in enumerate(row[n:]):
                    found[i] += value
    if not group_by and not sums:
        sums[()] = [0] * 7
    order = sorted(sums, key=lambda g: tuple((v is not None, v if v is not None else 0) for v in g))
    return [UsageTotals(dict(zip(group_by, group)), *sums[group]) for group in order]
