"""The hourly sums' rules, shared by both ledger backends (one home for each):

  * which usage rows a sum adds up: per UTC hour (its start, Unix seconds, floor), key,
    model and worker ('' for a row without one). The model is the served model (what
    resolve_model chose: one of the names the workers serve), or the client's string for a
    row recorded before it was kept (served_model NULL): SQL's COALESCE(served_model, model),
    UsageRecord.grouped_model. Never the client's string when a served model is known, so
    4,000 aliases of one model are one group, not 4,000; `hourly_sums` groups a batch of rows
    just inserted into one sum per group (the upsert SQLite's roll_up runs; PostgreSQL's
    is the same grouping in SQL, proxy/ledger/pg_schema.py);
  * how a time range is answered: `split_totals` splits [since, until) into the whole UTC
    hours between (read from the sums) and the ragged ends (read from the rows); a status
    filter reads the rows only (the sums keep no status);
  * how the parts' answers combine into the totals (`merge_totals`).

Pure: no SQL dialect, no I/O. proxy/ledger/sqlite_console.py and pg_console.py hold the SQL.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from proxy.ledger.base import USAGE_GROUPS, UsageTotals

HOUR = 3600
# Positions in a usage row as both backends insert it (schema.py _INSERT_USAGE, pg_usage.py
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


def split_totals(since: float | None, until: float | None,
                 statuses: tuple[str, ...] | None) -> tuple[list[Rows], Hours | None]:
    """split_hours, except that a status filter reads every row of the range (no sums)."""
    return ([(since, until)], None) if statuses else split_hours(since, until)


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
