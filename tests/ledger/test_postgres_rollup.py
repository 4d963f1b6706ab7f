"""The PostgreSQL ledger's hourly sums (usage_hourly, proxy/ledger/postgres/schema.py migration 3)
on a real server: a ledger made before them is upgraded on start (the sums filled from its
rows), every way a usage row is recorded adds to them exactly once (settle, lease_commit's
batch, a duplicate, the clamped path, the spool's replay, a plain INSERT), and the sums
always equal the rows. The totals' answers themselves run on both backends in
tests/ledger/test_console.py."""

from __future__ import annotations

import asyncpg
import pytest

from proxy.ledger import UsageRecord, open_ledger
from proxy.ledger.postgres.schema import MIGRATIONS, latest_version, migrate
from proxy.ledger.spool import settle_record

BASE = 1_764_547_200.0  # 2025-12-01T00:00:00Z
# usage_hourly as it must be: the rows grouped by the rule of proxy/ledger/rollup.py.
_FROM_ROWS = ("SELECT (floor(created_at / 3600) * 3600)::bigint, key_id, COALESCE(served_model, model),"
              " COALESCE(worker, ''), COUNT(*),"
              " SUM(input_tokens)::bigint, SUM(cached_tokens)::bigint, SUM(output_tokens)::bigint,"
              " SUM(reasoning_tokens)::bigint, SUM(cost_micros)::bigint, SUM(debited_micros)::bigint"
              " FROM usage GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4")
_SUMS = "SELECT * FROM usage_hourly ORDER BY 1, 2, 3, 4"


def pg_section(dsn: str, tmp_path) -> dict:
    return {"backend": "postgres", "dsn": dsn, "spool_path": str(tmp_path / "spool.jsonl"), "connect_timeout_s": 1}


def usage(request_id: str, key_id: str, at: float, cost: int = 100, *, model: str = "m1",
          worker: str | None = "w1") -> UsageRecord:
    return UsageRecord(request_id=request_id, key_id=key_id, model=model, input_tokens=10, cached_tokens=4,
                       output_tokens=5, reasoning_tokens=1, cost_micros=cost, status="completed", created_at=at,
                       worker=worker)


async def sums_and_rows(dsn: str) -> tuple[list, list]:
    conn = await asyncpg.connect(dsn)
    try:
        return [tuple(r) for r in await conn.fetch(_SUMS)], [tuple(r) for r in await conn.fetch(_FROM_ROWS)]
    finally:
        await conn.close()


@pytest.mark.parametrize("version", [1, 2])
async def test_a_ledger_from_before_the_sums_is_upgraded_on_start(pg_dsn, tmp_path, version):
    old = tuple(m for m in MIGRATIONS if m[0] <= version)
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await migrate(conn, old) == list(range(1, version + 1))
        await conn.execute("INSERT INTO keys (key_id, name, prefix, secret_sha256, balance_micros, created_at)"
                           " VALUES ('key_a', 'a', 'sk-rp-', '\\x01', 1000000, 0), ('key_b', 'b', 'sk-rp-', '\\x02',"
                           " 1000000, 0)")
        await conn.executemany(
            "INSERT INTO usage (request_id, key_id, model, input_tokens, cached_tokens, output_tokens,"
            " reasoning_tokens, cost_micros, debited_micros, status, created_at, worker)"
            " VALUES ($1, $2, $3, 10, 4, 5, 1, $4, $4, 'completed', $5, $6)",
            [(f"old-{n}", "key_" + "ab"[n % 2], f"m{n % 3}", 10 + n, BASE + n * 977.5,
              None if n % 4 == 0 else f"w{n % 2}") for n in range(60)])
    finally:
        await conn.close()
    async with open_ledger(pg_section(pg_dsn, tmp_path)) as ledger:
        versions = await ledger._db(lambda c: c.fetch("SELECT version FROM schema_migrations ORDER BY 1"),
                                    transaction=False)
        assert [r[0] for r in versions] == list(range(1, latest_version() + 1)) and latest_version() >= 3
        (total,) = await ledger.usage_totals((), since=BASE, until=BASE + 86400)  # whole hours: the sums
        assert (total.requests, total.cost_micros) == (60, sum(10 + n for n in range(60)))
        by_worker = {t.group["worker"]: t.requests for t in await ledger.usage_totals(("worker",), since=BASE)}
        assert by_worker == {None: 15, "w0": 15, "w1": 30}
        assert await ledger.settle("new-0", usage("new-0", "key_a", BASE + 3600 * 5 + 1))  # and kept from now on
        sums, rows = await sums_and_rows(pg_dsn)
        assert sums == rows and sum(s[4] for s in sums) == 61


async def test_every_way_a_row_is_recorded_adds_it_once(pg_dsn, tmp_path):
    async with open_ledger(pg_section(pg_dsn, tmp_path)) as ledger:
        _, a = await ledger.create_key("a", 10**9)
        _, poor = await ledger.create_key("poor", 250)
        assert await ledger.settle("s1", usage("s1", a.key_id, BASE + 10))
        assert not await ledger.settle("s1", usage("s1", a.key_id, BASE + 10))  # a duplicate: not summed
        batch = [("lease:a", usage(f"b{n}", a.key_id, BASE + n * 1000, model=f"m{n % 2}",
                                   worker=None if n % 3 else "w2")) for n in range(12)]
        batch.append(batch[0])  # twice in one batch: inserted (and summed) once
        results, _ = await ledger.lease_commit(batch, [])
        assert results[:12] == [100] * 12 and results[12] is None
        again, _ = await ledger.lease_commit(batch[:3], [])  # a retried commit: nothing new
        assert again == [None, None, None]
        # The balance runs out: the clamped path, one insert per row; the debit summed, not the cost.
        clamped, _ = await ledger.lease_commit([("lease:p", usage(f"p{n}", poor.key_id, BASE + 7200))
                                                for n in range(3)], [])
        assert clamped == [100, 100, 50]
        # The spool's replay (settle and lease rows), including a record recorded already.
        await ledger._spool([settle_record("sp1", usage("sp1", a.key_id, BASE + 90_000)),
                             settle_record("sp2", usage("sp2", a.key_id, BASE + 90_001), lease_id="lease:a"),
                             settle_record("s1", usage("s1", a.key_id, BASE + 10))])
        assert await ledger.replay_spool() == 3
        conn = await asyncpg.connect(pg_dsn)
        try:  # an INSERT from outside the proxy (an older replica during an upgrade, an operator)
            await conn.execute(
                "INSERT INTO usage (request_id, key_id, model, input_tokens, cached_tokens, output_tokens,"
                " reasoning_tokens, cost_micros, debited_micros, status, created_at, worker)"
                " VALUES ('x1', $1, 'm1', 1, 0, 1, 0, 7, 7, 'completed', $2, NULL)", a.key_id, BASE + 20)
        finally:
            await conn.close()
        sums, rows = await sums_and_rows(pg_dsn)
        assert sums == rows
        assert sum(s[4] for s in sums) == 1 + 12 + 3 + 2 + 1
        poor_sums = [s for s in sums if s[1] == poor.key_id]
        assert [(s[9], s[10]) for s in poor_sums] == [(300, 250)]  # cost and debit summed apart
        (total,) = await ledger.usage_totals((), since=BASE, until=BASE + 2 * 86400)
        assert total.requests == 19 and total.debited_micros == sum(s[10] for s in sums)


async def test_a_ledger_from_before_served_model_is_migrated(pg_dsn, tmp_path):
    """A database at migration 3 (usage without served_model, sums keyed by the client's
    strings) gets the column on start (migration 4); its sums stay, new rows are summed under
    their served model whichever way they come (settle, lease batch, the spool's replay), a
    row inserted without one (a replica of the previous release) under its model."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await migrate(conn, tuple(m for m in MIGRATIONS if m[0] <= 3)) == [1, 2, 3]
        await conn.execute("INSERT INTO keys (key_id, name, prefix, secret_sha256, balance_micros, created_at)"
                           " VALUES ('key_a', 'a', 'sk-rp-', '\\x01', 1000000, 0)")
        await conn.executemany(
            "INSERT INTO usage (request_id, key_id, model, input_tokens, cached_tokens, output_tokens,"
            " reasoning_tokens, cost_micros, debited_micros, status, created_at, worker)"
            " VALUES ($1, 'key_a', $2, 10, 4, 5, 1, 10, 10, 'completed', $3, 'w1')",
            [(f"old-{n}", f"p{n}/m1", BASE + n) for n in range(5)])
    finally:
        await conn.close()
    async with open_ledger(pg_section(pg_dsn, tmp_path)) as ledger:
        assert latest_version() >= 4
        versions = await ledger._db(lambda c: c.fetch("SELECT version FROM schema_migrations ORDER BY 1"),
                                    transaction=False)
        assert [r[0] for r in versions] == list(range(1, latest_version() + 1))
        assert (await ledger.usage("old-0")).served_model is None
        fresh = [usage(f"new-{n}", "key_a", BASE + 10 + n, model=f"q{n}/m1") for n in range(6)]
        for u in fresh:
            u.served_model = "m1"
        assert await ledger.settle("new-0", fresh[0])
        results, _ = await ledger.lease_commit([("lease:a", u) for u in fresh[1:4]], [])
        assert results == [100, 100, 100]
        await ledger._spool([settle_record("new-4", fresh[4]), settle_record("new-5", fresh[5], lease_id="lease:a")])
        assert await ledger.replay_spool() == 2
        assert (await ledger.usage("new-5")).served_model == "m1"
        conn = await asyncpg.connect(pg_dsn)
        try:  # the previous release's INSERT, during a rolling upgrade: no served_model
            await conn.execute(
                "INSERT INTO usage (request_id, key_id, model, input_tokens, cached_tokens, output_tokens,"
                " reasoning_tokens, cost_micros, debited_micros, status, created_at, worker)"
                " VALUES ('x1', 'key_a', 'p9/m1', 1, 0, 1, 0, 7, 7, 'completed', $1, 'w1')", BASE + 20)
        finally:
            await conn.close()
        by_model = {t.group["model"]: t.requests
                    for t in await ledger.usage_totals(("model",), since=BASE, until=BASE + 3600)}  # the sums
        assert by_model == {"m1": 6, "p9/m1": 1, **{f"p{n}/m1": 1 for n in range(5)}}
        sums, rows = await sums_and_rows(pg_dsn)
        assert sums == rows and sum(s[4] for s in sums) == 12
