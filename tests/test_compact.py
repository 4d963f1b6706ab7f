"""POST /v1/responses/compact (Open Responses 2026-04-24): the compacted window, judged by the
spec's CompactResource (tests/sdk_check.py) and the openai SDK's `responses.compact()`, sent
back as the base input of a new response over HTTP and over the WebSocket."""

from __future__ import annotations

import base64
import os

import aiohttp
import orjson
import pytest

from proxy.protocol import seal
from proxy.protocol.compaction import SEAL_FORMAT, SUMMARY_HEADER

MODEL = "tiny-org/tiny-model"
SEAL = {"reasoning_seal": {"keys": {"k1": base64.urlsafe_b64encode(os.urandom(32)).decode()}}}
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
    assert raw.parse().object == "response.compaction"  # the SDK's CompactedResponse takes it
    return orjson.loads(raw.http_response.content)


async def test_compact_summarizes_older_items_and_keeps_recent_ones(sim, make_proxy):
    proxy = await make_proxy({**SEAL, "compact": {"keep_recent_items": 2}, "prices": {
        "default": {"input": 1_000_000, "cached_input": 1_000_000, "output": 1_000_000}}})
    sim.script({"text": SUMMARY})
    compacted = await _compact(proxy)
    item, *kept = compacted["output"]
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert SUMMARY not in item["encrypted_content"] and item["encrypted_content"].startswith("rp2.")
    # The last user message stays as it was (as an item resource); the rest is in the summary.
    assert [(k["type"], k["role"], k["content"][0]["text"]) for k in kept] == [("message", "user", "And the hotel?")]
    # The model was asked for the summary of exactly the older items.
    asked = sim.requests[-1]["messages"]
    assert asked[0] == {"role": "user", "content": "Plan three days in Lisbon."}
    assert any(m["role"] == "tool" and m["content"] == "sunny, 24C" for m in asked)
    assert "And the hotel?" not in orjson.dumps(asked).decode() and asked[-1]["content"].startswith("Summarize")
    # Billed as any request, and the usage reported is the one billed.
    usage = compacted["usage"]
    assert usage["output_tokens"] > 0 and usage["input_tokens"] > 0
    (row,) = await proxy.ledger.list_usage()
    assert (row.input_tokens, row.output_tokens) == (usage["input_tokens"], usage["output_tokens"])
    assert row.cost_micros > 0 and row.status == "completed"


async def test_a_compacted_window_continues_over_http_and_the_socket(sim, make_proxy, http):
    proxy = await make_proxy({**SEAL, "compact": {"keep_recent_items": 2}})
    sim.script({"text": SUMMARY})
    window = (await _compact(proxy))["output"]
    nxt = {"role": "user", "content": "Book it."}
    expected_head = {"role": "user", "content": SUMMARY_HEADER + SUMMARY}

    client = proxy.openai()
    sim.script({"text": "Booked."})
    response = await client.responses.create(model=MODEL, input=[*window, nxt])
    assert response.status == "completed" and response.output_text.endswith("Booked.")
    messages = sim.requests[-1]["messages"]
    assert messages[0] == expected_head
    assert [m["content"] for m in messages[1:]] == ["And the hotel?", "Book it."]

    sim.script({"text": "Booked again."})
    async with http.ws_connect(proxy.url + "/v1/responses", headers=auth(proxy.api_key)) as ws:
        await ws.send_str(orjson.dumps({"type": "response.create", "model": MODEL, "input": [*window, nxt]}).decode())
        while True:
            event = orjson.loads((await ws.receive()).data)
            if event["type"] in ("response.completed", "response.failed", "error"):
                break
    assert event["type"] == "response.completed", event
    assert sim.requests[-1]["messages"] == messages


async def test_a_short_window_comes_back_as_it_is(sim, make_proxy):
    proxy = await make_proxy(SEAL)
    compacted = await _compact(proxy, window=[{"role": "user", "content": "Just this."}])
    assert [i["content"][0]["text"] for i in compacted["output"]] == ["Just this."]
    assert compacted["usage"]["total_tokens"] == 0 and sim.requests == []


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
    tampered = [{**window[0], "encrypted_content": window[0]["encrypted_content"][:-4] + "AAAA"}, *window[1:]]
    for key, items in ((other, window), (proxy.api_key, tampered)):
        async with http.post(proxy.url + "/v1/responses", json={"model": MODEL, "input": items},
                             headers=auth(key)) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["code"] == "invalid_encrypted_content" and error["param"] == "input[0].encrypted_content"


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
        assert answer["object"] == "response.compaction" and answer["output"][0]["type"] == "compaction"
        # The summary turn went without the id (nothing to continue from: the window is all).
        assert "previous_response_id" not in orjson.dumps(sim.requests[-1]).decode()
