"""A request that ends in a 502/503/504 (or any refusal) is logged and counted with
outcome "error", never "pending"; the "failover" line is written only when another worker
takes the request over.

Real simulators on loopback, a real proxy, real HTTP between; structlog's capture_logs
reads the log lines the proxy writes.
"""

from __future__ import annotations

from structlog.testing import capture_logs

from tests.runtime.test_metrics import scrape, total
from tests.upstream.test_workers import ask, call, dead_url, settings, start_sim, worker  # noqa: F401
from tests.conftest import only

POISON = 'SIM:{"status": 500}'


def lines(logs: list[dict], event: str) -> list[dict]:
    return [entry for entry in logs if entry.get("event") == event]


async def test_a_502_is_logged_and_counted_as_error(start_sim, make_proxy):
    a = await start_sim()
    proxy = await make_proxy(settings(), workers=[worker("a", a.url)])
    with capture_logs() as logs:
        status, _, _ = await call(proxy, ask(input=POISON))
    assert status == 502
    [access] = [e for e in lines(logs, "request") if e.get("path") == "/v1/responses"]
    assert access["status"] == 502 and access["outcome"] == "error"
    assert lines(logs, "failover") == []  # one worker: nothing to fail over to
    _, samples = await scrape(proxy)
    assert total(samples, "responses_proxy_requests_total", endpoint="responses", status="502", outcome="error") == 1
    assert total(samples, "responses_proxy_requests_total", outcome="pending") == 0


async def test_a_503_is_logged_as_error(start_sim, make_proxy):
    a = await start_sim()
    proxy = await make_proxy(settings(), workers=[worker("a", a.url)])
    with capture_logs() as logs:
        status, _, _ = await call(proxy, ask({"only": ["nobody"]}))
    assert status == 503
    [access] = [e for e in lines(logs, "request") if e.get("path") == "/v1/responses"]
    assert access["outcome"] == "error"


async def test_failover_is_logged_only_when_a_worker_takes_over(start_sim, make_proxy):
    a, b = await start_sim(), await start_sim()
    proxy = await make_proxy(settings(), workers=[worker("a", a.url), worker("b", b.url)])
    with capture_logs() as logs:
        status, _, _ = await call(proxy, ask({"order": ["a", "b"]}, input=POISON))
    assert status == 502  # both failed: one failover (a -> b), none after b
    failovers = lines(logs, "failover")
    assert [(f["worker"], f["to"]) for f in failovers] == [("a", "b")]
    [access] = [e for e in lines(logs, "request") if e.get("path") == "/v1/responses"]
    assert access["outcome"] == "error" and access["upstream"] == "b"


async def test_failover_to_a_live_worker_is_logged_once_and_completes(start_sim, make_proxy):
    live = await start_sim()
    proxy = await make_proxy({**only("stateless"), "health": {"enabled": False}},
                             workers=[worker("dead", dead_url()), worker("live", live.url)])
    with capture_logs() as logs:
        status, _, _ = await call(proxy, ask({"order": ["dead"]}))
    assert status == 200
    assert [(f["worker"], f["to"]) for f in lines(logs, "failover")] == [("dead", "live")]
    [access] = [e for e in lines(logs, "request") if e.get("path") == "/v1/responses"]
    assert access["outcome"] == "completed"
