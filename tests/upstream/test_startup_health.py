"""A worker down at start-up takes no traffic until an active check passes, even with its
`dialect` and `models` written in config (nothing left to discover), and the 503 it leaves
says, in Retry-After, when the next check can let it in.

Real simulators on loopback, a real proxy, real HTTP between.
"""

from __future__ import annotations

from proxy.state import POOL
from tests.conftest import free_port, only
from tests.upstream.test_workers import ask, call, settings, start_sim, wait_for, worker  # noqa: F401


async def test_a_worker_down_at_start_up_gets_no_request(start_sim, make_proxy):
    port = free_port()  # nothing listens
    live = await start_sim()
    proxy = await make_proxy(settings(interval_s=60),
                             workers=[worker("late", f"http://127.0.0.1:{port}"), worker("live", live.url)])
    pool = proxy.app[POOL]
    late = pool.workers[0]
    assert not late.available
    # Its order asks for it first: it is skipped, not tried and failed over.
    for _ in range(3):
        status, _, body = await call(proxy, ask({"order": ["late"]}))
        assert status == 200, body
    assert len(live.requests) == 3
    assert pool.failovers == {} and late.consecutive_failures == 0


async def test_a_worker_down_at_start_up_comes_in_at_its_first_passing_check(start_sim, make_proxy):
    port = free_port()
    proxy = await make_proxy(settings(interval_s=0.05), workers=[worker("late", f"http://127.0.0.1:{port}")])
    late = proxy.app[POOL].workers[0]
    status, headers, body = await call(proxy, ask())
    assert status == 503 and body["error"]["code"] == "no_worker_available"
    assert headers["Retry-After"] == "1"  # a check every 50 ms
    sim = await start_sim(port=port)
    await wait_for(lambda: late.available)
    status, _, body = await call(proxy, ask())
    assert status == 200, body
    assert len(sim.requests) == 1


async def test_the_only_worker_down_at_start_up_is_503_with_the_time_to_the_next_check(make_proxy):
    port = free_port()
    proxy = await make_proxy(settings(interval_s=30), workers=[worker("down", f"http://127.0.0.1:{port}")])
    status, headers, body = await call(proxy, ask())
    assert status == 503, body  # not 502 after a refused connection
    assert body["error"]["code"] == "no_worker_available"
    assert 20 <= int(headers["Retry-After"]) <= 30
    assert proxy.app[POOL].workers[0].consecutive_failures == 0


async def test_a_worker_up_at_start_up_takes_the_first_request(start_sim, make_proxy):
    # The first check runs at start-up, not interval_s later; one pass is enough even when
    # healthy_threshold asks for more (that is for coming back after being unhealthy).
    a = await start_sim()
    proxy = await make_proxy(settings(interval_s=60, healthy_threshold=3), workers=[worker("a", a.url)])
    status, _, body = await call(proxy, ask())
    assert status == 200, body
    assert proxy.app[POOL].workers[0].healthy


async def test_without_active_checks_nothing_is_held_back(start_sim, make_proxy):
    # No checks would ever let a worker in: with health.enabled false every worker takes traffic.
    a = await start_sim()
    proxy = await make_proxy({**only("stateless"), "health": {"enabled": False}}, workers=[worker("a", a.url)])
    status, _, body = await call(proxy, ask())
    assert status == 200, body
