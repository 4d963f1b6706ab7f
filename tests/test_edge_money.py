"""The money invariants (tests/test_money.py) over the pass-through endpoints: whatever a scripted
upstream reports or does (hostile usage, a hang-up mid-stream, an endless stream, an upstream
that ignores max_tokens), no request is debited above its hold, the balance never goes below
zero, and every row names its endpoint."""

from __future__ import annotations

import asyncio

import pytest

from middlewares.balance import wait_for_settlements

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


async def _check(proxy, key_id: str, endpoint: str) -> None:
    await wait_for_settlements(proxy.app)
    rows = [r for r in await proxy.ledger.list_usage() if r.key_id == key_id]
    key = await proxy.ledger.get_key(key_id)
    assert key.balance_micros >= 0
    assert sum(r.debited_micros for r in rows) + key.balance_micros == BALANCE
    for row in rows:
        assert row.endpoint == endpoint
        assert row.output_tokens <= 20 or endpoint == "/v1/embeddings"


@pytest.mark.parametrize("family,stream", CASES)
@pytest.mark.parametrize("script", HOSTILE, ids=["huge", "garbage", "overflow", "ignores_cap", "no_usage"])
async def test_hostile_usage_is_never_billed_above_the_hold(make_proxy, sim, http, family, stream, script):
    proxy = await make_proxy(PRICES)
    secret, record = await proxy.ledger.create_key("k", balance_micros=BALANCE)
    path, body = _body(family, stream)
    sim.script(script)
    async with http.post(proxy.url + path, json=body, headers={"x-api-key": secret}) as resp:
        await resp.read()
        assert resp.status in (200, 502), resp.status
    await _check(proxy, record.key_id, path)
    bound = 256 + 16 + 200  # the prompt bound of a two-byte prompt, give or take its JSON
    for row in [r for r in await proxy.ledger.list_usage() if r.key_id == record.key_id]:
        assert row.input_tokens <= bound and row.cost_micros <= bound + 20


@pytest.mark.parametrize("family", ["chat", "completions", "messages"])
@pytest.mark.parametrize("fault", [{"drop_after": 2}, {"endless_line": True}, {"stall_after": 2}],
                         ids=["hang_up", "endless_line", "stall"])
async def test_streams_that_fail_are_billed_within_the_hold(make_proxy, sim, http, family, fault):
    proxy = await make_proxy(PRICES, workers=[{"name": "sim", "url": sim.url, "dialect": "vllm", "models": [MODEL],
                                               "timeouts": {"idle": 0.5, "total": 3}}])
    secret, record = await proxy.ledger.create_key("k", balance_micros=BALANCE)
    path, body = _body(family, True)
    sim.script({"text_words": 10, **fault})
    async with http.post(proxy.url + path, json=body, headers={"x-api-key": secret}) as resp:
        raw = await resp.read()
    assert resp.status == 200
    assert b"error" in raw
    await _check(proxy, record.key_id, path)


@pytest.mark.parametrize("family", ["chat", "messages"])
async def test_a_client_that_hangs_up_mid_stream_is_billed_within_the_hold(make_proxy, sim, http, family):
    proxy = await make_proxy(PRICES)
    secret, record = await proxy.ledger.create_key("k", balance_micros=BALANCE)
    path, body = _body(family, True)
    sim.script({"text_words": 15, "delay": 0.05})
    async with http.post(proxy.url + path, json=body, headers={"x-api-key": secret}) as resp:
        await resp.content.readany()
        resp.close()
    await asyncio.sleep(0.3)
    await _check(proxy, record.key_id, path)
    rows = [r for r in await proxy.ledger.list_usage() if r.key_id == record.key_id]
    assert len(rows) == 1 and rows[0].status in ("cancelled", "completed")
