"""The organisation through the admin API, against a real proxy on loopback with a real SQLite
ledger and the simulator: teams and users shaped like keys, a team admin held to their teams
(cannot see or touch another, cannot raise their own budget, cannot mint money), a viewer's
writes refused, a rotated key's old secret working until its grace ends and not after, block
and unblock, a team's models and limits applied to its keys, and the request browser listing
exactly the ledger's rows of a team (read back with plain SQL, not the proxy's own queries)."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import aiohttp
import pytest

ADMIN = "adm-owner-0123456789abcdef"
VIEWER = "adm-viewer-0123456789abcdef"
LEAD = "adm-lead-ml-0123456789abcdef"
OTHER_LEAD = "adm-lead-ops-0123456789abcdef"


def _h(key: str = ADMIN) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def org_proxy(make_proxy):
    return await make_proxy({
        "admin": {"keys": [{"name": "owner", "key": ADMIN}, {"name": "finance", "key": VIEWER, "role": "viewer"},
                           {"name": "ml-lead", "key": LEAD, "role": "team_admin", "teams": ["team_ml"]},
                           {"name": "ops-lead", "key": OTHER_LEAD, "role": "team_admin", "teams": ["team_ops"]}],
                  "session_secret": "s" * 32},
        "auth": {"demo_key": True}})


async def _json(response: aiohttp.ClientResponse, status: int) -> dict:
    body = await response.json()
    assert response.status == status, body
    return body


async def _org(s: aiohttp.ClientSession, url: str) -> None:
    await _json(await s.post(url + "/admin/api/orgs", headers=_h(), json={
        "level_id": "org_acme", "name": "Acme", "balance_usd": "100"}), 201)
    for team in ("team_ml", "team_ops"):
        await _json(await s.post(url + "/admin/api/teams", headers=_h(), json={
            "level_id": team, "name": team[5:], "parent_id": "org_acme", "balance_usd": "10",
            "budget_usd": "5", "budget_period": "daily"}), 201)


async def _key(s, url: str, admin: str = ADMIN, status: int = 201, **fields) -> dict:
    return await _json(await s.post(url + "/admin/api/keys", headers=_h(admin), json={"name": "k", **fields}),
                       status)


async def test_a_team_admin_sees_and_changes_only_their_team_and_never_its_money(org_proxy):
    url = org_proxy.url
    async with aiohttp.ClientSession() as s:
        await _org(s, url)
        theirs = (await _key(s, url, team_id="team_ops"))["key"]
        # Their team, and only theirs.
        teams = (await _json(await s.get(url + "/admin/api/teams", headers=_h(LEAD)), 200))["data"]
        assert [t["level_id"] for t in teams] == ["team_ml"]
        await _json(await s.get(url + "/admin/api/teams/team_ops", headers=_h(LEAD)), 404)
        assert (await _json(await s.get(url + "/admin/api/orgs", headers=_h(LEAD)), 200))["data"] == []
        # Not their own budget, nor any top-up, nor a key with money of its own.
        refused = await _json(await s.patch(url + "/admin/api/teams/team_ml", headers=_h(LEAD),
                                            json={"budget_usd": "1000"}), 403)
        assert refused["error"]["code"] == "insufficient_role"
        await _json(await s.post(url + "/admin/api/teams/team_ml/topup", headers=_h(LEAD), json={"usd": "5"}), 403)
        await _key(s, url, LEAD, 403, team_id="team_ml", balance_usd="5")
        team = (await _json(await s.get(url + "/admin/api/teams/team_ml", headers=_h(ADMIN)), 200))["team"]
        assert team["budget_micros"] == 5_000_000 and team["balance_micros"] == 10_000_000
        # Another team's keys: invisible (404), untouchable, not a place for new keys.
        assert theirs["key_id"] not in [k["key_id"] for k in (await _json(
            await s.get(url + "/admin/api/keys", headers=_h(LEAD)), 200))["data"]]
        for method, path in (("GET", ""), ("PATCH", ""), ("POST", "/revoke"), ("POST", "/rotate"),
                             ("POST", "/block"), ("DELETE", ""), ("POST", "/topup")):
            r = await s.request(method, url + f"/admin/api/keys/{theirs['key_id']}{path}", headers=_h(LEAD),
                                json={"micros": 1} if path == "/topup" else ({"concurrency": 1} if method == "PATCH"
                                                                            else None))
            assert r.status == 404, (method, path, r.status, await r.text())
        await _key(s, url, LEAD, 400, team_id="team_ops")
        await _key(s, url, LEAD, 400)  # a key under no team is not theirs to make
        # What is theirs: keys and users of their team, drawing on the team's purse.
        mine = (await _key(s, url, LEAD, team_id="team_ml"))["key"]
        assert mine["team_id"] == "team_ml" and mine["own_balance"] is False
        user = (await _json(await s.post(url + "/admin/api/users", headers=_h(LEAD), json={
            "name": "ann", "parent_id": "team_ml", "budget_usd": "1", "budget_period": "weekly"}), 201))["user"]
        await _json(await s.post(url + "/admin/api/users", headers=_h(LEAD), json={
            "name": "bob", "parent_id": "team_ops"}), 400)
        await _json(await s.patch(url + f"/admin/api/users/{user['level_id']}", headers=_h(LEAD),
                                  json={"rate_per_min": 10}), 200)
        await _key(s, url, LEAD, user_id=user["level_id"])
        await _json(await s.post(url + f"/admin/api/keys/{mine['key_id']}/block", headers=_h(LEAD)), 200)
        # The other lead cannot see any of it.
        await _json(await s.get(url + f"/admin/api/keys/{mine['key_id']}", headers=_h(OTHER_LEAD)), 404)
        await _json(await s.get(url + f"/admin/api/users/{user['level_id']}", headers=_h(OTHER_LEAD)), 404)
        await _json(await s.get(url + "/admin/api/usage?team_id=team_ml", headers=_h(OTHER_LEAD)), 400)
        await _json(await s.get(url + f"/admin/api/audit?key_id={mine['key_id']}", headers=_h(OTHER_LEAD)), 404)
        # Every change audited with its actor.
        audit = (await _json(await s.get(url + f"/admin/api/audit?key_id={mine['key_id']}", headers=_h(LEAD)),
                             200))["data"]
        assert [(e["actor"], e["action"]) for e in audit] == [("admin:ml-lead", "key.block"),
                                                              ("admin:ml-lead", "key.create")]


async def test_a_viewer_writes_nothing(org_proxy):
    url = org_proxy.url
    async with aiohttp.ClientSession() as s:
        await _org(s, url)
        for method, path, body in (("POST", "/admin/api/teams", {"name": "x"}),
                                   ("PATCH", "/admin/api/teams/team_ml", {"budget_usd": "1"}),
                                   ("POST", "/admin/api/teams/team_ml/topup", {"usd": "1"}),
                                   ("POST", "/admin/api/users", {"name": "x", "parent_id": "team_ml"}),
                                   ("POST", "/admin/api/keys", {"name": "x"})):
            r = await s.request(method, url + path, headers=_h(VIEWER), json=body)
            assert r.status == 403, (path, await r.text())
            assert (await r.json())["error"]["code"] == "insufficient_role"
        assert (await _json(await s.get(url + "/admin/api/teams", headers=_h(VIEWER)), 200))["data"]


async def test_a_rotated_keys_old_secret_works_until_the_grace_ends_and_not_after(org_proxy):
    url = org_proxy.url
    async with aiohttp.ClientSession() as s:
        created = await _key(s, url, balance_usd="1")
        old, key_id = created["secret"], created["key"]["key_id"]
        rotated = await _json(await s.post(url + f"/admin/api/keys/{key_id}/rotate", headers=_h(),
                                           json={"grace": 3}), 200)
        new, grace_until = rotated["secret"], rotated["key"]["grace_until"]
        for secret in (old, new):  # both work during the grace
            r = await s.get(url + "/v1/models", headers={"Authorization": f"Bearer {secret}"})
            assert r.status == 200, await r.text()
        assert time.time() < grace_until
        await asyncio.sleep(grace_until - time.time() + 0.05)  # not a wait for an event: the grace's end
        r = await s.get(url + "/v1/models", headers={"Authorization": f"Bearer {old}"})
        assert r.status == 401
        assert "rotated" in (await r.json())["error"]["message"]
        r = await s.get(url + "/v1/models", headers={"Authorization": f"Bearer {new}"})
        assert r.status == 200
        audit = (await _json(await s.get(url + f"/admin/api/audit?key_id={key_id}", headers=_h()), 200))["data"]
        assert audit[0]["action"] == "key.rotate" and audit[0]["details"]["grace_s"] == 3


async def test_blocks_and_a_teams_models_and_limits_reach_its_keys(org_proxy):
    p, url = org_proxy, org_proxy.url
    async with aiohttp.ClientSession() as s:
        await _org(s, url)
        await _json(await s.patch(url + "/admin/api/teams/team_ml", headers=_h(), json={
            "allowed_models": ["tiny-org/*"], "rate_per_min": 2}), 200)
        created = await _key(s, url, team_id="team_ml")
        client = p.openai(api_key=created["secret"])
        await client.responses.create(model="tiny-org/tiny-model", input="hi", max_output_tokens=8)
        import openai

        with pytest.raises(openai.PermissionDeniedError, match="team"):
            await client.responses.create(model="other/model", input="hi", max_output_tokens=8)
        with pytest.raises(openai.RateLimitError, match="team"):  # the team's 2 a minute: that was the 3rd
            await client.responses.create(model="tiny-org/tiny-model", input="hi", max_output_tokens=8)
        await _json(await s.patch(url + "/admin/api/teams/team_ml", headers=_h(), json={"rate_per_min": None,
                                                                                       "blocked": True}), 200)
        with pytest.raises(openai.PermissionDeniedError, match="blocked"):
            await client.responses.create(model="tiny-org/tiny-model", input="hi", max_output_tokens=8)
        await _json(await s.patch(url + "/admin/api/teams/team_ml", headers=_h(), json={"blocked": False}), 200)
        key_id = created["key"]["key_id"]
        await _json(await s.post(url + f"/admin/api/keys/{key_id}/block", headers=_h()), 200)
        with pytest.raises(openai.PermissionDeniedError, match="blocked"):
            await client.responses.create(model="tiny-org/tiny-model", input="hi", max_output_tokens=8)
        await _json(await s.post(url + f"/admin/api/keys/{key_id}/unblock", headers=_h()), 200)
        await client.responses.create(model="tiny-org/tiny-model", input="hi", max_output_tokens=8)


async def test_the_request_browser_lists_exactly_the_ledgers_rows_of_a_team(org_proxy, tmp_path):
    p, url = org_proxy, org_proxy.url
    async with aiohttp.ClientSession() as s:
        await _org(s, url)
        ml = [await _key(s, url, team_id="team_ml") for _ in range(2)]
        ops = await _key(s, url, team_id="team_ops")
        for created in (*ml, ops, *ml):
            await p.openai(api_key=created["secret"]).responses.create(
                model="tiny-org/tiny-model", input="hi", max_output_tokens=8)
        from middlewares.balance import wait_for_settlements

        await wait_for_settlements(p.app)
        listed = (await _json(await s.get(url + "/admin/api/requests?team_id=team_ml&limit=100", headers=_h()),
                              200))["data"]
        lead = (await _json(await s.get(url + "/admin/api/requests?limit=100", headers=_h(LEAD)), 200))["data"]
        totals = (await _json(await s.get(url + "/admin/api/usage/totals?group_by=team", headers=_h()), 200))["data"]
    with sqlite3.connect(p.ledger.path) as db:
        truth = [r[0] for r in db.execute(
            "SELECT u.request_id FROM usage u JOIN keys k ON k.key_id = u.key_id WHERE k.team_id = 'team_ml'"
            " ORDER BY u.seq DESC")]
        by_team = dict(db.execute("SELECT k.team_id, SUM(u.debited_micros) FROM usage u JOIN keys k"
                                  " ON k.key_id = u.key_id GROUP BY k.team_id"))
    assert len(truth) == 4
    assert [row["request_id"] for row in listed] == truth
    assert [row["request_id"] for row in lead] == truth  # a team admin's default: their team
    assert {row["team_id"] for row in listed} == {"team_ml"}
    assert all(row["transport"] == "http" and 0 < row["latency_ms"] < 60_000 for row in listed)
    assert {t["team"]: t["debited_micros"] for t in totals} == by_team


async def test_a_spent_team_budget_is_a_402_that_names_the_team(org_proxy):
    url = org_proxy.url
    async with aiohttp.ClientSession() as s:
        await _org(s, url)
        await _json(await s.patch(url + "/admin/api/teams/team_ml", headers=_h(), json={"budget_micros": 3}), 200)
        created = await _key(s, url, team_id="team_ml")
        r = await s.post(url + "/v1/responses", headers={"Authorization": f"Bearer {created['secret']}"},
                         json={"model": "tiny-org/tiny-model", "input": "hello", "max_output_tokens": 8})
        body = await r.json()
        assert r.status == 402, body
        assert "team 'ml'" in body["error"]["message"] and "daily budget" in body["error"]["message"]


async def test_a_teams_concurrency_holds_across_replicas_with_redis_and_per_process_in_memory(
        make_proxy, limits_backend):
    """Two proxies on one ledger and one Redis: a team allowed one request at a time refuses the
    second on the other replica (429 naming the team); with the memory backend a replica counts
    its own (the second replica admits, the first refuses)."""
    import asyncio
    import json

    config = {"limits": limits_backend, "auth": {"demo_key": True}}
    first, second = await make_proxy(config), await make_proxy(config)
    team = await first.ledger.create_level("team", {"name": "ml", "balance_micros": 10**9, "concurrency": 1})
    place = {**await first.ledger.placement(team.level_id, None), "own_balance": False}
    secret, _ = await first.ledger.create_key("member", 0, placement=place)
    slow = {"model": "tiny-org/tiny-model", "max_output_tokens": 40, "stream": True,
            "input": "SIM:" + json.dumps({"text": " ".join(["tok"] * 30), "delay": 0.2})}  # 6 s
    quick = {"model": "tiny-org/tiny-model", "max_output_tokens": 8, "input": "hi"}
    async with aiohttp.ClientSession() as s:
        async def ask(proxy, body) -> tuple[int, str]:
            async with s.post(proxy.url + "/v1/responses", json=body,
                              headers={"Authorization": f"Bearer {secret}"}) as r:
                return r.status, await r.text()

        streaming = asyncio.create_task(ask(first, slow))
        await asyncio.sleep(0.5)  # not a wait for an event: the first request is streaming
        same = await ask(first, quick)
        other = await ask(second, quick)
        assert not streaming.done()
        assert (await streaming)[0] == 200
    assert same[0] == 429 and "team" in same[1]
    if limits_backend["backend"] == "redis":
        assert other[0] == 429 and "team" in other[1], other
    else:
        assert other[0] == 200, other


async def test_model_groups_and_wildcards_in_a_keys_and_a_teams_allowed_models(make_proxy):
    import openai

    proxy = await make_proxy({"model_groups": {"small": ["tiny-org/tiny-model"], "none": []},
                              "admin": {"keys": [{"name": "owner", "key": ADMIN}]}})
    async with aiohttp.ClientSession() as s:
        made = await _json(await s.post(proxy.url + "/admin/api/keys", headers=_h(), json={
            "name": "grouped", "balance_usd": "1", "allowed_models": ["group:small", "group:nosuch"]}), 201)
        assert made["warnings"] == ["allowed_models: no model group 'nosuch' in config.yaml's model_groups"]
        await proxy.openai(api_key=made["secret"]).responses.create(model="tiny-org/tiny-model", input="hi",
                                                                    max_output_tokens=8)
        team = (await _json(await s.post(proxy.url + "/admin/api/teams", headers=_h(), json={
            "name": "t", "balance_usd": "1", "allowed_models": ["group:none"]}), 201))["team"]
        member = await _json(await s.post(proxy.url + "/admin/api/keys", headers=_h(), json={
            "name": "m", "team_id": team["level_id"], "allowed_models": ["tiny-org/*"]}), 201)
    with pytest.raises(openai.PermissionDeniedError, match="team"):  # the key's wildcard allows it, its team's group not
        await proxy.openai(api_key=member["secret"]).responses.create(model="tiny-org/tiny-model", input="hi",
                                                                      max_output_tokens=8)
