"""Prompt-cache affinity (proxy/upstream/affinity.py): consistent hashing with bounded loads.

Real simulators on loopback (each with its own vLLM-style prefix cache reporting
usage.prompt_tokens_details.cached_tokens), a real proxy, real HTTP between; the ring
properties over 1,000 keys are measured on the pure selection (proxy.upstream.routing.select).
"""

from __future__ import annotations

import asyncio
import re
import uuid

import aiohttp
import orjson
import pytest

from proxy import state
from proxy.upstream import affinity
from proxy.upstream.affinity import AffinityKey, Ring, key_point
from proxy.config import settings as config_settings
from proxy.config.load import Config, ConfigError
from proxy.state import POOL
from proxy.ledger.pricing import Price, cost_micros
from proxy.upstream.routing import parse_provider, select
from proxy.simulator.server import Simulator
from proxy.upstream.workers import Worker, WorkerPool
from tests.conftest import eventually, free_port, only

NO_AUTH = only("stateless")
FAST = {"connect": 2, "first_byte": 10, "idle": 10, "total": 60}
OFF = {"routing": {"affinity": {"enabled": False}}}


def worker(name: str, url: str, **extra) -> dict:
    return {"name": name, "url": url, "dialect": "vllm", "models": ["tiny-org/tiny-model"], "timeouts": dict(FAST), **extra}


@pytest.fixture
async def three(make_proxy):
    """Three simulators; returns (sims, start(overrides) -> proxy in front of all three)."""
    sims = [Simulator() for _ in range(3)]
    for s in sims:
        await s.start()

    async def start(overrides: dict | None = None, **worker_extra):
        names = ("a", "b", "c")
        return await make_proxy({**NO_AUTH, **(overrides or {})},
                                workers=[worker(n, s.url, **worker_extra.get(n, {})) for n, s in zip(names, sims)])

    yield sims, start
    for s in sims:
        await s.stop()


async def post(proxy, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json=body, headers=headers or {}) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, orjson.loads(await resp.read())


def ask(**extra) -> dict:
    return {"model": "tiny-org/tiny-model", "input": extra.pop("input", "hello"), "max_output_tokens": 16, **extra}


def counts(sims) -> list[int]:
    return [len(s.requests) for s in sims]


def which(sims, before: list[int]) -> int:
    """The index of the one simulator that got a request since `before`."""
    grown = [i for i, (s, b) in enumerate(zip(sims, before)) if len(s.requests) > b]
    assert len(grown) == 1, grown
    return grown[0]


def outcomes(proxy) -> dict:
    return dict(affinity.state(proxy.app[POOL]).outcomes)


def words(n: int, salt: str) -> str:
    return " ".join(f"{salt}{i % 97}" for i in range(n))


# --------------------------------------------------------------------------- routing by key


async def test_same_key_same_worker(three):
    sims, start = three
    proxy = await start()
    for key in ("thread-1", "thread-2", "thread-3"):
        before = counts(sims)
        for i in range(15):
            status, _, body = await post(proxy, ask(prompt_cache_key=key, input=f"turn {i}"))
            assert status == 200, body
        grown = [c - b for c, b in zip(counts(sims), before)]
        assert sorted(grown) == [0, 0, 15], grown
    assert outcomes(proxy).get(("hit", "")) == 45


async def test_each_app_parses_its_own_affinity_settings(three):
    """routing.affinity is read once per app, onto its config (config.routing.affinity); nothing
    parsed is kept process-wide, so two apps in one process route by their own settings."""
    sims, start = three
    on = await start({"routing": {"affinity": {"vnodes": 40}}})
    off = await start({"routing": {"affinity": {"enabled": False}}})
    assert on.app[state.CONFIG].routing.affinity.vnodes == 40 and not off.app[state.CONFIG].routing.affinity.enabled
    assert not [name for name, value in vars(affinity).items() if isinstance(value, dict) and name.isupper()]
    for proxy in (on, off, on):
        for i in range(3):
            status, _, body = await post(proxy, ask(prompt_cache_key="shared", input=f"turn {i}"))
            assert status == 200, body
    assert outcomes(on).get(("hit", "")) == 6
    assert not outcomes(off)


async def test_keys_spread_over_workers(three):
    sims, start = three
    proxy = await start()
    for i in range(90):
        status, _, _ = await post(proxy, ask(prompt_cache_key=f"key-{i}"))
        assert status == 200
    per_worker = counts(sims)
    assert sum(per_worker) == 90
    assert min(per_worker) >= 15, per_worker  # 30 each on average; consistent hashing, not one hot worker
    # Rings are cached by eligible-set signature: 90 requests, no per-request rebuild.
    assert affinity.state(proxy.app[POOL]).ring_builds <= 2


async def test_bounded_load_moves_a_hot_key(three):
    sims, start = three
    proxy = await start()
    pool = proxy.app[POOL]
    before = counts(sims)
    await post(proxy, ask(prompt_cache_key="hot"))
    owner = which(sims, before)
    # The owner already holds 4 requests, the others none: average (4 + 1) / 3, bound
    # ceil(1.25 * 5 / 3) = 3, so the owner is over it and the walk takes the next worker.
    pool.workers[owner].in_flight = 4
    try:
        before = counts(sims)
        await post(proxy, ask(prompt_cache_key="hot"))
        moved = which(sims, before)
        assert moved != owner
        assert outcomes(proxy).get(("miss", "load")) == 1
        # Always the same next worker on the ring, not a random one.
        before = counts(sims)
        await post(proxy, ask(prompt_cache_key="hot"))
        assert which(sims, before) == moved
    finally:
        pool.workers[owner].in_flight = 0
    before = counts(sims)
    await post(proxy, ask(prompt_cache_key="hot"))
    assert which(sims, before) == owner  # back home once the load is gone


async def test_concurrent_hot_key_is_spread_by_the_bound(three):
    """Nine slow requests of one key at once: the owner takes no more than its bound."""
    sims, start = three
    proxy = await start()
    body = ask(prompt_cache_key="burst", input='SIM:{"first_byte_delay": 0.4}')
    results = await asyncio.gather(*(post(proxy, body) for _ in range(9)))
    assert all(status == 200 for status, _, _ in results)
    per_worker = counts(sims)
    # Sequentially admitted: ceil(1.25 * (m + 1) / 3) caps each worker; one key alone would put 9 on one.
    assert max(per_worker) <= 5 and sum(per_worker) == 9, per_worker


async def test_failover_continues_on_the_ring(make_proxy):
    live = [Simulator(), Simulator()]
    for s in live:
        await s.start()
    try:
        dead = f"http://127.0.0.1:{free_port()}"
        workers = [worker("a", dead), worker("b", live[0].url), worker("c", live[1].url)]
        # Without active checks the dead worker stays on the ring (a check would keep it out).
        proxy = await make_proxy({**NO_AUTH, "health": {"enabled": False}}, workers=workers)
        pool = proxy.app[POOL]
        ring = Ring(pool.workers, 160)
        # A key whose owner is the dead worker: the answer comes from the next worker on its ring.
        key = next(k for k in (f"k{i}" for i in range(1000))
                   if ring.owner(key_point(b"k\x00" + k.encode())).name == "a")
        order = [w.name for w in ring.walk(key_point(b"k\x00" + key.encode()))]
        status, _, body = await post(proxy, ask(prompt_cache_key=key))
        assert status == 200, body
        served = {"b": len(live[0].requests), "c": len(live[1].requests)}
        assert served[order[1]] == 1 and sum(served.values()) == 1, (order, served)
        assert outcomes(proxy).get(("miss", "failover")) == 1
    finally:
        for s in live:
            await s.stop()


# --------------------------------------------------------------------------- the ring, measured


def _pool(n: int) -> WorkerPool:
    return WorkerPool([Worker(name=f"w{i}", url=f"http://w{i}", models=("m",)) for i in range(n)])


def _owners(pool: WorkerPool, keys: list[AffinityKey]) -> list[str]:
    return [select(pool, "m", None, affinity=k).name for k in keys]


_AFFINITY = config_settings.of("routing.affinity")
KEYS = [AffinityKey("prompt_cache_key", key_point(b"k\x00" + f"key-{i}".encode()), _AFFINITY.epsilon, _AFFINITY.vnodes)
        for i in range(1000)]


def test_ejecting_a_worker_moves_only_its_keys():
    pool = _pool(4)
    before = _owners(pool, KEYS)
    pool.workers[2].ejected = True
    after = _owners(pool, KEYS)
    kept = [i for i, name in enumerate(before) if name != "w2"]
    moved = [i for i, (b, a) in enumerate(zip(before, after)) if b != a]
    assert all(after[i] == before[i] for i in kept)  # every key whose owner stayed keeps its worker
    assert set(moved) == {i for i, name in enumerate(before) if name == "w2"}
    share = len(moved) / len(KEYS)
    assert 0.15 < share < 0.35, share  # about 1/4 of the keys, spread over the three others
    assert {after[i] for i in moved} == {"w0", "w1", "w3"}
    print(f"\nejecting 1 of 4 workers moved {len(moved)} of {len(KEYS)} keys ({share:.1%}); "
          f"the other {len(kept)} kept their worker")
    pool.workers[2].ejected = False
    assert _owners(pool, KEYS) == before  # re-admitted: its keys come back


def test_adding_a_worker_moves_keys_only_to_it():
    small, large = _pool(3), _pool(4)
    before, after = _owners(small, KEYS), _owners(large, KEYS)
    moved = [i for i, (b, a) in enumerate(zip(before, after)) if b != a]
    assert all(after[i] == "w3" for i in moved)
    assert 0.15 < len(moved) / len(KEYS) < 0.35


def test_selection_respects_bounded_load_purely():
    pool = _pool(3)
    key = KEYS[0]
    owner = select(pool, "m", None, affinity=key)
    owner.in_flight = 10
    try:
        assert select(pool, "m", None, affinity=key) is not owner
        owner.capacity = 10  # at capacity: never chosen, whatever the bound
        assert select(pool, "m", None, affinity=key) is not owner
    finally:
        owner.in_flight, owner.capacity = 0, 256
    assert select(pool, "m", None, affinity=key) is owner


def test_affinity_only_applies_to_the_load_sort():
    pool = _pool(3)
    pool.workers[1].ewma_ttfb = 0.001
    pool.workers[0].ewma_ttfb = pool.workers[2].ewma_ttfb = 0.5
    # sort=latency was asked for explicitly: the fastest, whatever the key.
    assert {select(pool, "m", parse_provider({"sort": "latency"}), affinity=k).name for k in KEYS[:30]} == {"w1"}


# --------------------------------------------------------------------------- keys: fallbacks


async def test_conversation_is_the_key_without_prompt_cache_key(three):
    sims, start = three
    proxy = await start()
    for conv in ("conv_1", {"id": "conv_2"}):
        before = counts(sims)
        for i in range(8):
            status, _, body = await post(proxy, ask(conversation=conv, input=f"message {i}"))
            assert status == 200, body
        assert sorted(c - b for c, b in zip(counts(sims), before)) == [0, 0, 8]


async def test_system_and_first_user_message_are_the_key_by_default(three):
    sims, start = three
    proxy = await start()
    history = [{"role": "user", "content": "Plan a trip to Lisbon."}]
    before = counts(sims)
    for turn in range(6):  # a growing conversation with no key: its head stays the same
        status, _, body = await post(proxy, ask(instructions="You are a travel agent.", input=list(history)))
        assert status == 200, body
        history += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"more {turn}"}]
    assert sorted(c - b for c, b in zip(counts(sims), before)) == [0, 0, 6]


async def test_message_hash_can_be_turned_off(three):
    sims, start = three
    proxy = await start({"routing": {"affinity": {"hash_messages": False}}})
    for _ in range(9):
        await post(proxy, ask(instructions="Same system.", input="Same question."))
    assert counts(sims) == [3, 3, 3]  # no key: least loaded, ties take turns
    before = counts(sims)
    for _ in range(6):
        await post(proxy, ask(prompt_cache_key="still-keyed"))
    assert sorted(c - b for c, b in zip(counts(sims), before)) == [0, 0, 6]


async def test_affinity_off_is_least_loaded(three):
    sims, start = three
    proxy = await start(OFF)
    for _ in range(9):
        await post(proxy, ask(prompt_cache_key="thread"))
    assert counts(sims) == [3, 3, 3]
    assert outcomes(proxy) == {}


# --------------------------------------------------------------------------- provider requirements


async def test_provider_requirements_still_decide_who_is_eligible(three):
    sims, start = three
    proxy = await start(a={"labels": {"region": "eu"}}, b={"labels": {"region": "us"}}, c={"labels": {"region": "us"}})
    pool = proxy.app[POOL]
    ring = Ring(pool.workers, 160)
    key = next(k for k in (f"p{i}" for i in range(1000)) if ring.owner(key_point(b"k\x00" + k.encode())).name == "a")
    before = counts(sims)
    for _ in range(4):  # the owner is "a" but the request wants the US: one US worker, always the same
        status, _, body = await post(proxy, ask(prompt_cache_key=key, provider={"only": ["region=us"]}))
        assert status == 200, body
    grown = [c - b for c, b in zip(counts(sims), before)]
    assert grown[0] == 0 and sorted(grown[1:]) == [0, 4], grown
    assert outcomes(proxy).get(("miss", "ineligible")) == 4
    # provider.order still comes first: a tier named first takes it, whatever the ring says.
    before = counts(sims)
    for _ in range(3):
        status, _, body = await post(proxy, ask(prompt_cache_key=key, provider={"order": ["c"]}))
        assert status == 200
    assert [c - b for c, b in zip(counts(sims), before)] == [0, 0, 3]
    # Unmet requirements are still refused, affinity or not.
    status, _, body = await post(proxy, ask(prompt_cache_key=key, provider={"only": ["region=ap"]}))
    assert status == 503 and body["error"]["code"] == "provider_requirements_unmet"
    # An ejected owner: the key moves to the next eligible worker on the ring, then comes back.
    pool.workers[0].ejected, pool.workers[0].ejected_until = True, float("inf")
    before = counts(sims)
    await post(proxy, ask(prompt_cache_key=key))
    assert which(sims, before) != 0
    pool.workers[0].ejected = False
    before = counts(sims)
    await post(proxy, ask(prompt_cache_key=key))
    assert which(sims, before) == 0


# --------------------------------------------------------------------------- cache hits, measured


async def _conversations(proxy, *, n_conv: int, turns: int, keyed: bool) -> list[list[tuple[int, int]]]:
    """n_conv conversations of `turns` turns, interleaved; each turn re-sends the whole history.
    Returns per conversation [(input_tokens, cached_tokens) per turn]."""
    salt = uuid.uuid4().hex[:8]
    convs = []
    for c in range(n_conv):
        convs.append({"instructions": f"Conversation {c} {salt}. " + words(600, f"s{c}x"),
                      "history": [], "usage": []})
    for turn in range(turns):
        for c, conv in enumerate(convs):
            conv["history"].append({"role": "user", "content": words(150, f"u{c}t{turn}x")})
            body = ask(instructions=conv["instructions"], input=list(conv["history"]), max_output_tokens=20)
            if keyed:
                body["prompt_cache_key"] = f"thread-{salt}-{c}"
            status, _, resp = await post(proxy, body)
            assert status == 200, resp
            usage = resp["usage"]
            conv["usage"].append((usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]))
            text = "".join(p["text"] for item in resp["output"] if item["type"] == "message" for p in item["content"])
            conv["history"].append({"role": "assistant", "content": text})
    return [conv["usage"] for conv in convs]


def _ratio(usages: list[list[tuple[int, int]]]) -> float:
    """Cached / input tokens over turns 2..N of every conversation."""
    inp = sum(i for conv in usages for i, _ in conv[1:])
    cached = sum(c for conv in usages for _, c in conv[1:])
    return cached / inp


@pytest.mark.parametrize("keyed", [True, False], ids=["prompt_cache_key", "message-hash"])
async def test_cached_ratio_with_and_without_affinity(three, keyed):
    sims, start = three
    on = await start()
    usages_on = await _conversations(on, n_conv=4, turns=6, keyed=keyed)
    for s in sims:  # a cold cache for the second proxy (the same three simulators)
        s.state.cache._blocks.clear()
    off = await start(OFF)
    usages_off = await _conversations(off, n_conv=4, turns=6, keyed=keyed)
    ratio_on, ratio_off = _ratio(usages_on), _ratio(usages_off)
    print(f"\n[{'prompt_cache_key' if keyed else 'message hash'}] cached/input tokens, turns 2-6, "
          f"4 interleaved conversations over 3 simulators: affinity on {ratio_on:.1%}, off {ratio_off:.1%}")
    assert ratio_on > 0.8, usages_on
    for conv in usages_on:  # from turn 2 on, every turn is mostly cached
        assert all(c / i > 0.7 for i, c in conv[1:]), conv
    assert ratio_off < 0.5, usages_off
    assert ratio_on - ratio_off > 0.4


# --------------------------------------------------------------------------- billing and metrics


async def test_cached_tokens_are_reported_and_billed_at_the_cached_price(three):
    sims, start = three
    proxy = await start(only("stateless", "auth", "limits", "tools", "balance", "notices"))
    headers = {"Authorization": f"Bearer {proxy.api_key}"}
    instructions = "You are terse. " + words(400, "sys")
    history = [{"role": "user", "content": words(100, "first")}]
    usage_rows = []
    for turn in range(2):
        status, resp_headers, resp = await post(proxy, ask(instructions=instructions, input=list(history),
                                                           prompt_cache_key="billing-thread"), headers)
        assert status == 200, resp
        history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": words(50, f"t{turn}")}]
        request_id = resp_headers["x-request-id"]
        row = await eventually(lambda: proxy.ledger.usage(request_id), what=f"the usage row of {request_id}")
        usage_rows.append((resp["usage"], row))
    assert sorted(counts(sims)) == [0, 0, 2]  # both turns on one simulator
    (first, first_row), (second, second_row) = usage_rows
    assert first["input_tokens_details"]["cached_tokens"] == 0
    cached = second["input_tokens_details"]["cached_tokens"]
    assert cached > 0.8 * first["input_tokens"]
    assert second_row.cached_tokens == cached and second_row.input_tokens == second["input_tokens"]
    price = Price(input=500_000, cached_input=100_000, output=1_500_000)  # the embedded default
    expected = cost_micros(price, second["input_tokens"], cached, second["output_tokens"])
    uncached = cost_micros(price, second["input_tokens"], 0, second["output_tokens"])
    assert second_row.cost_micros == expected < uncached


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_metrics_move(three):
    sims, start = three
    proxy = await start()
    await _conversations(proxy, n_conv=2, turns=3, keyed=True)
    pool = proxy.app[POOL]
    ring = Ring(pool.workers, 160)
    key = next(k for k in (f"m{i}" for i in range(1000)) if ring.owner(key_point(b"k\x00" + k.encode())).name == "b")
    pool.workers[1].in_flight = 5
    try:
        await post(proxy, ask(prompt_cache_key=key))
    finally:
        pool.workers[1].in_flight = 0
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.url + "/metrics") as resp:
            text = await resp.text()
    assert _metric(text, "responses_proxy_affinity_routing_total", result="hit") == 6
    assert _metric(text, "responses_proxy_affinity_routing_total", result="miss", reason="load") == 1
    assert _metric(text, "responses_proxy_affinity_ring_builds_total") >= 1
    prompt = _metric(text, "responses_proxy_worker_prompt_tokens_total")
    cached = _metric(text, "responses_proxy_worker_cached_tokens_total")
    assert prompt > 0 and cached / prompt > 0.5
    served = [w.name for w, s in zip(pool.workers, sims) if s.requests]
    for name in served:
        ratio = _metric(text, "responses_proxy_worker_cached_token_ratio", worker=name)
        assert 0 <= ratio <= 1
    assert max(_metric(text, "responses_proxy_worker_cached_token_ratio", worker=n) for n in served) > 0.4


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("section, message", [
    ({"epsilon": 0}, "epsilon"),
    ({"epsilon": "x"}, "epsilon"),
    ({"vnodes": 0}, "vnodes"),
    ({"enabled": "yes"}, "enabled"),
    ({"bogus": 1}, "unknown"),
])
def test_bad_affinity_settings_stop_start_up(section, message, tmp_path):
    from proxy.app import build_app

    with pytest.raises(ConfigError, match=message):  # from the schema check at load time
        build_app(Config.from_dict({"routing": {"affinity": section}, "ledger": {"path": str(tmp_path / "l.db")}}))
