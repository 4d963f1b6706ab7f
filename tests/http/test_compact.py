"""POST /v1/responses/compact (Open Responses 2026-04-24): the compacted window, judged by the
spec's CompactResource and the openai SDK's own types (tests/support/sdk_check.py: CompactedResponse, the
user messages then one compaction item), sent back as the base input of a new response over HTTP
and over the WebSocket; the summary's output cap fitted to a small window, asked with thinking
off, and asked once more when the model answers only reasoning."""

from __future__ import annotations

import base64
import os

import aiohttp
import orjson
import pytest

from proxy.protocol import seal
from proxy.protocol.compaction import SEAL_FORMAT, SUMMARY_HEADER
from proxy.simulator.server import Simulator
from tests.support.sdk_check import validate_sdk_compaction

MODEL = "tiny-org/tiny-model"
SEAL = {"reasoning_seal": {"keys": {"k1": base64.urlsafe_b64encode(os.urandom(32)).decode()}}}
PRICES = {"prices": {"default": {"input": 1_000_000, "cached_input": 1_000_000, "output": 1_000_000}}}
WINDOW = [
    {"role": "user", "content": "Plan three days in Lisbon."},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Day one: Alfama.", "annotations": []}]},
    {"role": "user", "content": "Check the weather."},
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\": \"Lisbon\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24C"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It will be sunny.", "annotations": []}]},
    {"role": "user", "content": "And the hotel?"},
]
SUMMARY = "Lisbon trip, three days; day one Alfama; weather sunny 24C."


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _compact(proxy, window=WINDOW) -> dict:
    client = proxy.openai()  # its transport judges the answer by the spec's CompactResource
    raw = await client.responses.with_raw_response.compact(model=MODEL, input=window)
    assert raw.parse().object == "response.compaction"
    answer = orjson.loads(raw.http_response.content)
    validate_sdk_compaction(answer)  # the openai SDK's own types, model_validate
    return answer


def _texts(items: list[dict]) -> list[str]:
    return [i["content"][0]["text"] for i in items]


async def test_compact_answers_the_latest_user_messages_then_one_sealed_summary(sim, make_proxy):
    proxy = await make_proxy({**SEAL, **PRICES, "compact": {"keep_recent_items": 2}})
    sim.script({"text": SUMMARY})
    compacted = await _compact(proxy)
    *kept, item = compacted["output"]
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert SUMMARY not in item["encrypted_content"] and item["encrypted_content"].startswith("rp2.")
    # The latest two user messages as they were (item resources), in their order, then the summary.
    assert [(k["type"], k["role"], k["status"]) for k in kept] == [("message", "user", "completed")] * 2
    assert _texts(kept) == ["Check the weather.", "And the hotel?"]
    assert kept[0]["content"] == [{"type": "input_text", "text": "Check the weather."}]
    # The model was asked for the summary of the whole window, then the instructions, with
    # thinking off, for a summary of the proxy's own cap, the answer read whole.
    asked = sim.requests[-1]
    assert asked["messages"][0] == {"role": "user", "content": "Plan three days in Lisbon."}
    assert any(m["role"] == "tool" and m["content"] == "sunny, 24C" for m in asked["messages"])
    assert asked["messages"][-2]["content"] == "And the hotel?" and asked["messages"][-1]["content"].startswith("Summarize")
    assert asked["chat_template_kwargs"] == {"enable_thinking": False} and asked["reasoning_effort"] == "none"
    assert asked["max_tokens"] == 2048 and asked["stream"] is False and "tools" not in asked
    # Billed as any request, and the usage reported is the one billed.
    usage = compacted["usage"]
    assert usage["output_tokens"] > 0 and usage["input_tokens"] > 0
    (row,) = await proxy.ledger.list_usage()
    assert (row.input_tokens, row.output_tokens) == (usage["input_tokens"], usage["output_tokens"])
    assert row.cost_micros > 0 and row.status == "completed"


async def test_a_compacted_window_continues_over_http_and_the_socket(sim, make_proxy, http):
    proxy = await make_proxy({**SEAL, "compact": {"keep_recent_items": 1}})
    sim.script({"text": SUMMARY})
    window = (await _compact(proxy))["output"]
    nxt = {"role": "user", "content": "Book it."}

    client = proxy.openai()
    sim.script({"text": "Booked."})
    response = await client.responses.create(model=MODEL, input=[*window, nxt])
    assert response.status == "completed" and response.output_text.endswith("Booked.")
    messages = sim.requests[-1]["messages"]
    assert messages == [{"role": "user", "content": "And the hotel?"},
                        {"role": "user", "content": SUMMARY_HEADER + SUMMARY},
                        {"role": "user", "content": "Book it."}]

    sim.script({"text": "Booked again."})
    async with http.ws_connect(proxy.url + "/v1/responses", headers=auth(proxy.api_key)) as ws:
        await ws.send_str(orjson.dumps({"type": "response.create", "model": MODEL, "input": [*window, nxt]}).decode())
        while True:
            event = orjson.loads((await ws.receive()).data)
            if event["type"] in ("response.completed", "response.failed", "error"):
                break
    assert event["type"] == "response.completed", event
    assert sim.requests[-1]["messages"] == messages


async def test_a_window_of_kept_user_messages_comes_back_as_it_is(sim, make_proxy):
    proxy = await make_proxy(SEAL)
    compacted = await _compact(proxy, window=[{"role": "user", "content": "Just this."}])
    assert _texts(compacted["output"]) == ["Just this."]
    assert compacted["usage"]["total_tokens"] == 0 and sim.requests == []


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
@pytest.mark.parametrize("max_summary_tokens", [None, 4096])
async def test_the_summary_cap_is_fitted_to_a_small_window(make_proxy, dialect, max_summary_tokens):
    """A 2048-token model with the shipped cap (2048), or one above the window: the summary is
    written in the room the window leaves (vLLM lowers the cap itself, SGLang is sent the room),
    never refused as a client's max_output_tokens would be."""
    async with Simulator(dialect=dialect, max_model_len=2048) as small:
        workers = [{"name": "small", "url": small.url, "dialect": dialect, "models": [MODEL]}]
        compact = {"keep_recent_items": 1} | ({"max_summary_tokens": max_summary_tokens} if max_summary_tokens else {})
        proxy = await make_proxy({**SEAL, "compact": compact}, workers=workers)
        small.script({"text": SUMMARY})
        compacted = await _compact(proxy)
        assert compacted["output"][-1]["type"] == "compaction" and compacted["usage"]["output_tokens"] > 0
        sent = small.requests[-1]["max_tokens"]
        assert sent <= 2048 and (dialect == "vllm" or sent < 2048 - 100), sent


async def test_an_answer_of_reasoning_alone_is_asked_for_once_more(sim, make_proxy):
    """All reasoning and no text: that answer is billed, then the summary is asked for again
    without the thinking switch and without a cap; the usage reported is both answers'."""
    proxy = await make_proxy({**SEAL, **PRICES, "compact": {"keep_recent_items": 1}})
    sim.script({"reasoning": "Let me think about the trip, the weather and the hotel at length."},
               {"reasoning": "Now briefly.", "text": SUMMARY})
    compacted = await _compact(proxy)
    first, again = sim.requests[-2:]
    assert first["chat_template_kwargs"] == {"enable_thinking": False} and first["max_tokens"] == 2048
    assert "chat_template_kwargs" not in again and "reasoning_effort" not in again and "max_tokens" not in again
    assert again["messages"] == first["messages"]
    rows = await proxy.ledger.list_usage()
    assert len(rows) == 2 and all(r.cost_micros > 0 for r in rows)
    usage = compacted["usage"]
    assert usage["output_tokens"] == sum(r.output_tokens for r in rows)
    assert usage["input_tokens"] == sum(r.input_tokens for r in rows)
    # The summary is the second answer's text, sealed.
    sim.script({"text": "Booked."})
    await proxy.openai().responses.create(model=MODEL, input=[*compacted["output"], {"role": "user", "content": "Go."}])
    assert {"role": "user", "content": SUMMARY_HEADER + SUMMARY} in sim.requests[-1]["messages"]


async def test_two_answers_without_text_are_a_502(sim, make_proxy, http):
    proxy = await make_proxy({**SEAL, "compact": {"keep_recent_items": 1}})
    sim.script({"reasoning": "Thinking."}, {"reasoning": "Still thinking."})
    async with http.post(proxy.url + "/v1/responses/compact", json={"model": MODEL, "input": WINDOW},
                         headers=auth(proxy.api_key)) as resp:
        assert resp.status == 502
        assert "empty summary" in (await resp.json())["error"]["message"]
    assert len(sim.requests) == 2


@pytest.mark.parametrize("body, status, param", [
    ({"input": "no model"}, 400, "model"),
    ({"model": 7, "input": "x"}, 400, "model"),
    ({"model": MODEL, "input": 7}, 400, "input"),
    ({"model": MODEL, "input": [1, 2]}, 400, "input"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
])
async def test_bad_compact_requests_are_400(sim, make_proxy, http, body, status, param):
    proxy = await make_proxy(SEAL)
    async with http.post(proxy.url + "/v1/responses/compact", json=body, headers=auth(proxy.api_key)) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["param"] == param and set(error) == {"message", "type", "param", "code"}
    assert sim.requests == []


async def test_compact_needs_the_key_and_a_seal(sim, make_proxy, http):
    proxy = await make_proxy({})
    async with http.post(proxy.url + "/v1/responses/compact", json={"model": MODEL, "input": WINDOW}) as resp:
        assert resp.status == 401
    async with http.post(proxy.url + "/v1/responses/compact", json={"model": MODEL, "input": WINDOW},
                         headers=auth(proxy.api_key)) as resp:
        assert resp.status == 501 and (await resp.json())["error"]["code"] == "compaction_unavailable"
    assert sim.requests == []


async def test_a_compaction_item_opens_only_for_its_key(sim, make_proxy, http):
    proxy = await make_proxy({**SEAL, "compact": {"keep_recent_items": 2}})
    sim.script({"text": SUMMARY})
    window = (await _compact(proxy))["output"]
    other, _ = await proxy.ledger.create_key("other", balance_micros=1_000_000)
    tampered = [*window[:-1], {**window[-1], "encrypted_content": window[-1]["encrypted_content"][:-4] + "AAAA"}]
    for key, items in ((other, window), (proxy.api_key, tampered)):
        async with http.post(proxy.url + "/v1/responses", json={"model": MODEL, "input": items},
                             headers=auth(key)) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["code"] == "invalid_encrypted_content" and error["param"] == f"input[{len(window) - 1}].encrypted_content"


def test_the_compaction_format_is_the_seals():
    assert SEAL_FORMAT == seal.PREFIX + "."


async def test_another_providers_compaction_item_is_replayed_as_a_placeholder(sim, make_proxy):
    proxy = await make_proxy({})
    item = {"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAAAABpM0Yj-opaque="}
    response = await proxy.openai().responses.create(model=MODEL, input=[item, {"role": "user", "content": "hi"}])
    assert response.status == "completed"
    assert "compaction replayed" in sim.requests[-1]["messages"][0]["content"]


async def test_the_summary_turns_notices_reach_the_compact_answer(sim, make_proxy, http):
    proxy = await make_proxy({**SEAL, "compact": {"keep_recent_items": 1}})
    sim.script({"text": SUMMARY})
    foreign = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "rp2.k1.bm90LW91cnM"}
    window = [WINDOW[0], foreign, WINDOW[1], WINDOW[2]]
    async with http.post(proxy.url + "/v1/responses/compact", json={"model": MODEL, "input": window},
                         headers=auth(proxy.api_key)) as resp:
        assert resp.status == 200
        notice = resp.headers.get("x-token-notice", "")
    assert "reasoning" in notice and "encrypted_content" in notice, notice


@pytest.mark.parametrize("stateless, status", [
    ({"previous_response_id": "refuse"}, 400),
    ({"previous_response_id": "ignore"}, 200),
    # Off, the translation still refuses it with its defaults: compact answers as HTTP does.
    ({"enabled": False, "previous_response_id": "ignore"}, 400),
])
async def test_compact_follows_the_operators_stateless_policy(sim, make_proxy, http, stateless, status):
    proxy = await make_proxy({**SEAL, "compact": {"keep_recent_items": 2}, "stateless": stateless})
    body = {"model": MODEL, "previous_response_id": "resp_1"}
    sim.script({"text": "Hi."})
    async with http.post(proxy.url + "/v1/responses", json={**body, "input": "hi"},
                         headers=auth(proxy.api_key)) as resp:
        assert resp.status == status  # the HTTP path's answer under this policy
    sim.script({"text": SUMMARY})
    async with http.post(proxy.url + "/v1/responses/compact", json={**body, "input": WINDOW},
                         headers=auth(proxy.api_key)) as resp:
        assert resp.status == status, await resp.text()
        answer = await resp.json()
    if status == 400:
        assert answer["error"]["code"] == "stateless_only" and answer["error"]["param"] == "previous_response_id"
    else:
        assert answer["object"] == "response.compaction" and answer["output"][-1]["type"] == "compaction"
        # The summary turn went without the id (nothing to continue from: the window is all).
        assert "previous_response_id" not in orjson.dumps(sim.requests[-1]).decode()
