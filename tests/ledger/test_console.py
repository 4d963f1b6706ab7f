"""The console's ledger operations and the limits they feed (issue 18), on real SQLite files:
usage rows and totals over time ranges (and that their query plans use the indexes),
the audit log, rotation, expiry, the migration of a ledger made before these columns,
the keys CLI through the service layer, tokens-per-minute and budget limits through a
real proxy, and the bounded per-key Prometheus series."""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import sqlite3
import time
from typing import Any

import aiohttp
import pytest

from proxy.ledger import KeyLimits, LedgerError, UsageRecord, open_ledger
from proxy.ledger.cli import add_key_commands, run_key_command
from proxy.ledger.service import KeyService, period_starts
from proxy.ledger.sqlite.ledger import SQLiteLedger
from tests.conftest import LEDGER_BACKENDS, ledger_section

DAY = 86400


def _usage(request_id: str, key_id: str, at: float, *, model: str = "m1", worker: str = "w1", cost: int = 100,
           status: str = "completed") -> UsageRecord:
    return UsageRecord(request_id=request_id, key_id=key_id, model=model, input_tokens=10, cached_tokens=4,
                       output_tokens=5, reasoning_tokens=0, cost_micros=cost, status=status, created_at=at,
                       worker=worker)


@pytest.fixture(params=LEDGER_BACKENDS)
async def ledger(request, tmp_path):
    """Each backend (tests/conftest.py); SQLite-only tests narrow it with @sqlite_only."""
    if request.param == "sqlite":
        async with SQLiteLedger(tmp_path / "ledger.db") as found:
            yield found
    else:
        async with open_ledger(ledger_section(request.param, request, tmp_path)) as found:
            yield found


sqlite_only = pytest.mark.parametrize("ledger", ["sqlite"], indirect=True)  # SQLite's query plans


async def test_totals_group_by_time_buckets_and_dimensions(ledger):
    _, a = await ledger.create_key("a", 10_000_000)
    _, b = await ledger.create_key("b", 10_000_000)
    base = 1_764_547_200.0  # 2025-12-01T00:00:00Z
    rows = [("r1", a, base + 10, "m1", "w1"), ("r2", a, base + 3600 + 5, "m2", "w1"),
            ("r3", b, base + DAY + 1, "m1", "w2"), ("r4", b, base + DAY + 7200, "m1", "w2")]
    for rid, key, at, model, worker in rows:
        assert await ledger.settle(rid, _usage(rid, key.key_id, at, model=model, worker=worker))
    by_day = await ledger.usage_totals(("day",))
    assert [(t.group["day"], t.requests, t.cost_micros) for t in by_day] == [(base, 2, 200), (base + DAY, 2, 200)]
    by_hour_key = await ledger.usage_totals(("hour", "key"), since=base, until=base + DAY)
    assert [(t.group["hour"], t.group["key"]) for t in by_hour_key] == [(base, a.key_id), (base + 3600, a.key_id)]
    by_worker = {t.group["worker"]: t for t in await ledger.usage_totals(("worker", "model"))}
    assert by_worker["w2"].requests == 2 and by_worker["w2"].cached_tokens == 8
    (everything,) = await ledger.usage_totals(())
    assert everything.requests == 4 and everything.input_tokens == 40 and everything.debited_micros == 400
    assert await ledger.spend_since(b.key_id, base + DAY + 3600) == 100
    page = await ledger.usage_rows(key_id=b.key_id, limit=1)
    assert [r.request_id for _, r in page] == ["r4"] and page[0][1].worker == "w2"
    older = await ledger.usage_rows(key_id=b.key_id, before_seq=page[0][0])
    assert [r.request_id for _, r in older] == ["r3"]
    with pytest.raises(ValueError):
        await ledger.usage_totals(("colour",))


async def test_totals_from_the_hourly_sums_equal_the_rows(ledger):
    import random

    rng = random.Random(18)
    keys = [(await ledger.create_key(f"k{i}", 10**9))[1].key_id for i in range(3)]
    base = 1_764_547_200.0
    rows = []
    for n in range(200):
        at = base + rng.uniform(0, 3 * DAY)
        usage = _usage(f"r{n}", rng.choice(keys), at, model=rng.choice(["m1", "m2"]),
                       worker=rng.choice(["w1", None]), cost=rng.randint(1, 500),
                       status=rng.choice(["completed", "failed"]))
        if n % 2:  # both ways rows are recorded: one settle, or a lease's batch commit
            assert await ledger.settle(usage.request_id, usage)
        else:
            results, _ = await ledger.lease_commit([("lease:test", usage)], [])
            assert results == [usage.cost_micros]
        rows.append(usage)
    again, _ = await ledger.lease_commit([("lease:test", rows[0])], [])  # recorded already: not summed twice
    assert again == [None]
    bounds = [None, base, base + 3600, base + 5000.5, base + DAY, base + DAY + 59.25, base + 3 * DAY]
    for _ in range(40):
        since, until = rng.choice(bounds), rng.choice(bounds)
        if since is not None and until is not None and until <= since:
            continue
        group_by = tuple(rng.sample(["key", "model", "worker", rng.choice(["day", "hour"])], rng.randint(0, 3)))
        found = await ledger.usage_totals(group_by, since=since, until=until)
        expected: dict[tuple, list[int]] = {}
        for u in rows:
            if (since is not None and u.created_at < since) or (until is not None and u.created_at >= until):
                continue
            values = {"key": u.key_id, "model": u.model, "worker": u.worker,
                      "day": int(u.created_at // DAY * DAY), "hour": int(u.created_at // 3600 * 3600)}
            sums = expected.setdefault(tuple(values[g] for g in group_by), [0, 0, 0])
            sums[0] += 1
            sums[1] += u.cost_micros
            sums[2] += u.input_tokens
        if not group_by and not expected:
            expected[()] = [0, 0, 0]
        got = {tuple(t.group[g] for g in group_by): [t.requests, t.cost_micros, t.input_tokens] for t in found}
        assert got == expected, (group_by, since, until)
        failed = await ledger.usage_totals((), since=since, until=until, statuses=("failed",))
        assert failed[0].requests == sum(1 for u in rows if u.status == "failed"
                                         and (since is None or u.created_at >= since)
                                         and (until is None or u.created_at < until))


async def test_totals_equal_the_rows_for_random_ranges_filters_and_groupings(ledger):
    """Random bounds anywhere (fractions of a second, exactly on an hour, just before one),
    rows on and just off the hour boundaries, random key / model filters and groupings, rows
    with a served model under an alias and rows without one (recorded before it was kept): every
    field of every group equals the sums of the matching rows (proxy/ledger/rollup.py's split),
    the model being the served one (UsageRecord.grouped_model)."""
    import random

    rng = random.Random(1618)
    team = await ledger.create_level("team", {"name": "t"})
    keys = [(await ledger.create_key("k0", 10**9))[1].key_id,  # the second key sits under a team
            (await ledger.create_key("k1", 10**9, placement={"team_id": team.level_id}))[1].key_id]
    base = 1_764_547_200.0
    edges = [base + h * 3600 + d for h in range(0, 50, 7) for d in (0.0, -0.001, 0.001)]
    rows = []
    for n in range(160):
        at = edges[n] if n < len(edges) else base + rng.uniform(0, 2 * DAY)
        u = _usage(f"q{n}", rng.choice(keys), at, model=rng.choice(["m1", "m2", "m3"]),
                   worker=rng.choice(["w1", "w2", None]), cost=rng.randint(0, 900))
        u.input_tokens, u.cached_tokens = rng.randint(0, 5000), rng.randint(0, 50)
        u.output_tokens, u.reasoning_tokens = rng.randint(0, 700), rng.randint(0, 9)
        u.endpoint = rng.choice(["/v1/responses", "/v1/chat/completions", None])  # None: a row from before
        if rng.random() < 0.6:  # an alias ("vendor7/m2") of the served model
            u.served_model, u.model = u.model, f"vendor{rng.randint(0, 40)}/{u.model}"
        if n % 3:  # a lease's batch commit, or one settle
            results, _ = await ledger.lease_commit([("lease:r", u)], [])
            assert results == [u.cost_micros]
        else:
            assert await ledger.settle(u.request_id, u)
        rows.append(u)
    points = [None, *edges, *(base + rng.uniform(-3600, 2 * DAY + 3600) for _ in range(20))]
    for _ in range(60):
        since, until = rng.choice(points), rng.choice(points)
        if since is not None and until is not None and until < since:
            since, until = until, since
        key_id, model = rng.choice([None, keys[0]]), rng.choice([None, None, "m2"])
        group_by = tuple(rng.sample(["key", "model", "worker", "endpoint", "team", rng.choice(["day", "hour"])],
                                    rng.randint(0, 4)))
        found = await ledger.usage_totals(group_by, since=since, until=until, key_id=key_id, model=model)
        expected: dict[tuple, list[int]] = {}
        for u in rows:
            if ((since is not None and u.created_at < since) or (until is not None and u.created_at >= until)
                    or (key_id and u.key_id != key_id) or (model and u.grouped_model != model)):
                continue
            values = {"key": u.key_id, "model": u.grouped_model, "worker": u.worker,
                      "day": int(u.created_at // DAY * DAY), "hour": int(u.created_at // 3600 * 3600),
                      "endpoint": u.endpoint or "/v1/responses",
                      "team": team.level_id if u.key_id == keys[1] else None}
            sums = expected.setdefault(tuple(values[g] for g in group_by), [0] * 7)
            for i, v in enumerate((1, u.input_tokens, u.cached_tokens, u.output_tokens, u.reasoning_tokens,
                                   u.cost_micros, u.cost_micros)):
                sums[i] += v
        if not group_by and not expected:
            expected[()] = [0] * 7
        got = {tuple(t.group[g] for g in group_by): [t.requests, t.input_tokens, t.cached_tokens, t.output_tokens,
                                                     t.reasoning_tokens, t.cost_micros, t.debited_micros]
               for t in found}
        assert got == expected, (group_by, since, until, key_id, model)


@sqlite_only
async def test_console_reads_use_the_indexes(ledger):
    plans = {
        "by time": ("SELECT COUNT(*), SUM(cost_micros) FROM usage WHERE created_at >= ? AND created_at < ?",
                    (0.0, 1.0), "usage_by_time"),
        "by key and time": ("SELECT COALESCE(SUM(debited_micros), 0) FROM usage WHERE key_id = ? AND created_at >= ?",
                            ("k", 0.0), "COVERING INDEX usage_by_key_time"),
        "hourly sums": ("SELECT key_id, SUM(cost_micros) FROM usage_hourly WHERE hour >= ? AND hour < ? GROUP BY 1",
                        (0, 3600), "PRIMARY KEY"),
        "audit by key": ("SELECT * FROM audit WHERE key_id = ? ORDER BY seq DESC LIMIT 5", ("k",), "audit_by_key"),
    }
    for what, (sql, params, index) in plans.items():
        plan = " ".join(await ledger.explain(sql, params))
        assert index in plan, (what, plan)
        assert "SCAN usage " not in plan + " " and "SCAN audit" not in plan, (what, plan)


async def test_audit_is_append_only_and_service_audits_every_change(ledger):
    service = KeyService(ledger, "admin:test")
    secret, record = await service.create({"name": "svc", "balance_micros": 5, "tokens_per_min": 10})
    await service.top_up(record.key_id, 7)
    await service.update(record.key_id, {"daily_budget_micros": 9, "expires_at": "2999-01-01"})
    new_secret, _ = await service.rotate(record.key_id)
    await service.revoke(record.key_id)
    entries = await ledger.list_audit(key_id=record.key_id)
    assert [e.action for e in entries] == ["key.revoke", "key.rotate", "key.update", "key.topup", "key.create"]
    assert all(e.actor == "admin:test" for e in entries)
    assert entries[2].details["expires_at"] == 32472144000.0
    text = json.dumps([e.details for e in entries])
    assert secret not in text and new_secret not in text
    with pytest.raises(LedgerError):
        await service.rotate(record.key_id)  # revoked: no new secret
    with pytest.raises(ValueError):
        await service.update(record.key_id, {"rate_per_min": 0})
    with pytest.raises(ValueError):
        await service.create({"name": "x", "secret": "mine"})
    if isinstance(ledger, SQLiteLedger):
        conn = sqlite3.connect(ledger.path)
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute("UPDATE audit SET actor = 'someone else'")
        with pytest.raises(sqlite3.DatabaseError):
            conn.execute("DELETE FROM audit")
        conn.close()
        return
    import asyncpg

    conn = await asyncpg.connect(ledger.dsn)  # as anyone with the database's address would
    try:
        for sql in ("UPDATE audit SET actor = 'someone else'", "DELETE FROM audit", "DELETE FROM usage"):
            with pytest.raises(asyncpg.RaiseError, match="append-only"):
                await conn.execute(sql)
    finally:
        await conn.close()


async def test_expired_and_rotated_secrets_stop_working(ledger):
    secret, record = await ledger.create_key("e", 1, limits=KeyLimits(expires_at=time.time() + 60))
    assert await ledger.lookup_key(secret) is not None
    new_secret, _ = await ledger.rotate_key(record.key_id)
    assert await ledger.lookup_key(secret) is None and await ledger.lookup_key(new_secret) is not None
    await ledger.set_limits(record.key_id, KeyLimits(expires_at=time.time() - 1))
    assert (await ledger.lookup_key(new_secret)).expired()  # found, to be refused
    await ledger.set_limits(record.key_id, KeyLimits(expires_at=None))
    assert not (await ledger.lookup_key(new_secret)).expired()


async def test_a_ledger_from_before_the_console_is_migrated(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE keys (key_id TEXT PRIMARY KEY, name TEXT NOT NULL, prefix TEXT NOT NULL,
            secret_sha256 BLOB NOT NULL UNIQUE, balance_micros INTEGER NOT NULL DEFAULT 0 CHECK (balance_micros >= 0),
            allowed_models TEXT, concurrency INTEGER, rate_per_min INTEGER, revoked INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL);
        CREATE TABLE usage (seq INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL UNIQUE,
            key_id TEXT NOT NULL REFERENCES keys(key_id), model TEXT NOT NULL, input_tokens INTEGER NOT NULL,
            cached_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL,
            cost_micros INTEGER NOT NULL, debited_micros INTEGER NOT NULL, status TEXT NOT NULL,
            created_at REAL NOT NULL);
        INSERT INTO keys VALUES ('key_old', 'old', 'sk-rp-abcdef', x'00', 500, NULL, NULL, NULL, 0, 1.0);
        INSERT INTO usage (request_id, key_id, model, input_tokens, cached_tokens, output_tokens, reasoning_tokens,
            cost_micros, debited_micros, status, created_at) VALUES ('r0', 'key_old', 'm', 1, 0, 1, 0, 3, 3,
            'completed', 2.0);
    """)
    conn.commit()
    conn.close()
    async with SQLiteLedger(path) as ledger:
        record = await ledger.get_key("key_old")
        assert record.balance_micros == 500 and record.tokens_per_min is None and record.expires_at is None
        ((_, row),) = await ledger.usage_rows()
        assert row.worker is None and row.request_id == "r0"
        (total,) = await ledger.usage_totals(())  # the hourly sums were filled from the old rows
        assert total.requests == 1 and total.cost_micros == 3
        await ledger.set_limits("key_old", KeyLimits(tokens_per_min=100))
        assert (await ledger.get_key("key_old")).tokens_per_min == 100


def _cli(db: str, *argv: str, capsys) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_key_commands(parser.add_subparsers(dest="command"))
    code = run_key_command(parser.parse_args(["keys", "--db", db, *argv]))
    return code, capsys.readouterr().out


def test_keys_cli_goes_through_the_service(tmp_path, capsys):
    db = str(tmp_path / "cli.db")
    code, out = _cli(db, "create", "cli-key", "--balance", "1000", "--tpm", "500", "--daily-budget", "300",
                     "--expires", "2999-01-01T00:00:00Z", "--json", capsys=capsys)
    assert code == 0
    created = json.loads(out)
    key_id, secret = created["key_id"], created["secret"]
    assert created["tokens_per_min"] == 500 and created["expires"] == "2999-01-01T00:00:00Z"
    code, out = _cli(db, "limits", key_id, "--tpm", "none", "--monthly-budget", "900", "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["tokens_per_min"] is None and json.loads(out)["monthly_budget_micros"] == 900
    with pytest.raises(SystemExit):  # argparse refuses 0 before anything is opened
        _cli(db, "limits", key_id, "--tpm", "0", capsys=capsys)
    code, out = _cli(db, "show", key_id, "--json", capsys=capsys)
    assert json.loads(out)["daily_budget_remaining_micros"] == 300
    code, out = _cli(db, "rotate", key_id, "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["secret"] != secret
    code, out = _cli(db, "audit", "--json", capsys=capsys)
    audit = json.loads(out)  # one JSON document, an array, as `list --json` and `usage --format json`
    assert [e["action"] for e in audit] == ["key.rotate", "key.update", "key.create"]
    assert all(e["actor"].startswith("cli") for e in audit)
    assert secret not in out
    for listing in (["list"], ["usage", "--format", "json"]):
        code, out = _cli(db, *listing, *(["--json"] if listing == ["list"] else []), capsys=capsys)
        assert code == 0 and isinstance(json.loads(out), list), listing
    code, out = _cli(db, "show", key_id, capsys=capsys)
    shown = dict(line.split(": ", 1) for line in out.splitlines())
    assert "None" not in out and shown["allowed_models"] == "every model" and shown["concurrency"] == "no limit"
    assert shown["tokens_per_min"] == "no limit" and shown["expires"] == "2999-01-01T00:00:00Z"
    code, _ = _cli(db, "revoke", key_id, capsys=capsys)
    code, out = _cli(db, "topup", key_id, "--usd", "5", capsys=capsys)
    assert code != 0  # a revoked key takes no top-up
    code, out = _cli(db, "show", key_id, "--json", capsys=capsys)
    assert json.loads(out)["balance_micros"] == created["balance_micros"]
    code, out = _cli(db, "usage", "--group-by", "key,day", "--format", "csv", capsys=capsys)
    assert code == 0 and list(csv.reader(io.StringIO(out)))[0][:2] == ["key", "day"]
    with pytest.raises(SystemExit):
        _cli(db, "usage", "--since", "yesterday", capsys=capsys)


async def test_tokens_per_minute_limit(make_proxy, limits_backend):
    proxy = await make_proxy({"auth": {"demo_key": True}, "limits": limits_backend})
    secret, record = await proxy.ledger.create_key("tpm", 50_000_000, limits=KeyLimits(tokens_per_min=12))
    async with aiohttp.ClientSession() as s:
        h = {"Authorization": f"Bearer {secret}"}
        body = {"model": "tiny-org/tiny-model", "input": "Tell me a long story.", "max_output_tokens": 40}
        first = await s.post(proxy.url + "/v1/responses", json=body, headers=h)
        assert first.status == 200
        used = (await first.json())["usage"]
        assert used["input_tokens"] + used["output_tokens"] >= 24  # the bucket is 12 or more below zero now
        second = await s.post(proxy.url + "/v1/responses", json=body, headers=h)
        assert second.status == 429
        assert (await second.json())["error"]["code"] == "tokens_per_min_exceeded"
        assert int(second.headers["Retry-After"]) >= 1
        # another key is not affected
        other = await s.post(proxy.url + "/v1/responses", json=body,
                             headers={"Authorization": f"Bearer {proxy.api_key}"})
        assert other.status == 200


def _budget_client(s: aiohttp.ClientSession, proxy, secret: str):
    """One request of the key, settled before it returns: its status (a 402 must be the budget's)."""
    from middlewares.balance import wait_for_settlements

    h = {"Authorization": f"Bearer {secret}"}
    body = {"model": "tiny-org/tiny-model", "input": "Hi.", "max_output_tokens": 16}

    async def status() -> int:
        r = await s.post(proxy.url + "/v1/responses", json=body, headers=h)
        await wait_for_settlements(proxy.app)
        if r.status == 402:
            assert (await r.json())["error"]["code"] == "budget_exceeded"
        return r.status

    return status


async def _until_refused(status) -> list[int]:
    statuses = []
    for _ in range(30):
        statuses.append(await status())
        if statuses[-1] == 402:
            break
    return statuses


async def test_daily_budget_refuses_once_spent(make_proxy):
    proxy = await make_proxy({"auth": {"demo_key": True}, "balance": {"lease_max_micros": 0}})
    secret, record = await proxy.ledger.create_key("budget", 50_000_000, limits=KeyLimits(daily_budget_micros=400))

    async with aiohttp.ClientSession() as s:
        statuses = await _until_refused(_budget_client(s, proxy, secret))
        assert statuses[0] == 200 and statuses[-1] == 402
    day, _ = period_starts()
    spent = await proxy.ledger.spend_since(record.key_id, day)
    assert 0 < spent <= 400  # one request at a time: the budget bounds the spend exactly
    assert (await proxy.ledger.get_key(record.key_id)).balance_micros == 50_000_000 - spent


async def test_monthly_budget_refuses_once_spent_and_a_new_day_does_not_reset_it(make_proxy, monkeypatch):
    from proxy.ledger import service

    proxy = await make_proxy({"auth": {"demo_key": True}, "balance": {"lease_max_micros": 0}})
    # The daily budget never binds here: only the monthly one can refuse.
    secret, record = await proxy.ledger.create_key("monthly", 50_000_000,
                                                   limits=KeyLimits(daily_budget_micros=10_000_000,
                                                                    monthly_budget_micros=400))

    async with aiohttp.ClientSession() as s:
        status = _budget_client(s, proxy, secret)
        statuses = await _until_refused(status)
        assert statuses[0] == 200 and statuses[-1] == 402
        _, month = period_starts()
        spent = await proxy.ledger.spend_since(record.key_id, month)
        assert 0 < spent <= 400  # one request at a time: the budget bounds the spend exactly
        assert (await proxy.ledger.get_key(record.key_id)).balance_micros == 50_000_000 - spent

        # A new UTC day in the same month: the spend is no longer today's, still this month's.
        real, rollover = service.period_starts, time.time()
        monkeypatch.setattr(service, "period_starts", lambda now=None: (rollover, real(now)[1]))
        assert await status() == 402
        # A new month: the budget is whole again.
        monkeypatch.setattr(service, "period_starts", lambda now=None: (rollover, rollover))
        assert await status() == 200


async def _key_series(proxy) -> tuple[str, list[str]]:
    """The /metrics text, and its per-key lines."""
    async with aiohttp.ClientSession() as s:
        text = await (await s.get(proxy.url + "/metrics")).text()
    return text, [line for line in text.splitlines() if line.startswith("responses_proxy_key_")]


async def test_per_key_metrics_for_the_listed_keys_only(make_proxy, tmp_path):
    from middlewares.balance import wait_for_settlements

    # The keys exist before the proxy starts, as an operator's list in config.yaml names them.
    records = {}
    async with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        for name in ("listed", "listed_idle", "unlisted"):
            records[name] = await ledger.create_key(name, 10_000_000)
    listed, idle, unlisted = (records[n][1] for n in ("listed", "listed_idle", "unlisted"))
    proxy = await make_proxy({"auth": {"demo_key": True},
                              "metrics": {"key_ids": [listed.key_id, idle.key_id, "key_gone"]}})
    for name, n in (("listed", 1), ("unlisted", 3)):  # the unlisted key spends most: no top N here
        client = proxy.openai(api_key=records[name][0])
        for i in range(n):
            await client.responses.create(model="tiny-org/tiny-model", input=f"Hello {i}", max_output_tokens=8)
    await wait_for_settlements(proxy.app)
    text, lines = await _key_series(proxy)
    shown = {(line.split("{")[0], line.split('key_id="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
             for line in lines}
    assert {key for _, key in shown} == {listed.key_id, idle.key_id}  # unlisted and unknown ids: no series
    assert unlisted.key_id not in text and "key_gone" not in text
    assert all(f'name="{n}"' in text for n in ("listed", "listed_idle"))
    for record in (listed, idle):
        balance = (await proxy.ledger.get_key(record.key_id)).balance_micros
        assert shown[("responses_proxy_key_balance_micros", record.key_id)] == balance
        assert shown[("responses_proxy_key_spend_today_micros", record.key_id)] == 10_000_000 - balance
        assert shown[("responses_proxy_key_spend_month_micros", record.key_id)] == 10_000_000 - balance
    assert shown[("responses_proxy_key_balance_micros", listed.key_id)] < 10_000_000  # it did spend
    assert shown[("responses_proxy_key_spend_today_micros", idle.key_id)] == 0


async def test_per_key_metrics_are_bounded(make_proxy):
    proxy = await make_proxy({"auth": {"demo_key": True}, "metrics": {"top_keys": 1}})
    secrets_ = {}
    for name, n in (("big", 3), ("small", 1), ("idle", 0)):
        secret, record = await proxy.ledger.create_key(name, 10_000_000)
        secrets_[name] = record
        client = proxy.openai(api_key=secret)
        for i in range(n):
            await client.responses.create(model="tiny-org/tiny-model", input=f"Hello {i}", max_output_tokens=8)
    from middlewares.balance import wait_for_settlements

    await wait_for_settlements(proxy.app)
    text, lines = await _key_series(proxy)
    big = secrets_["big"]
    assert {line.split("{")[0] for line in lines} == {
        "responses_proxy_key_balance_micros", "responses_proxy_key_spend_today_micros",
        "responses_proxy_key_spend_month_micros"}
    assert all(big.key_id in line for line in lines) and len(lines) == 3  # top 1 only
    balance = (await proxy.ledger.get_key(big.key_id)).balance_micros
    shown = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
    assert shown["responses_proxy_key_balance_micros"] == balance
    assert shown["responses_proxy_key_spend_today_micros"] == 10_000_000 - balance > 0


# ------------------------------------------------ bounded model cardinality (issue 25)

_SERVED = "tiny-org/tiny-model"  # what the simulator's worker serves (tests/conftest.py make_proxy)


@pytest.mark.parametrize("backend", LEDGER_BACKENDS)
async def test_aliases_of_one_model_are_one_model_in_the_console(make_proxy, request, tmp_path, backend):
    """The attacker sends many distinct model strings that all mean one served model
    ("p7/tiny-org/tiny-model": resolve_model strips the leading segment). The console's
    per-model breakdown (totals, the dashboard's series, from the rows and from the hourly
    sums) has exactly one entry, the served model, with all the traffic; a row's detail still
    shows the client's string."""
    admin_key = "adm-test-0123456789abcdef"
    proxy = await make_proxy({"admin": {"keys": [{"name": "ops", "key": admin_key}], "session_secret": "s" * 32},
                              "auth": {"demo_key": True}, "ledger": ledger_section(backend, request, tmp_path)})
    sent = [_SERVED] + [f"p{i}/{_SERVED}" for i in range(47)]
    gate = asyncio.Semaphore(8)

    async def one(s: aiohttp.ClientSession, i: int, model: str) -> None:
        async with gate:
            r = await s.post(proxy.url + "/v1/responses", headers={"Authorization": f"Bearer {proxy.api_key}"},
                             json={"model": model, "input": f"Hello {i}", "max_output_tokens": 8, "stream": i % 2 == 1})
            body = await r.read()
            assert r.status == 200, body[:300]
            if i % 2 == 0:
                assert json.loads(body)["model"] == model  # the Response echoes the client's string

    from middlewares.balance import wait_for_settlements

    admin = {"Authorization": f"Bearer {admin_key}"}
    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s, i, m) for i, m in enumerate(sent)))
        await wait_for_settlements(proxy.app)

        async def get(path: str) -> Any:
            r = await s.get(proxy.url + "/admin/api" + path, headers=admin)
            assert r.status == 200, await r.text()
            return await r.json()

        by_model = (await get("/usage/totals?group_by=model"))["data"]
        assert [(t["model"], t["requests"]) for t in by_model] == [(_SERVED, len(sent))]
        # Whole hours only: read from the hourly sums (usage_hourly), keyed by the served model too.
        hour = int(time.time()) // 3600 * 3600
        summed = (await get(f"/usage/totals?group_by=model,hour&since={hour - 3600}&until={hour + 7200}"))["data"]
        assert {t["model"] for t in summed} == {_SERVED}
        assert sum(t["requests"] for t in summed) == len(sent)
        for window in ("24h", "7d"):
            overview = await get(f"/overview?range={window}")
            series = overview["series"]["by_model"]
            assert {e["model"] for e in series} == {_SERVED}, window
            assert sum(e["requests"] for e in series) == len(sent) == overview["totals"]["requests"]
        rows = (await get("/usage?limit=1000"))["data"]
        assert sorted(r["model"] for r in rows) == sorted(sent)  # the detail keeps what the client sent
        assert {r["served_model"] for r in rows} == {_SERVED}
        assert len((await get(f"/usage?limit=1000&model={_SERVED}"))["data"]) == len(sent)


async def test_usage_rows_keep_the_served_model_beside_the_clients_string(ledger):
    """Both ways a row is recorded (settle, a lease's batch) keep served_model; totals and the
    model filter go by it, rows without one (older rows) by their model; the ledger's boundary
    refuses a served_model that is not a non-empty string."""
    _, key = await ledger.create_key("k", 10**9)
    base = 1_764_547_200.0
    sent = []
    for n in range(12):
        u = _usage(f"r{n}", key.key_id, base + n * 1000, model=f"vendor{n}/m1")
        u.served_model = "m1"
        sent.append(u)
    old = _usage("old", key.key_id, base + 5, model="legacy/m1")  # as recorded before served_model
    for n, u in enumerate([*sent, old]):
        if n % 2:
            assert await ledger.settle(u.request_id, u)
        else:
            assert (await ledger.lease_commit([("lease:s", u)], []))[0] == [u.cost_micros]
    assert (await ledger.usage("r3")).served_model == "m1" and (await ledger.usage("r3")).model == "vendor3/m1"
    assert (await ledger.usage("old")).served_model is None
    for since, until in ((None, None), (base, base + DAY), (base + 1.5, base + 7000.25)):
        got = {t.group["model"]: t.requests for t in await ledger.usage_totals(("model",), since=since, until=until)}
        want: dict[str, int] = {}
        for u in [*sent, old]:
            if (since is None or u.created_at >= since) and (until is None or u.created_at < until):
                want[u.grouped_model] = want.get(u.grouped_model, 0) + 1
        assert got == want, (since, until)
    assert {r.request_id for _, r in await ledger.usage_rows(model="m1")} == {u.request_id for u in sent}
    (total,) = await ledger.usage_totals((), model="m1", since=base, until=base + DAY)
    assert total.requests == len(sent)
    for bad in ("", 5):
        u = _usage(f"bad-{bad}", key.key_id, base)
        u.served_model = bad
        with pytest.raises(ValueError):
            await ledger.settle(u.request_id, u)
        (result,), _ = await ledger.lease_commit([("lease:s", u)], [])
        assert isinstance(result, ValueError)
    assert await ledger.usage("bad-") is None


async def test_a_ledger_from_before_served_model_is_migrated(tmp_path):
    """A ledger made by the previous schema (usage without served_model, hourly sums keyed by
    the client's strings) opens: the column is added, the old rows keep their sums under their
    model, new rows are summed under their served model, and the sums equal the rows."""
    path = tmp_path / "previous.db"
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE keys (key_id TEXT PRIMARY KEY, name TEXT NOT NULL, prefix TEXT NOT NULL,
            secret_sha256 BLOB NOT NULL UNIQUE, balance_micros INTEGER NOT NULL DEFAULT 0 CHECK (balance_micros >= 0),
            allowed_models TEXT, concurrency INTEGER, rate_per_min INTEGER, revoked INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL, expires_at REAL, tokens_per_min INTEGER, daily_budget_micros INTEGER,
            monthly_budget_micros INTEGER);
        CREATE TABLE usage (seq INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL UNIQUE,
            key_id TEXT NOT NULL REFERENCES keys(key_id), model TEXT NOT NULL, input_tokens INTEGER NOT NULL,
            cached_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL,
            cost_micros INTEGER NOT NULL CHECK (cost_micros >= 0),
            debited_micros INTEGER NOT NULL CHECK (debited_micros >= 0 AND debited_micros <= cost_micros),
            status TEXT NOT NULL, created_at REAL NOT NULL, worker TEXT);
        CREATE TABLE usage_hourly (hour INTEGER NOT NULL, key_id TEXT NOT NULL, model TEXT NOT NULL,
            worker TEXT NOT NULL, requests INTEGER NOT NULL, input_tokens INTEGER NOT NULL,
            cached_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL,
            cost_micros INTEGER NOT NULL, debited_micros INTEGER NOT NULL,
            PRIMARY KEY (hour, key_id, model, worker)) WITHOUT ROWID;
        INSERT INTO keys (key_id, name, prefix, secret_sha256, balance_micros, created_at)
            VALUES ('key_old', 'old', 'sk-rp-abcdef', x'00', 5000, 1.0);
        INSERT INTO usage (request_id, key_id, model, input_tokens, cached_tokens, output_tokens, reasoning_tokens,
            cost_micros, debited_micros, status, created_at, worker) VALUES
            ('r0', 'key_old', 'p0/m', 1, 0, 1, 0, 3, 3, 'completed', 1764547210.0, 'w1'),
            ('r1', 'key_old', 'p1/m', 1, 0, 1, 0, 4, 4, 'completed', 1764547220.0, 'w1');
        INSERT INTO usage_hourly VALUES (1764547200, 'key_old', 'p0/m', 'w1', 1, 1, 0, 1, 0, 3, 3),
            (1764547200, 'key_old', 'p1/m', 'w1', 1, 1, 0, 1, 0, 4, 4);
    """)
    conn.commit()
    conn.close()
    base = 1_764_547_200.0
    async with SQLiteLedger(path) as ledger:
        new = [_usage(f"n{i}", "key_old", base + 30 + i, model=f"p{i + 2}/m", cost=5) for i in range(3)]
        for u in new:
            u.served_model = "m"
        assert await ledger.settle("n0", new[0])
        assert (await ledger.lease_commit([("lease:x", u) for u in new[1:]], []))[0] == [5, 5]
        ((_, row), *_) = await ledger.usage_rows()
        assert row.served_model == "m"
        assert (await ledger.usage("r0")).served_model is None
        by_model = {t.group["model"]: (t.requests, t.cost_micros)
                    for t in await ledger.usage_totals(("model",), since=base, until=base + 3600)}  # the sums
        assert by_model == {"p0/m": (1, 3), "p1/m": (1, 4), "m": (3, 15)}
    conn = sqlite3.connect(path)
    try:
        assert "served_model" in {r[1] for r in conn.execute("PRAGMA table_info(usage)")}
        sums = conn.execute("SELECT hour, key_id, model, worker, requests, cost_micros FROM usage_hourly"
                            " ORDER BY 1, 2, 3, 4").fetchall()
        rows = conn.execute("SELECT CAST(created_at / 3600 AS INTEGER) * 3600, key_id, COALESCE(served_model, model),"
                            " COALESCE(worker, ''), COUNT(*), SUM(cost_micros) FROM usage GROUP BY 1, 2, 3, 4"
                            " ORDER BY 1, 2, 3, 4").fetchall()
        assert sums == rows
    finally:
        conn.close()


async def test_a_budget_too_small_for_the_next_hold_says_what_is_left(make_proxy):
    # A budget of 1 micro-unit: not spent, but less than any hold (the input and one output token).
    proxy = await make_proxy({})
    secret, _ = await proxy.ledger.create_key("tiny-budget", 50_000_000, limits=KeyLimits(daily_budget_micros=1))
    async with aiohttp.ClientSession() as s:
        r = await s.post(proxy.url + "/v1/responses", json={"model": "tiny-org/tiny-model", "input": "Hi."},
                         headers={"Authorization": f"Bearer {secret}"})
        error = (await r.json())["error"]
    assert r.status == 402 and error["code"] == "budget_exceeded"
    assert "has 1 micro-units left, less than this request's smallest hold" in error["message"], error
    assert "is spent" not in error["message"]


async def test_a_refused_key_is_told_why_and_an_unknown_one_nothing(make_proxy):
    import datetime

    proxy = await make_proxy({})
    expired_at = time.time() - 60
    expired, _ = await proxy.ledger.create_key("old", 1_000_000, limits=KeyLimits(expires_at=expired_at))
    revoked, record = await proxy.ledger.create_key("gone", 1_000_000)
    await proxy.ledger.revoke(record.key_id)
    when = datetime.datetime.fromtimestamp(expired_at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    async with aiohttp.ClientSession() as s:
        for secret, message in ((expired, f"This API key expired at {when}."),
                                (revoked, "This API key was revoked."),
                                (revoked[:-4] + "zzzz", "Incorrect API key provided.")):
            r = await s.get(proxy.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"})
            error = (await r.json())["error"]
            assert r.status == 401 and error["code"] == "invalid_api_key" and error["message"] == message


async def test_the_demo_keys_creation_and_its_predecessors_revocation_are_audited(tmp_path):
    from proxy.ledger.service import DEMO_ACTOR, new_demo_key

    ledger = open_ledger({"path": str(tmp_path / "demo.db")})
    async with ledger:
        first = await new_demo_key(ledger, 1_000)
        second = await new_demo_key(ledger, 2_000)
        old, new = await ledger.lookup_key(first), await ledger.lookup_key(second)
        assert old.revoked and not new.revoked and new.balance_micros == 2_000
        audit = [(e.actor, e.action, e.key_id) for e in await ledger.list_audit(limit=10)]
    assert audit == [(DEMO_ACTOR, "key.create", new.key_id), (DEMO_ACTOR, "key.revoke", old.key_id),
                     (DEMO_ACTOR, "key.create", old.key_id)]


def test_a_reports_since_is_a_time_and_an_expiry_needs_a_unit_or_a_plausible_time(tmp_path, capsys):
    db = str(tmp_path / "cli.db")
    for bad in ("30", "999999w"):
        with pytest.raises(SystemExit):
            _cli(db, "create", "k", "--expires", bad, capsys=capsys)
    code, out = _cli(db, "create", "k", "--expires", "2w", "--json", capsys=capsys)
    assert code == 0 and 13 * 86400 < json.loads(out)["expires_at"] - time.time() <= 14 * 86400
    with pytest.raises(SystemExit):  # "7d" is no point in time: refused, not read as a week from now
        _cli(db, "usage", "--since", "7d", capsys=capsys)
    code, out = _cli(db, "usage", "--since", "2026-01-01", "--format", "json", capsys=capsys)
    assert code == 0 and json.loads(out) == []
