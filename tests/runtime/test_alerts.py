"""Alerts (proxy/runtime/alerts.py): the rules' book with a clock of the test's, and the whole path
against a real HTTP receiver on loopback: a key's budget crossing 80% is told exactly once, signed;
a worker ejected is told, and again when it is back."""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import pytest
from aiohttp import web

from proxy.ledger import KeyLimits, UsageRecord
from proxy.runtime.alerts import ALERTS, AlertBook, Condition, signature
from proxy.state import POOL
from tests.conftest import eventually


def test_a_condition_is_told_once_then_reminded_only_after_the_interval_and_resolved():
    book = AlertBook(reminder_s=60)
    ejected = Condition("worker_ejected:a", "worker_ejected", "worker a is ejected")
    assert [n.state for n in book.update([ejected], 0)] == ["firing"]
    assert book.update([ejected], 1) == [] and book.update([ejected], 59.9) == []
    assert [n.state for n in book.update([ejected], 60)] == ["reminder"]
    assert book.update([ejected], 100) == []
    assert [(n.state, n.condition.key) for n in book.update([], 101)] == [("resolved", "worker_ejected:a")]
    assert book.update([], 500) == []  # told once
    budget = Condition("budget:k:daily:2026-12-05:0.8", "budget", "80%")
    assert [n.state for n in book.update([budget], 0)] == ["firing"]
    # the next day's crossing is another alert; the last one ends silently with its period
    tomorrow = Condition("budget:k:daily:2026-12-06:0.8", "budget", "80%")
    assert [(n.state, n.condition.key) for n in book.update([tomorrow], 86400)] == [("firing", tomorrow.key)]


@pytest.fixture
async def receiver():
    got: list[dict] = []
    failing = [0]  # answers 503 to this many first requests

    async def hook(request: web.Request) -> web.Response:
        body = await request.read()
        if failing[0] > 0:
            failing[0] -= 1
            return web.json_response({"busy": True}, status=503)
        got.append({"body": body, "headers": dict(request.headers)})
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/hook", got, failing
    finally:
        await runner.cleanup()


SECRET = "alert-signing-secret"


async def test_a_budget_crossing_is_one_signed_webhook_and_a_worker_ejected_and_back(make_proxy, receiver):
    url, got, _ = receiver
    proxy = await make_proxy({"alerts": {"webhooks": [{"name": "ops", "url": url, "secret": SECRET}],
                                         "check_interval_s": 0.1, "reminder_s": 3600},
                              "health": {"outlier": {"consecutive_failures": 2, "base_ejection_s": 0.5,
                                                     "max_ejection_percent": 100}}})
    alerts = proxy.app[ALERTS]
    _, record = await proxy.ledger.create_key("spender", 1_000_000, limits=KeyLimits(daily_budget_micros=1_000))
    await proxy.ledger.hold("req_spend", record.key_id, 850, 60)
    await proxy.ledger.settle("req_spend", UsageRecord("req_spend", record.key_id, "tiny-org/tiny-model", 10, 0, 5, 0,
                                                       850, "completed"))
    await eventually(lambda: any(json.loads(g["body"])["kind"] == "budget" for g in got), 30, what="the budget alert")
    checks = alerts.checks
    await eventually(lambda: alerts.checks >= checks + 5, 30, what="five more checks")
    budget = [g for g in got if json.loads(g["body"])["kind"] == "budget"]
    assert len(budget) == 1  # one alert per crossing, not one per check
    notice = json.loads(budget[0]["body"])
    assert notice["state"] == "firing" and notice["details"]["threshold"] == 0.8
    assert notice["details"]["spent_micros"] == 850 and notice["details"]["key_id"] == record.key_id
    stamp = budget[0]["headers"]["X-Responses-Proxy-Timestamp"]
    expected = "sha256=" + hmac.new(SECRET.encode(), stamp.encode() + b"." + budget[0]["body"],
                                    hashlib.sha256).hexdigest()
    assert budget[0]["headers"]["X-Responses-Proxy-Signature"] == expected == signature(SECRET, stamp,
                                                                                         budget[0]["body"])
    assert abs(int(stamp) - time.time()) < 300

    pool = proxy.app[POOL]
    worker = pool.workers[0]
    for _ in range(2):  # what failed requests record: two in a row eject it
        pool.record_failure(worker, "connect timeout")
    assert worker.ejected

    def states(kind: str) -> list[str]:
        return [json.loads(g["body"])["state"] for g in got if json.loads(g["body"])["kind"] == kind]

    await eventually(lambda: "firing" in states("worker_ejected"), 30, what="the ejection alert")
    await eventually(lambda: (pool.readmit_due(), not worker.ejected)[1], 30, what="the worker re-admitted")
    await eventually(lambda: "resolved" in states("worker_ejected"), 30, what="the worker-back alert")
    assert states("worker_ejected") == ["firing", "resolved"]
    assert alerts.sent["ops"] == len(got) and not alerts.failed


async def test_a_teams_budget_crossing_is_one_webhook_with_the_team(make_proxy, receiver):
    url, got, _ = receiver
    proxy = await make_proxy({"alerts": {"webhooks": [{"name": "ops", "url": url, "secret": SECRET}],
                                         "check_interval_s": 0.1, "reminder_s": 3600}})
    alerts = proxy.app[ALERTS]
    team = await proxy.ledger.create_level("team", {"name": "ml", "balance_micros": 10_000, "budget_micros": 1_000,
                                                    "budget_period": "weekly"})
    place = {**await proxy.ledger.placement(team.level_id, None), "own_balance": False}
    _, record = await proxy.ledger.create_key("member", 0, placement=place)
    await proxy.ledger.hold("req_team", record.key_id, 900, 60)
    await proxy.ledger.settle("req_team", UsageRecord("req_team", record.key_id, "tiny-org/tiny-model", 10, 0, 5, 0,
                                                      900, "completed"))
    await eventually(lambda: any(json.loads(g["body"])["kind"] == "budget" for g in got), 30, what="the team's alert")
    checks = alerts.checks
    await eventually(lambda: alerts.checks >= checks + 5, 30, what="five more checks")
    budget = [json.loads(g["body"]) for g in got if json.loads(g["body"])["kind"] == "budget"]
    assert len(budget) == 1
    assert budget[0]["details"]["team_id"] == team.level_id and budget[0]["details"]["threshold"] == 0.8
    assert "team ml" in budget[0]["summary"] and "weekly" in budget[0]["summary"]


async def test_a_failed_delivery_is_retried_with_backoff_and_counted_when_it_never_lands(make_proxy, receiver):
    url, got, failing = receiver
    proxy = await make_proxy({"alerts": {"webhooks": [{"name": "ops", "url": url, "format": "slack"},
                                                      {"name": "gone", "url": "http://127.0.0.1:9/hook"}],
                                         "check_interval_s": 3600, "retries": 3, "backoff_s": 0.05}})
    alerts = proxy.app[ALERTS]
    failing[0] = 2  # the receiver is busy twice, then takes it
    alerts.enqueue(alerts.book.update([Condition("no_worker:m", "no_worker", "no worker serves m")], time.time()))
    await eventually(lambda: alerts.sent.get("ops") == 1 and alerts.failed.get("gone") == 1, 30,
                     what="one delivered after two retries, one given up")
    assert len(got) == 1 and json.loads(got[0]["body"]) == {"text": ":rotating_light: responses-proxy firing: "
                                                                    "no worker serves m"}
    assert "X-Responses-Proxy-Signature" not in got[0]["headers"]  # no secret: unsigned


async def test_a_postgres_stop_sends_the_fault_and_its_end(make_proxy, receiver, pg_server, pg_dsn, tmp_path):
    import asyncio

    url, got, _ = receiver
    await make_proxy({"ledger": {"backend": "postgres", "dsn": pg_dsn, "spool_path": str(tmp_path / "spool.jsonl"),
                                 "connect_timeout_s": 1, "statement_timeout_ms": 2000},
                      "alerts": {"webhooks": [{"name": "ops", "url": url}], "check_interval_s": 0.1,
                                 "reminder_s": 3600}})

    def states() -> list[str]:
        return [json.loads(g["body"])["state"] for g in got if json.loads(g["body"])["kind"] == "ledger_fault"]

    await asyncio.to_thread(pg_server.stop)
    try:
        await eventually(lambda: "firing" in states(), 60, what="the ledger's fault told")
        fault = next(json.loads(g["body"]) for g in got if json.loads(g["body"])["kind"] == "ledger_fault")
        assert fault["severity"] == "critical" and fault["details"]["cause"] == "unreachable"
    finally:
        await asyncio.to_thread(pg_server.start)
    await eventually(lambda: "resolved" in states(), 60, what="the ledger's fault's end told")
    assert states() == ["firing", "resolved"]
