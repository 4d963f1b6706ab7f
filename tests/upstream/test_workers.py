"""Workers: routing by the provider object, health (active + passive), failover, timeouts,
discovery, /v1/models, input_tokens, the context-window check.

Real simulators on loopback (two or three per test), a real proxy, real HTTP between.
"""

from __future__ import annotations


import asyncio
import socket
import time
from types import SimpleNamespace

import aiohttp
import orjson
import pytest

from proxy.state import POOL
from proxy.config import settings as config_settings
from proxy.upstream.routing import check_context_window, parse_provider
from proxy.protocol.translate import translate_request
from proxy.simulator.server import Simulator
from tests.conftest import free_port, only
from tests.support.sdk_check import parse_sse
from tests.conftest import eventually as wait_for

NO_AUTH = only("stateless")
FAST = {"connect": 2, "first_byte": 10, "idle": 10, "total": 60}


def worker(name: str, url: str, models=("tiny-org/tiny-model",), **extra) -> dict:
    entry = {"name": name, "url": url, "dialect": extra.pop("dialect", "vllm"), "timeouts": dict(FAST)}
    if models is not None:
        entry["models"] = list(models)
    entry["timeouts"].update(extra.pop("timeouts", {}))
    entry.update(extra)
    return entry


def settings(**health) -> dict:
    return {**NO_AUTH, "health": {"enabled": True, "interval_s": 60, **health}}


@pytest.fixture
async def start_sim():
    started: list[Simulator] = []

    async def start(**kw) -> Simulator:
        sim = Simulator(**kw)
        await sim.start()
        started.append(sim)
        return sim

    yield start
    for sim in started:
        await sim.stop()


async def call(proxy, body: dict, path: str = "/v1/responses"):
    """(status, headers, JSON body or the list of SSE events)."""
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + path, json=body) as resp:
            raw = await resp.read()
            if resp.status == 200 and resp.content_type == "text/event-stream":
                return resp.status, resp.headers, parse_sse(raw)
            return resp.status, resp.headers, orjson.loads(raw)


def ask(provider=None, **extra) -> dict:
    body = {"model": "tiny-org/tiny-model", "input": extra.pop("input", "hello")}
    if provider is not None:
        body["provider"] = provider
    body.update(extra)
    return body


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused


def blackhole() -> tuple[str, list[socket.socket]]:
    """A port whose accept queue is full: connecting hangs until the connect timeout."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    socks = [server]
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        socks.append(c)
    return f"http://127.0.0.1:{port}", socks


def served_by(*sims: Simulator) -> list[int]:
    return [len(s.requests) for s in sims]


# --------------------------------------------------------------------------- provider routing


async def two(start_sim, make_proxy, a_labels=None, b_labels=None, **overrides):
    a, b = await start_sim(), await start_sim()
    proxy = await make_proxy({**NO_AUTH, **overrides}, workers=[
        worker("a", a.url, labels=a_labels or {}), worker("b", b.url, labels=b_labels or {})])
    return a, b, proxy


async def test_only_and_ignore_pick_by_name(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy)
    for _ in range(3):
        assert (await call(proxy, ask({"only": ["b"]})))[0] == 200
    assert served_by(a, b) == [0, 3]
    for _ in range(3):
        assert (await call(proxy, ask({"ignore": ["B"]})))[0] == 200  # names are case-insensitive
    assert served_by(a, b) == [3, 3]


async def test_order_is_tried_in_order_and_matches_labels(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy, a_labels={"region": "us"}, b_labels={"region": "eu"})
    for _ in range(3):
        assert (await call(proxy, ask({"order": ["region=eu", "a"]})))[0] == 200
    assert served_by(a, b) == [0, 3]
    for _ in range(2):
        assert (await call(proxy, ask({"order": ["us"]})))[0] == 200  # a bare label value matches too
    assert served_by(a, b) == [2, 3]


async def test_order_falls_back_unless_fallbacks_are_off(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy)
    assert (await call(proxy, ask({"order": ["nobody"]})))[0] == 200
    status, _, body = await call(proxy, ask({"order": ["nobody"], "allow_fallbacks": False}))
    assert status == 503
    assert "provider.order=['nobody'] with allow_fallbacks=false" in body["error"]["message"]
    assert body["error"]["param"] == "provider"


async def test_quantizations(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy, a_labels={"quantization": "fp8"},
                            b_labels={"quantization": "bf16"})
    for _ in range(3):
        assert (await call(proxy, ask({"quantizations": ["FP8"]})))[0] == 200
    assert served_by(a, b) == [3, 0]
    status, _, body = await call(proxy, ask({"quantizations": ["int4"]}))
    assert status == 503 and "provider.quantizations=['int4']" in body["error"]["message"]
    assert body["error"]["code"] == "provider_requirements_unmet"


async def test_max_price_and_sort_price(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy, a_labels={"price_prompt": 1.0, "price_completion": 3.0},
                            b_labels={"price_prompt": 0.2, "price_completion": 0.6})
    for _ in range(3):
        assert (await call(proxy, ask({"max_price": {"prompt": 0.5}})))[0] == 200
    assert served_by(a, b) == [0, 3]
    for _ in range(3):
        assert (await call(proxy, ask({"sort": "price"})))[0] == 200
    assert served_by(a, b) == [0, 6]
    status, _, body = await call(proxy, ask({"max_price": {"prompt": 0.1, "completion": 1}}))
    assert status == 503 and "provider.max_price" in body["error"]["message"]


async def test_data_collection_and_zdr(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy, a_labels={"data_collection": "allow"},
                            b_labels={"data_collection": "deny", "zdr": True})
    for provider in ({"data_collection": "deny"}, {"zdr": True}, {"data_collection": "deny", "zdr": True}):
        assert (await call(proxy, ask(provider)))[0] == 200
    assert served_by(a, b) == [0, 3]
    status, _, body = await call(proxy, ask({"zdr": True, "only": ["a"]}))
    assert status == 503 and "provider.zdr=true" in body["error"]["message"]


async def test_require_parameters_and_labels(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy, a_labels={"supports": ["json_schema"], "tier": "gold"},
                            b_labels={"supports": "tools,json_schema", "tier": "silver"})
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    for _ in range(3):
        assert (await call(proxy, ask({"require_parameters": True}, tools=[tool])))[0] == 200
    assert served_by(a, b) == [0, 3]
    # Without require_parameters, tools do not restrict the choice.
    for _ in range(2):
        assert (await call(proxy, ask({"labels": {"tier": "gold"}}, tools=[tool])))[0] == 200
    assert served_by(a, b) == [2, 3]
    status, _, body = await call(proxy, ask({"require_parameters": True, "only": ["a"]}, tools=[tool]))
    assert status == 503 and "provider.require_parameters=true (the request uses tools)" in body["error"]["message"]
    status, _, body = await call(proxy, ask({"labels": {"tier": ["bronze", "iron"]}}))
    assert status == 503 and "provider.labels" in body["error"]["message"]


async def test_sort_latency_prefers_the_fastest_first_byte(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy)
    a.script({"text": "slow", "first_byte_delay": 0.3})
    assert (await call(proxy, ask({"only": ["a"]}, stream=True)))[0] == 200
    assert (await call(proxy, ask({"only": ["b"]}, stream=True)))[0] == 200
    for _ in range(4):
        assert (await call(proxy, ask({"sort": "latency"})))[0] == 200
    assert served_by(a, b) == [1, 5]


async def test_least_loaded_worker_is_chosen(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy)
    a.script({"text": "busy", "first_byte_delay": 1.5})
    busy = asyncio.create_task(call(proxy, ask({"only": ["a"]}, stream=True)))
    await wait_for(lambda: a.in_flight == 1)
    for _ in range(4):
        assert (await call(proxy, ask()))[0] == 200
    assert served_by(a, b) == [1, 4]
    assert (await busy)[0] == 200


async def test_capacity_429_with_retry_after(start_sim, make_proxy):
    a = await start_sim()
    proxy = await make_proxy(NO_AUTH, workers=[worker("a", a.url, capacity=1)])
    a.script({"text": "busy", "first_byte_delay": 1.0})
    busy = asyncio.create_task(call(proxy, ask(stream=True)))
    await wait_for(lambda: a.in_flight == 1)
    status, headers, body = await call(proxy, ask())
    assert status == 429 and headers.get("Retry-After") == "1"
    assert body["error"]["code"] == "capacity_exhausted"
    assert (await busy)[0] == 200
    assert (await call(proxy, ask()))[0] == 200  # the slot came back


@pytest.mark.parametrize("provider", [
    "fast", ["a"], {"order": "a"}, {"only": [1]}, {"sort": "cheapest"}, {"allow_fallbacks": "no"},
    {"max_price": {"prompt": -1}}, {"max_price": {"image": 1}}, {"data_collection": "maybe"},
    {"labels": {"region": {"x": 1}}}, {"quantisation": ["fp8"]},
])
async def test_bad_provider_is_400(make_proxy, provider):
    proxy = await make_proxy(NO_AUTH)
    status, _, body = await call(proxy, ask(provider))
    assert status == 400 and body["error"]["param"] == "provider", body


async def test_unknown_model_404(make_proxy):
    proxy = await make_proxy(NO_AUTH)
    status, _, body = await call(proxy, {"model": "no-such-model", "input": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_parse_provider_reads_every_field():
    prefs = parse_provider({"order": ["a"], "only": ["a", "b"], "ignore": ["c"], "quantizations": ["fp8"],
                            "allow_fallbacks": False, "sort": "throughput", "max_price": {"prompt": 1},
                            "data_collection": "deny", "zdr": True, "require_parameters": True,
                            "labels": {"region": ["eu", "us"]}})
    assert (prefs.order, prefs.only, prefs.ignore, prefs.quantizations) == (["a"], ["a", "b"], ["c"], ["fp8"])
    assert prefs.allow_fallbacks is False and prefs.sort == "load" and prefs.max_price == {"prompt": 1.0}
    assert prefs.data_collection == "deny" and prefs.zdr is True and prefs.require_parameters is True
    assert prefs.labels == {"region": ["eu", "us"]} and not prefs.single_attempt
    assert parse_provider(None) is None


# --------------------------------------------------------------------------- health


async def test_passive_ejection_and_readmission_after_an_active_check(start_sim, make_proxy):
    a, b = await start_sim(), await start_sim()
    port = a.port
    proxy = await make_proxy(settings(interval_s=0.05, outlier={"consecutive_failures": 2, "base_ejection_s": 0.3,
                                                                "max_ejection_s": 5}),
                             workers=[worker("a", a.url), worker("b", b.url)])
    pool = proxy.app[POOL]
    wa = pool.workers[0]
    a.script({"status": 500}, {"status": 500})
    for _ in range(2):
        status, _, _ = await call(proxy, ask({"only": ["a"]}))
        assert status == 502
    assert wa.ejected and wa.ejections_total == 1
    status, _, body = await call(proxy, ask({"only": ["a"]}))
    assert status == 503 and body["error"]["code"] == "no_worker_available"
    for _ in range(3):  # the rest of the traffic goes to b
        assert (await call(proxy, ask()))[0] == 200
    assert served_by(a, b) == [2, 3]
    # The worker goes down: the ejection time passes, but no check passes -> still out.
    await a.stop()
    await asyncio.sleep(0.5)  # not a wait: the ejection time passes (nothing is to happen)
    assert wa.ejected and not wa.available
    # Back up on the same port: the next passing check re-admits it.
    a2 = await start_sim(port=port)
    await wait_for(lambda: not wa.ejected)
    assert (await call(proxy, ask({"only": ["a"]})))[0] == 200
    assert len(a2.requests) == 1


async def test_repeated_ejections_grow(start_sim, make_proxy):
    a = await start_sim()
    # A lone worker is ejected only when max_ejection_percent allows all of a model's workers out.
    proxy = await make_proxy(settings(interval_s=0.05, outlier={"consecutive_failures": 1, "base_ejection_s": 0.2,
                                                                "max_ejection_s": 10, "max_ejection_percent": 100}),
                             workers=[worker("a", a.url)])
    wa = proxy.app[POOL].workers[0]
    durations = []
    for _ in range(3):
        a.script({"status": 503})
        assert (await call(proxy, ask()))[0] == 502
        durations.append(wa.ejected_until - wa.last_ejected_at)
        await wait_for(lambda: not wa.ejected)
    assert durations == pytest.approx([0.2, 0.4, 0.8])


async def test_active_checks_mark_unhealthy_and_healthy(start_sim, make_proxy):
    a = await start_sim()
    port = a.port
    proxy = await make_proxy(settings(interval_s=0.05, unhealthy_threshold=2), workers=[worker("a", a.url)])
    wa = proxy.app[POOL].workers[0]
    async with aiohttp.ClientSession() as http:
        assert (await http.get(proxy.url + "/readyz")).status == 200
        await a.stop()
        await wait_for(lambda: not wa.healthy)
        resp = await http.get(proxy.url + "/readyz")
        assert resp.status == 503 and (await resp.json())["reason"] == "no_worker"
        status, headers, _ = await call(proxy, ask())
        assert status == 503 and headers.get("Retry-After")
        await start_sim(port=port)
        await wait_for(lambda: wa.healthy)
        assert (await http.get(proxy.url + "/readyz")).status == 200


async def test_readyz_503_when_every_worker_is_down(make_proxy):
    proxy = await make_proxy(settings(interval_s=0.05, unhealthy_threshold=1),
                             workers=[worker("x", dead_url()), worker("y", dead_url())])
    async with aiohttp.ClientSession() as http:
        resp = await http.get(proxy.url + "/readyz")
        body = await resp.json()
    assert resp.status == 503 and body == {"status": "not_ready", "reason": "no_worker"}
    assert not any(w.healthy for w in proxy.app[POOL].workers)


async def test_sglang_is_checked_without_its_health_endpoint(make_proxy):
    seen: dict[str, list[str]] = {"sglang": [], "vllm": []}

    def spy(paths: list[str]):
        @aiohttp.web.middleware
        async def record(request, handler):
            paths.append(request.path)
            return await handler(request)
        return record

    s, v = Simulator(dialect="sglang"), Simulator(dialect="vllm")
    for sim in (s, v):
        sim.app.middlewares.append(spy(seen[sim.state.dialect]))
        await sim.start()
    try:
        proxy = await make_proxy(settings(interval_s=0.05), workers=[worker("s", s.url, dialect="sglang"),
                                                                      worker("v", v.url, dialect="vllm")])
        await wait_for(lambda: seen["vllm"].count("/health") >= 2 and seen["sglang"].count("/v1/models") >= 3)
        assert all(w.healthy for w in proxy.app[POOL].workers)
    finally:
        await s.stop()
        await v.stop()
    assert "/health" not in seen["sglang"] and "/health_generate" not in seen["sglang"]


# --------------------------------------------------------------------------- failover


async def test_failover_before_first_byte_dead_worker(start_sim, make_proxy):
    live = await start_sim()
    proxy = await make_proxy({**NO_AUTH, "health": {"enabled": False}},
                             workers=[worker("dead", dead_url()), worker("live", live.url)])
    for i in range(6):
        status, _, body = await call(proxy, ask({"order": ["dead"]}, stream=bool(i % 2)))
        assert status == 200, body
    assert len(live.requests) == 6
    pool = proxy.app[POOL]
    assert sum(n for (w, _), n in pool.failovers.items() if w == "dead") >= 1


async def test_failover_on_reset_before_headers(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy)
    a.script({"reset_before_headers": True})
    status, _, events = await call(proxy, ask({"order": ["a", "b"]}, stream=True))
    assert status == 200 and events[-1]["type"] == "response.completed"
    assert served_by(a, b) == [1, 1]
    assert proxy.app[POOL].failovers


async def test_failover_is_bounded(start_sim, make_proxy):
    sims = [await start_sim() for _ in range(3)]
    for s in sims:
        s.script({"status": 500})
    proxy = await make_proxy({**NO_AUTH, "routing": {"max_attempts": 2}},
                             workers=[worker(f"w{i}", s.url) for i, s in enumerate(sims)])
    status, _, body = await call(proxy, ask())
    assert status == 502 and body["error"]["code"] == "upstream_error"
    assert sum(len(s.requests) for s in sims) == 2


async def test_no_fallbacks_means_one_attempt(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy)
    a.script({"status": 500})
    b.script({"status": 500})
    status, _, _ = await call(proxy, ask({"allow_fallbacks": False}))
    assert status == 502 and sum(served_by(a, b)) == 1


async def test_no_retry_after_the_first_byte(start_sim, make_proxy):
    a, b, proxy = await two(start_sim, make_proxy)
    a.script({"text": "one two three four five six", "drop_after": 2})
    status, _, events = await call(proxy, ask({"order": ["a", "b"]}, stream=True))
    assert status == 200
    assert events[-1]["type"] == "response.failed"
    response = events[-1]["response"]
    assert response["status"] == "failed" and response["error"]["type"] == "upstream_disconnected"
    assert served_by(a, b) == [1, 0]


# --------------------------------------------------------------------------- timeouts


async def test_connect_timeout_fails_over_then_504(start_sim, make_proxy):
    url, socks = blackhole()
    try:
        live = await start_sim()
        proxy = await make_proxy({**NO_AUTH, "health": {"enabled": False}},
                                 workers=[worker("hole", url, timeouts={"connect": 0.3}), worker("live", live.url)])
        started = time.monotonic()
        status, _, _ = await call(proxy, ask({"order": ["hole"]}))
        assert status == 200 and len(live.requests) == 1
        assert 0.25 < time.monotonic() - started < 3
        status, _, body = await call(proxy, ask({"only": ["hole"]}))
        assert status == 504 and body["error"]["code"] == "upstream_timeout"
        assert "connection" in body["error"]["message"]
    finally:
        for s in socks:
            s.close()


async def test_first_byte_timeout_is_504_and_not_retried(start_sim, make_proxy):
    a, b = await start_sim(), await start_sim()
    proxy = await make_proxy(NO_AUTH, workers=[worker("a", a.url, timeouts={"first_byte": 0.3}),
                                               worker("b", b.url)])
    a.script({"text": "late", "first_byte_delay": 2})
    started = time.monotonic()
    status, _, body = await call(proxy, ask({"order": ["a", "b"]}, stream=True))
    assert status == 504 and body["error"]["code"] == "upstream_timeout"
    assert "first_byte" in body["error"]["message"]
    assert time.monotonic() - started < 1.5
    assert served_by(a, b) == [1, 0]


async def test_idle_timeout_is_response_failed_with_retry_hints(start_sim, make_proxy):
    a = await start_sim()
    proxy = await make_proxy(NO_AUTH, workers=[worker("a", a.url, timeouts={"idle": 0.3})])
    a.script({"text": "one two three four", "stall_after": 1})
    status, _, events = await call(proxy, ask(stream=True))
    assert status == 200 and events[-1]["type"] == "response.failed"
    response = events[-1]["response"]
    assert response["error"]["type"] == "upstream_timeout" and "idle" in response["error"]["message"]
    assert response["retry_after_ms"] and response["x_should_retry"] is True
    assert any(e["type"] == "response.output_text.delta" for e in events)


async def test_total_timeout(start_sim, make_proxy):
    a = await start_sim()
    proxy = await make_proxy(NO_AUTH, workers=[worker("a", a.url, timeouts={"idle": 5, "total": 0.8})])
    a.script({"text": "a b c d e f g h i j k l", "delay": 0.2})
    status, _, events = await call(proxy, ask(stream=True))
    assert status == 200 and events[-1]["type"] == "response.failed"
    assert "total" in events[-1]["response"]["error"]["message"]
    a.script({"text": "a b c d e f g h i j k l", "delay": 0.2})
    status, _, body = await call(proxy, ask())  # non-stream: nothing sent yet -> 504
    assert status == 504 and body["error"]["code"] == "upstream_timeout"


# --------------------------------------------------------------------------- discovery, models, dialects


async def test_models_union_with_context_windows_and_discovery(start_sim, make_proxy):
    a = await start_sim(models=("alpha",), max_model_len=1000)
    b = await start_sim(models=("beta", "gamma"), max_model_len=2000, dialect="sglang")
    proxy = await make_proxy(NO_AUTH, workers=[worker("a", a.url, models=None),
                                               worker("b", b.url, models=None, dialect="detect")])
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.url + "/v1/models") as resp:
            listing = await resp.json()
    assert listing["object"] == "list"
    windows = {m["id"]: m.get("context_window") for m in listing["data"]}
    assert windows == {"alpha": 1000, "beta": 2000, "gamma": 2000}
    assert all(m["object"] == "model" for m in listing["data"])
    status, _, body = await call(proxy, {"model": "gamma", "input": "hi"})
    assert status == 200 and served_by(a, b) == [0, 1]
    status, _, _ = await call(proxy, {"model": "alpha", "input": "hi"})
    assert status == 200 and served_by(a, b) == [1, 1]


async def test_configured_models_get_their_window_from_the_worker(start_sim, make_proxy):
    a = await start_sim(max_model_len=4096)
    proxy = await make_proxy(NO_AUTH, workers=[worker("a", a.url)])
    assert proxy.app[POOL].workers[0].max_model_len == {"tiny-org/tiny-model": 4096}


async def test_dialect_detection(start_sim, make_proxy):
    v, s = await start_sim(dialect="vllm"), await start_sim(dialect="sglang")
    proxy = await make_proxy(NO_AUTH, workers=[worker("v", v.url, dialect="detect"),
                                               worker("s", s.url, dialect="detect")])
    assert [w.dialect for w in proxy.app[POOL].workers] == ["vllm", "sglang"]


async def test_undiscovered_worker_is_503_not_404(make_proxy):
    proxy = await make_proxy({**NO_AUTH, "health": {"enabled": False}}, workers=[worker("x", dead_url(), models=None)])
    status, headers, body = await call(proxy, ask())
    assert status == 503 and headers.get("Retry-After")


# --------------------------------------------------------------------------- input_tokens


async def simulator_count(sim: Simulator, messages: list, tools=None) -> int:
    path = "/v1/tokenize" if sim.state.dialect == "sglang" else "/tokenize"
    async with aiohttp.ClientSession() as http:
        async with http.post(sim.url + path, json={"model": "tiny-org/tiny-model", "messages": messages,
                                                   **({"tools": tools} if tools else {})}) as resp:
            return (await resp.json())["count"]


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_input_tokens_equals_the_simulator_count(start_sim, make_proxy, dialect):
    s = await start_sim(dialect=dialect)
    proxy = await make_proxy(NO_AUTH, workers=[worker("s", s.url, dialect="detect")])
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    status, _, body = await call(proxy, {"model": "tiny-org/tiny-model", "instructions": "Be brief.",
                                         "input": "What is the weather in Paris today?", "tools": [tool]},
                                 "/v1/responses/input_tokens")
    assert status == 200 and body["object"] == "response.input_tokens"
    expected = await simulator_count(s, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "What is the weather in Paris today?"}],
                                     [{"type": "function", "function": {"name": "get_weather",
                                                                        "parameters": {"type": "object",
                                                                                       "properties": {}}}}])
    assert body["input_tokens"] == expected > 10
    assert s.requests == []  # counting runs no generation


async def test_input_tokens_routes_and_fails_over(start_sim, make_proxy):
    live = await start_sim()
    proxy = await make_proxy({**NO_AUTH, "health": {"enabled": False}},
                             workers=[worker("dead", dead_url()), worker("live", live.url)])
    status, _, body = await call(proxy, ask({"order": ["dead"]}), "/v1/responses/input_tokens")
    assert status == 200 and body["input_tokens"] > 0
    status, _, body = await call(proxy, ask({"only": ["dead"]}), "/v1/responses/input_tokens")
    assert status == 502 and body["error"]["type"] == "upstream_error"
    status, _, body = await call(proxy, ask({"quantizations": ["fp8"]}), "/v1/responses/input_tokens")
    assert status == 503


# --------------------------------------------------------------------------- context window


async def test_context_window_400_names_both_numbers(start_sim, make_proxy):
    a = await start_sim(max_model_len=100)
    proxy = await make_proxy(NO_AUTH, workers=[worker("a", a.url)])
    text = "one two three four five six seven eight nine ten"
    prompt = await simulator_count(a, [{"role": "user", "content": text}])
    status, _, body = await call(proxy, ask(input=text, max_output_tokens=95))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    message = body["error"]["message"]
    assert f"{prompt} input tokens" in message and "max_output_tokens=95" in message and "100 tokens" in message
    assert a.requests == []  # refused before forwarding
    status, _, _ = await call(proxy, ask(input=text, max_output_tokens=100 - prompt))
    assert status == 200 and len(a.requests) == 1


class _NoSession:
    """A session that must not be used: the decision needs no upstream call."""

    def post(self, *a, **kw):
        raise AssertionError("unexpected upstream call")


FLOOR = config_settings.of("routing").bytes_per_token_floor


def _t(chat: dict, window: int = 32768):
    body = {"model": "m", "input": "x"}
    t = translate_request(body)._replace(chat={"model": "m", **chat})
    return t, SimpleNamespace(
        max_model_len={"m": window}, dialect="vllm", name="w")


async def test_context_check_costs_nothing_when_it_clearly_fits():
    t, w = _t({"messages": [{"role": "user", "content": "hi " * 1000}], "max_tokens": 1000})
    assert await check_context_window(_NoSession(), w, t, 1000, bytes_per_token_floor=FLOOR) == ("fits", t)


async def test_context_check_refuses_clearly_over_without_a_call():
    t, w = _t({"messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 100}, window=32768)
    with pytest.raises(Exception) as info:
        await check_context_window(_NoSession(), w, t, 100, bytes_per_token_floor=FLOOR)
    assert info.value.status == 400 and "estimated" in info.value.message and "32768" in info.value.message


async def test_context_check_leaves_vllm_uncapped_requests_alone():
    # No max_output_tokens from the client: the cap is the proxy's; vLLM lowers it itself.
    t, w = _t({"messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 32768})
    assert await check_context_window(_NoSession(), w, t, None, bytes_per_token_floor=FLOOR) == ("fits", t)
    assert t.chat["max_tokens"] == 32768


async def test_context_check_never_sends_vllm_a_cap_above_its_window():
    # vLLM lowers a cap to the room left, but refuses one above max_model_len: the proxy's own
    # cap (a summary's 2048 on a 1024-token model) goes as the window, vLLM lowers it further.
    t, w = _t({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2048}, window=1024)
    decision, sent = await check_context_window(_NoSession(), w, t, None, bytes_per_token_floor=FLOOR)
    assert decision == "clamped" and sent.chat["max_tokens"] == 1024 and t.chat["max_tokens"] == 2048


async def test_context_check_lowers_the_proxys_own_cap_for_sglang():
    # SGLang refuses prompt + max_tokens over the window (vLLM lowers it): the proxy's cap is lowered
    # from the size bound, still without an upstream call.
    t, w = _t({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 32768})
    w.dialect = "sglang"
    decision, sent = await check_context_window(_NoSession(), w, t, None, bytes_per_token_floor=FLOOR)
    assert decision == "clamped" and 32768 - 400 < sent.chat["max_tokens"] < 32768
    assert t.chat["max_tokens"] == 32768  # a new Translation: the one the phases made is unchanged


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("overrides", [
    {"routing": {"max_attempts": 0}},
    {"routing": {"retries": 2}},
    {"health": {"interval_s": 0}},
    {"health": {"unhealthy_threshold": 0}},
    {"health": {"outlier": {"consecutive_failures": 0}}},
    {"health": {"outlier": {"base_ejection_s": 60, "max_ejection_s": 30}}},
    {"workers": [{"name": "a", "url": "http://x", "dialect": "tgi"}]},
    {"workers": [{"name": "a", "url": "http://x", "capacity": 0}]},
    {"workers": [{"name": "a", "url": "http://x", "labels": ["fp8"]}]},
    {"workers": [{"name": "a", "url": "http://x", "models": "tiny-org/tiny-model"}]},
    {"workers": [{"name": "a", "url": "http://x", "timeouts": {"idle": 0}}]},
])
def test_bad_configuration_stops_start_up(overrides):
    from proxy.app import build_app
    from proxy.config.load import Config, ConfigError

    with pytest.raises(ConfigError):
        build_app(Config.from_dict({**NO_AUTH, "ledger": {"backend": "none"}, **overrides}))
