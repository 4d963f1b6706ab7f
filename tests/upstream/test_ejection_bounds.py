"""Passive ejection is bounded: one request that always fails cannot take a model's whole pool
out (health.outlier.max_ejection_percent, never the last available worker), a model whose
checked-healthy workers are all ejected routes to them anyway (panic routing), and a 503
says in Retry-After when the earliest worker can be back.

Real simulators on loopback, a real proxy, real HTTP between.
"""

from __future__ import annotations

import pytest

from proxy.state import POOL
from tests.upstream.test_workers import ask, call, served_by, settings, start_sim, wait_for, worker  # noqa: F401
from tests.conftest import only

POISON = 'SIM:{"status": 500}'  # the simulator answers this request with a 500, every time
CODEX_ATTEMPTS = 5  # Codex: the request and its default 4 retries


async def test_one_poisoned_request_does_not_eject_the_only_worker(start_sim, make_proxy):
    a = await start_sim()
    proxy = await make_proxy(settings(), workers=[worker("a", a.url)])  # default outlier: 5 in a row
    for _ in range(CODEX_ATTEMPTS + 1):
        status, _, body = await call(proxy, ask(input=POISON))
        assert status == 502 and body["error"]["code"] == "upstream_error", body
    wa = proxy.app[POOL].workers[0]
    assert not wa.ejected and wa.ejections_total == 0
    # Every other client is still served (the outage: 503 for 30 s).
    status, _, body = await call(proxy, ask())
    assert status == 200, body


async def test_max_ejection_percent_caps_the_share_of_a_pool(start_sim, make_proxy):
    sims = [await start_sim() for _ in range(4)]
    proxy = await make_proxy(settings(outlier={"consecutive_failures": 1, "max_ejection_percent": 50}),
                             workers=[worker(f"w{i}", s.url) for i, s in enumerate(sims)])
    for i in range(4):
        status, _, _ = await call(proxy, ask({"only": [f"w{i}"]}, input=POISON))
        assert status == 502
    pool = proxy.app[POOL]
    assert [w.ejected for w in pool.workers] == [True, True, False, False]
    for _ in range(4):
        assert (await call(proxy, ask()))[0] == 200
    served = served_by(*sims)
    assert served[:2] == [1, 1] and sum(served) == 8  # the ejected two take none of them


async def test_the_last_available_worker_is_not_ejected(start_sim, make_proxy):
    # 1 of 2 is within 50%, but the other worker is down by the checks: ejecting would leave none.
    a = await start_sim()
    b = await start_sim()
    proxy = await make_proxy(settings(interval_s=0.05, unhealthy_threshold=1,
                                      outlier={"consecutive_failures": 1, "base_ejection_s": 60}),
                             workers=[worker("a", a.url), worker("b", b.url)])
    wa, wb = proxy.app[POOL].workers
    await b.stop()
    await wait_for(lambda: not wb.healthy)
    for _ in range(3):
        assert (await call(proxy, ask(input=POISON)))[0] == 502
    assert not wa.ejected
    assert (await call(proxy, ask()))[0] == 200


async def test_panic_routing_when_every_healthy_worker_is_ejected(start_sim, make_proxy):
    a = await start_sim()
    b = await start_sim()
    proxy = await make_proxy(settings(interval_s=0.05, unhealthy_threshold=1,
                                      outlier={"consecutive_failures": 1, "base_ejection_s": 60}),
                             workers=[worker("a", a.url), worker("b", b.url)])
    wa, wb = proxy.app[POOL].workers
    assert (await call(proxy, ask({"only": ["a"]}, input=POISON)))[0] == 502
    assert wa.ejected  # 1 of 2: within the default 50%
    # b goes down: a, still ejected for a minute but passing its checks, takes the traffic.
    await b.stop()
    await wait_for(lambda: not wb.healthy)
    before = len(a.requests)
    for _ in range(3):
        status, _, body = await call(proxy, ask())
        assert status == 200, body
    assert len(a.requests) == before + 3 and wa.ejected


async def test_retry_after_is_the_time_until_the_earliest_worker_can_return(start_sim, make_proxy):
    a = await start_sim()
    b = await start_sim()
    proxy = await make_proxy(settings(interval_s=5, outlier={"consecutive_failures": 1, "base_ejection_s": 20}),
                             workers=[worker("a", a.url), worker("b", b.url)])
    assert (await call(proxy, ask({"only": ["a"]}, input=POISON)))[0] == 502
    assert proxy.app[POOL].workers[0].ejected
    status, headers, body = await call(proxy, ask({"only": ["a"]}))
    assert status == 503 and body["error"]["code"] == "no_worker_available"
    # Back at the first check after its 20 s ejection (checks every 5 s): ~20 s, not 1.
    assert 15 <= int(headers["Retry-After"]) <= 25


async def test_retry_after_without_active_checks_is_the_ejection_left(start_sim, make_proxy):
    a = await start_sim()
    b = await start_sim()
    proxy = await make_proxy({**only("stateless"), "health": {
        "enabled": False, "outlier": {"consecutive_failures": 1, "base_ejection_s": 40}}},
        workers=[worker("a", a.url), worker("b", b.url)])
    assert (await call(proxy, ask({"only": ["a"]}, input=POISON)))[0] == 502
    status, headers, _ = await call(proxy, ask({"only": ["a"]}))
    assert status == 503 and 30 <= int(headers["Retry-After"]) <= 40


def test_bad_max_ejection_percent_stops_start_up():
    from proxy.app import build_app
    from proxy.config.load import Config, ConfigError

    for bad in (-1, 101, "half"):
        with pytest.raises(ConfigError):
            build_app(Config.from_dict({**only("stateless"), "ledger": {"backend": "none"},
                                        "health": {"outlier": {"max_ejection_percent": bad}}}))
    with pytest.raises(ConfigError):
        build_app(Config.from_dict({**only("stateless"), "ledger": {"backend": "none"},
                                    "health": {"outlier": {"max_ejection_pct": 50}}}))

