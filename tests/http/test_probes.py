"""The probes orchestrators expect: liveness with no dependency (/livez, /healthz), readiness
that checks what traffic needs (/readyz: a worker that takes requests, a ledger that answers),
and neither telling an unauthenticated caller which workers exist, where, or why they fail."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from proxy.state import POOL
from proxy.upstream import health
from proxy.upstream.health import READINESS
from tests.conftest import eventually as wait_for, free_port, only

FAST = {"connect": 1, "first_byte": 5, "idle": 5, "total": 30}


def dead_worker(name: str) -> dict:
    return {"name": name, "url": f"http://127.0.0.1:{free_port()}", "dialect": "vllm", "models": ["tiny-org/tiny-model"],
            "timeouts": FAST}


async def get(proxy, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, proxy.url + path) as r:
            return r.status, r.headers.copy(), await r.read()


@pytest.mark.parametrize("path", ["/livez", "/healthz"])
async def test_liveness_depends_on_nothing_and_tells_nothing(make_proxy, path):
    proxy = await make_proxy({"health": {"interval_s": 0.05, "unhealthy_threshold": 1}},
                             workers=[dead_worker("secret-gpu")])
    await wait_for(lambda: not any(w.available for w in proxy.app[POOL].workers))
    status, headers, raw = await get(proxy, path)
    assert status == 200 and orjson.loads(raw) == {"status": "ok"}
    assert headers["Cache-Control"] == "no-store"
    assert (await get(proxy, path, "HEAD"))[0] == 200


async def test_ready_while_a_worker_takes_traffic_and_the_ledger_answers(sim, make_proxy):
    proxy = await make_proxy()
    status, headers, raw = await get(proxy, "/readyz")
    assert status == 200 and orjson.loads(raw) == {"status": "ready"}
    assert headers["Cache-Control"] == "no-store"


async def test_not_ready_without_a_worker_and_no_addresses_or_errors_told(make_proxy):
    workers = [dead_worker("secret-gpu-a"), dead_worker("secret-gpu-b")]
    proxy = await make_proxy({"health": {"interval_s": 0.05, "unhealthy_threshold": 1}}, workers=workers)
    await wait_for(lambda: not any(w.available for w in proxy.app[POOL].workers))
    status, _, raw = await get(proxy, "/readyz")
    assert status == 503 and orjson.loads(raw) == {"status": "not_ready", "reason": "no_worker"}
    for path in ("/readyz", "/livez", "/healthz"):
        text = (await get(proxy, path))[2].decode()
        for w in workers:
            assert w["name"] not in text and w["url"].split("//")[1] not in text
        assert "Error" not in text and "refused" not in text.lower()
    # The operator's view keeps the details: /metrics (off the public edge) and the log.
    metrics = (await get(proxy, "/metrics"))[2].decode()
    assert 'responses_proxy_worker_healthy{worker="secret-gpu-a"} 0.0' in metrics


async def test_not_ready_when_the_ledger_does_not_answer(sim, make_proxy, monkeypatch):
    proxy = await make_proxy()
    monkeypatch.setattr(health, "LEDGER_TIMEOUT_S", 0.05)
    monkeypatch.setattr(health, "LEDGER_TTL_S", 0.0)
    ledger = proxy.ledger
    real = ledger.get_key

    async def hangs(key_id):
        await asyncio.sleep(30)

    async def breaks(key_id):
        raise RuntimeError("database disk image is malformed")

    for broken in (hangs, breaks):
        monkeypatch.setattr(ledger, "get_key", broken)
        status, _, raw = await get(proxy, "/readyz")
        assert status == 503 and orjson.loads(raw) == {"status": "not_ready", "reason": "ledger", "cause": "unreachable"}
    monkeypatch.setattr(ledger, "get_key", real)  # answers again: ready at the next check
    status, _, raw = await get(proxy, "/readyz")
    assert status == 200, raw


async def test_a_flood_of_readiness_probes_costs_one_ledger_read(sim, make_proxy, monkeypatch):
    proxy = await make_proxy()
    ledger = proxy.ledger
    real = ledger.get_key
    calls = 0

    async def counted(key_id):
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.1)  # every probe below arrives while this read is in flight
        return await real(key_id)

    monkeypatch.setattr(ledger, "get_key", counted)
    monkeypatch.setattr(health, "LEDGER_TTL_S", 3600.0)
    proxy.app[READINESS]._checked_at = float("-inf")
    async with aiohttp.ClientSession() as http:
        async def probe() -> int:
            async with http.get(proxy.url + "/readyz") as r:
                return r.status

        statuses = await asyncio.gather(*(probe() for _ in range(50)))
        assert set(statuses) == {200}
        assert calls == 1
        statuses = await asyncio.gather(*(probe() for _ in range(50)))  # within the TTL: the same verdict
    assert set(statuses) == {200} and calls == 1


async def test_readiness_without_a_ledger(sim, make_proxy):
    proxy = await make_proxy({"ledger": {"backend": "none"}, **only("stateless")})
    status, _, raw = await get(proxy, "/readyz")
    assert status == 200 and orjson.loads(raw) == {"status": "ready"}


async def test_readiness_names_a_database_that_refuses_more_connections(sim, make_proxy, monkeypatch):
    """The README's causes, too_many_connections among them: what the PostgreSQL ledger's
    failure classification makes of the driver's error reaches /readyz as that word."""
    from asyncpg import exceptions as pg

    from proxy.ledger.postgres.errors import classify
    from proxy.ledger.postgres.faults import PgFaults

    failure = classify(pg.TooManyConnectionsError("sorry, too many clients already"))
    faults = PgFaults.__new__(PgFaults)
    faults.stats, faults.retry_after_s = {"unavailable": 0}, 1.0
    refused = faults._failed(failure, pg.TooManyConnectionsError("sorry, too many clients already"))
    proxy = await make_proxy()
    monkeypatch.setattr(health, "LEDGER_TTL_S", 0.0)

    async def crowded(key_id):
        raise refused

    monkeypatch.setattr(proxy.ledger, "get_key", crowded)
    status, _, raw = await get(proxy, "/readyz")
    assert status == 503 and orjson.loads(raw) == {"status": "not_ready", "reason": "ledger",
                                                   "cause": "too_many_connections"}
