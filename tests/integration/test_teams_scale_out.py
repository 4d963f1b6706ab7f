"""A team's purse and budget shared by its keys on 4 replicas (separate processes on one
PostgreSQL ledger and one Redis, in front of one simulator), under 200 concurrent clients: the
team's budget is never passed, its balance never overdrawn, and at every level (organisation,
team, user) the balance drop equals the debits of the keys under it. Real servers started by
the fixtures (tests/support/pg_server.py, redis_server.py), no mocks."""

from __future__ import annotations

import asyncio
import secrets
import time

import aiohttp
import pytest

from tests.support.cluster import Cluster, Replica, replica_config, send

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPLICAS = 4
TEAM_BALANCE = 2_000
TEAM_BUDGET = 600  # about 13 answers at the simulator's prices: the budget binds before the purse
ORG_BALANCE = 1_000_000


async def _organisation(dsn: str, tmp) -> dict:
    from proxy.ledger import open_ledger

    ledger = open_ledger({"backend": "postgres", "dsn": dsn, "spool_path": str(tmp / "setup-spool.jsonl")},
                         base_dir=tmp)
    await ledger.start()
    try:
        org = await ledger.create_level("org", {"name": "acme", "balance_micros": ORG_BALANCE})
        team = await ledger.create_level("team", {"name": "ml", "parent_id": org.level_id,
                                                  "balance_micros": TEAM_BALANCE, "budget_micros": TEAM_BUDGET,
                                                  "budget_period": "daily"})
        user = await ledger.create_level("user", {"name": "ann", "parent_id": team.level_id})
        keys = []
        for i in range(4):  # two under the user, two under the team itself; none with a purse of its own
            place = await ledger.placement(team.level_id if i % 2 else None, None if i % 2 else user.level_id)
            place["own_balance"] = False
            secret, record = await ledger.create_key(f"k{i}", 0, placement=place)
            keys.append((record.key_id, secret))
    finally:
        await ledger.close()
    return {"org": org.level_id, "team": team.level_id, "user": user.level_id, "keys": keys}


@pytest.fixture
async def cluster(pg_dsn, redis_db, sim, tmp_path):
    org = await _organisation(pg_dsn, tmp_path)
    config = replica_config(sim.url, pg_dsn, redis_db.url, f"rp-{secrets.token_hex(3)}:", patient=True)
    replicas = [Replica(i, tmp_path, config) for i in range(REPLICAS)]
    await asyncio.gather(*(r.start() for r in replicas))
    c = Cluster(pg_dsn, replicas, sim)
    c.keys = {}
    c.org = org
    try:
        yield c
    finally:
        await asyncio.gather(*(r.stop() for r in replicas))


async def test_a_team_budget_shared_by_keys_on_4_replicas_is_never_passed_and_every_level_adds_up(cluster):
    keys = cluster.org["keys"]
    slow = {"text": " ".join(["tok"] * 20), "delay": 0.01}

    async def client(http: aiohttp.ClientSession, i: int):
        deadline = time.monotonic() + 60
        while True:
            status, headers, raw = await send(http, cluster.replicas[i % REPLICAS], keys[i % 4][1],
                                              stream=bool(i % 3), script=slow)
            if status != 429 or time.monotonic() > deadline:
                return status, headers, raw
            await asyncio.sleep(0.02 + (i % 7) * 0.01)  # not a wait: a refused client backs off

    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(client(http, i) for i in range(200)))
    statuses = [s for s, _, _ in results]
    by_status = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"200 requests on a team's 4 keys over {REPLICAS} replicas: {by_status}")
    assert set(statuses) <= {200, 402}, by_status
    await cluster.wait_billed([h["x-request-id"] for s, h, _ in results if s == 200])

    org, team, user = cluster.org["org"], cluster.org["team"], cluster.org["user"]
    rows = {r[0]: r for r in await cluster.query(
        "SELECT level_id, balance_micros, period_spent FROM levels WHERE level_id = ANY($1::text[])",
        [org, team, user])}

    async def debits(column: str, level_id: str) -> int:
        return (await cluster.query(f"SELECT COALESCE(SUM(u.debited_micros), 0)::bigint FROM usage u"
                                    f" JOIN keys k ON k.key_id = u.key_id WHERE k.{column} = $1", level_id))[0][0]

    team_debits = await debits("team_id", team)
    print(f"team: spent {rows[team][2]} of a {TEAM_BUDGET} budget, balance {TEAM_BALANCE} -> {rows[team][1]}")
    assert rows[team][2] == team_debits <= TEAM_BUDGET  # the budget, never passed
    assert TEAM_BALANCE - rows[team][1] == team_debits  # balance drop == debits
    assert ORG_BALANCE - rows[org][1] == await debits("org_id", org) == team_debits
    assert rows[user][1] is None  # no purse: its keys' money is the team's
    user_debits = await debits("user_id", user)
    assert 0 < user_debits < team_debits
    answered = statuses.count(200)
    assert TEAM_BUDGET // 100 <= answered <= TEAM_BUDGET // 20, answered  # the budget bound the answers
    assert statuses.count(402) == 200 - answered
    # No key was debited on its own (none has a purse), nothing billed twice, no debit above its cost.
    assert [r[0] for r in await cluster.query("SELECT balance_micros FROM keys")] == [0] * 4
    assert await cluster.query("SELECT request_id FROM usage GROUP BY request_id HAVING COUNT(*) > 1") == []
    assert await cluster.query("SELECT request_id FROM usage WHERE debited_micros > cost_micros") == []
