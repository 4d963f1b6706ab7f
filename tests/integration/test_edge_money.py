"""The money invariants (tests/integration/test_money.py) over the pass-through endpoints: whatever a scripted
upstream reports or does (hostile usage, a hang-up mid-stream, an endless stream, an upstream
that ignores max_tokens), no request is debited above its hold, the balance never goes below
zero, and every row names its endpoint. Every hold is recorded as it is made (`holds`), and
each row's debit is checked against its own hold."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from middlewares.balance import wait_for_settlements
from proxy.ledger import KeyLimits
from tests.conftest import eventually
from tests.integration.test_money import record_holds

MODEL = "tiny-org/tiny-model"
PRICES = {"prices": {"default": {"input": 1_000_000, "output": 1_000_000}}}  # 1 micro per token
BALANCE = 5_000


def _body(family: str, stream: bool) -> tuple[str, dict]:
    msgs = [{"role": "user", "content": "Hi"}]
    if family == "chat":
        return "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 20, "stream": stream}
    if family == "completions":
        return "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 20, "stream": stream}
    if family == "messages":
        return "/v1/messages", {"model": MODEL, "messages": msgs, "max_tokens": 20, "stream": stream}
    return "/v1/embeddings", {"model": MODEL, "input": "Hi"}


CASES = [(f, s) for f in ("chat", "completions", "messages") for s in (False, True)] + [("embeddings", False)]
HOSTILE = [
    {"usage_override": {"prompt_tokens": 10**12, "completion_tokens": 10**12, "input_tokens": 10**12,
                        "output_tokens": 10**12}},
    {"usage_override": {"prompt_tokens": -5, "completion_tokens": "lots", "input_tokens": -5, "output_tokens": None}},
    {"usage_override": {"prompt_tokens": 2**70, "input_tokens": 2**70}},
    {"ignore_max_tokens": True, "text_words": 200},
    {"usage": False},
]


@pytest.fixture(autouse=True)
def holds(monkeypatch) -> dict[str, int]:
    """request id -> the amount held for it (every hold goes through Leases.hold_up_to)."""
    return record_holds(monkeypatch)


async def _check(proxy, key_id: str, endpoint: str, holds: dict[str, int]) -> None:
    await wait_for_settlements(proxy.app)
    rows = [r for r in await proxy.ledger.list_usage() if r.key_id == key_id]
    key = await proxy.ledger.get_key(key_id)
    assert key.balance_micros >= 0
    assert sum(r.debited_micros for r in rows) + key.balance_micros == BALANCE
    for row in rows:
        assert row.endpoint == endpoint
        assert row.output_tokens <= 20 or endpoint == "/v1/embeddings"
        assert row.debited_micros == row.cost_micros <= holds[row.request_id], (row, holds.get(row.request_id))
    assert await proxy.ledger.holds(key_id) == []


@pytest.mark.parametrize("family,stream", CASES)
@pytest.mark.parametrize("script", HOSTILE, ids=["huge", "garbage", "overflow", "ignores_cap", "no_usage"])
async def test_hostile_usage_is_never_billed_above_the_hold(make_proxy, sim, http, holds, family, stream, script):
    proxy = await make_proxy(PRICES)
    secret, record = await proxy.ledger.create_key("k", balance_micros=BALANCE)
    path, body = _body(family, stream)
    sim.script(script)
    async with http.post(proxy.url + path, json=body, headers={"x-api-key": secret}) as resp:
        await resp.read()
        assert resp.status in (200, 502), resp.status
    await _check(proxy, record.key_id, path, holds)
    bound = 256 + 16 + 200  # the prompt bound of a two-byte prompt, give or take its JSON
    for row in [r for r in await proxy.ledger.list_usage() if r.key_id == record.key_id]:
        assert row.input_tokens <= bound and row.cost_micros <= bound + 20


@pytest.mark.parametrize("family", ["chat", "completions", "messages"])
@pytest.mark.parametrize("fault", [{"drop_after": 2}, {"endless_line": True}, {"stall_after": 2},
                                   {"endless_pings": True}],
                         ids=["hang_up", "endless_line", "stall", "endless_pings"])
async def test_streams_that_fail_are_billed_within_the_hold(make_proxy, sim, http, holds, family, fault):
    proxy = await make_proxy(PRICES, workers=[{"name": "sim", "url": sim.url, "dialect": "vllm", "models": [MODEL],
                                               "timeouts": {"idle": 0.5, "total": 3}}])
    secret, record = await proxy.ledger.create_key("k", balance_micros=BALANCE)
    path, body = _body(family, True)
    sim.script({"text_words": 10, **fault})
    async with http.post(proxy.url + path, json=body, headers={"x-api-key": secret}) as resp:
        raw = await resp.read()
    assert resp.status == 200
    assert b"error" in raw
    await _check(proxy, record.key_id, path, holds)


@pytest.mark.parametrize("family", ["chat", "completions", "messages"])
async def test_a_client_that_hangs_up_mid_stream_is_billed_within_the_hold(make_proxy, sim, http, holds, family):
    proxy = await make_proxy(PRICES)
    secret, record = await proxy.ledger.create_key("k", balance_micros=BALANCE)
    path, body = _body(family, True)
    sim.script({"text_words": 15, "delay": 0.05})
    async with http.post(proxy.url + path, json=body, headers={"x-api-key": secret}) as resp:
        await resp.content.readany()
        resp.close()

    async def billed():
        return [r for r in await proxy.ledger.list_usage() if r.key_id == record.key_id]

    await eventually(billed, what="the hung-up request billed")
    await _check(proxy, record.key_id, path, holds)
    rows = [r for r in await proxy.ledger.list_usage() if r.key_id == record.key_id]
    assert len(rows) == 1 and rows[0].status in ("cancelled", "completed")


@pytest.mark.parametrize("family", ["chat", "completions", "embeddings", "messages"])
async def test_a_client_that_hangs_up_before_a_json_answer_is_billed_within_the_hold(make_proxy, sim, http, holds,
                                                                                   family):
    """A non-stream request whose client leaves while the model server is still working: the
    hold is given back (or settled within it), nothing is left held."""
    proxy = await make_proxy(PRICES)
    secret, record = await proxy.ledger.create_key("k", balance_micros=BALANCE)
    path, body = _body(family, False)
    sim.script({"first_byte_delay": 1.0})
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(proxy.url + path, json=body, headers={"x-api-key": secret},
                             timeout=aiohttp.ClientTimeout(total=0.3)) as resp:
            await resp.read()
    async def given_back() -> bool:  # the upstream answers meanwhile, to nobody
        return sim.in_flight == 0 and await proxy.ledger.holds(record.key_id) == []

    await eventually(given_back, what="the upstream's answer ended and the hold given back")
    assert len(holds) == 1  # the request was held for
    await _check(proxy, record.key_id, path, holds)


# Every hostile behaviour, for the audit under load (one is popped per request, whatever its family).
_AUDIT_SCRIPTS = HOSTILE + [
    {"text_words": 12},
    {"text_words": 30, "delay": 0.01},  # the client leaves part way (streams)
    {"drop_after": 2, "text_words": 10},
    {"usage_override": {"prompt_tokens": 3, "completion_tokens": 1, "input_tokens": 3, "output_tokens": 1}},
]


@pytest.mark.parametrize("leases", [True, False])
async def test_audit_over_the_edge_under_hostile_concurrent_load(make_proxy, sim, http, holds, leases):
    """Mixed concurrent traffic over the four endpoints (streams and JSON) on small keys, every
    upstream behaviour above, some clients leaving mid-stream; then for every key: balance
    decrease == sum of debits <= sum of holds, no debit above its own hold, none clamped at the
    balance, no hold left open, the ledger's own audit balanced."""
    section = {"lease_min_rate": 1} if leases else {"lease_max_micros": 0}
    proxy = await make_proxy({**PRICES, "balance": section})
    keys = []
    for n, initial in enumerate((1_500, 4_000, 12_000)):
        secret, record = await proxy.ledger.create_key(f"audit{n}", balance_micros=initial,
                                                       limits=KeyLimits(concurrency=1000))
        keys.append((secret, record.key_id, initial))
    cases = CASES

    async def one(secret: str, i: int) -> None:
        family, stream = cases[i % len(cases)]
        path, body = _body(family, stream)
        try:
            async with http.post(proxy.url + path, data=orjson.dumps(body),
                                 headers={"x-api-key": secret, "Content-Type": "application/json"}) as resp:
                if stream and i % 5 == 0 and resp.status == 200:
                    await resp.content.readany()  # a few bytes, then hang up
                    return
                await resp.read()
        except aiohttp.ClientError:
            pass

    for _ in range(2):  # two waves: the second runs on what the first left
        sim.state.queue.clear()
        sim.script(*[_AUDIT_SCRIPTS[i % len(_AUDIT_SCRIPTS)] for i in range(3 * 28)])
        await asyncio.gather(*(one(secret, i) for secret, _, _ in keys for i in range(28)))
    async def settled() -> bool:  # a hung-up stream's settlement may start after a first wait
        await wait_for_settlements(proxy.app)
        return sim.in_flight == 0 and await proxy.ledger.holds() == []

    await eventually(settled, what="every request settled")
    paths = {_body(f, s)[0] for f, s in cases}
    for secret, key_id, initial in keys:
        final = (await proxy.ledger.get_key(key_id)).balance_micros
        rows = await proxy.ledger.list_usage(key_id, limit=10_000)
        debits = sum(r.debited_micros for r in rows)
        assert initial - final == debits <= sum(holds[r.request_id] for r in rows), (key_id, initial, final, debits)
        assert all(r.debited_micros == r.cost_micros <= holds[r.request_id] for r in rows)
        assert {r.endpoint for r in rows} <= paths and final >= 0
    assert await proxy.ledger.holds() == []
    assert all(balance == expected for _, balance, expected in await proxy.ledger.audit())
