"""A `compaction_trigger` input item (Codex's remote compaction v2, the openai SDK's
CompactionTrigger) in an ordinary Responses request: answered with one `compaction` output item,
the summary of the window sealed to the key, over HTTP (JSON and events) and over the WebSocket;
the path runs every phase a Responses request runs (tests/http/test_units.py tries each) and is billed.
What Codex reads of it (codex-rs compact_remote_v2): the output_item.done of exactly one
compaction item, then response.completed with the usage."""

from __future__ import annotations

import base64
import os

import aiohttp
import orjson
import pytest

from proxy.protocol.compaction import SUMMARY_HEADER
from tests.support.sdk_check import check_sequence, parse_sse, validate_spec_ws_error

MODEL = "tiny-org/tiny-model"
SEAL = {"reasoning_seal": {"keys": {"k1": base64.urlsafe_b64encode(os.urandom(32)).decode()}}}
PRICES = {"prices": {"default": {"input": 1_000_000, "cached_input": 1_000_000, "output": 1_000_000}}}
TRIGGER = {"type": "compaction_trigger"}
WINDOW = [
    {"type": "message", "role": "developer", "content": "You are a travel agent."},
    {"role": "user", "content": "Plan three days in Lisbon."},
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\": \"Lisbon\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24C"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny: Alfama first.",
                                                          "annotations": []}]},
]
TOOLS = [{"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}]
SUMMARY = "Lisbon, three days; sunny 24C; Alfama first."
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.output_item.done",
          "response.completed"]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def _summary_asked(request: dict) -> None:
    """What the model server was asked: the window, then the instructions; thinking off, the
    proxy's own cap, the tools kept in the prompt but never to be called, the answer whole."""
    assert request["messages"][-1]["role"] == "user" and request["messages"][-1]["content"].startswith("Summarize")
    assert request["messages"][-2]["role"] == "assistant"
    assert request["chat_template_kwargs"] == {"enable_thinking": False} and request["reasoning_effort"] == "none"
    assert request["max_tokens"] == 2048 and request["stream"] is False
    assert request["tool_choice"] == "none" and [t["function"]["name"] for t in request["tools"]] == ["weather"]


async def _replayed(sim, proxy, item: dict) -> list[dict]:
    """The compaction item sent back, as Codex does (the user messages, the item, the next turn)."""
    sim.script({"text": "Booked."})
    response = await proxy.openai().responses.create(
        model=MODEL, input=[{"role": "user", "content": "Plan three days in Lisbon."}, item,
                            {"role": "user", "content": "Book it."}])
    assert response.status == "completed"
    return sim.requests[-1]["messages"]


async def test_a_compaction_trigger_is_answered_with_one_sealed_compaction_item(sim, make_proxy, http):
    proxy = await make_proxy({**SEAL, **PRICES})
    sim.script({"text": SUMMARY})
    response = await proxy.openai().responses.create(model=MODEL, input=[*WINDOW, TRIGGER], tools=TOOLS)
    assert response.status == "completed" and [i.type for i in response.output] == ["compaction"]
    item = response.output[0].model_dump()
    assert item["id"].startswith("cmp_") and item["encrypted_content"].startswith("rp2.")
    assert SUMMARY not in item["encrypted_content"]
    _summary_asked(sim.requests[-1])
    # Billed as any request; the usage shown is the one billed.
    (row,) = await proxy.ledger.list_usage()
    assert row.cost_micros > 0 and row.status == "completed"
    assert (row.input_tokens, row.output_tokens) == (response.usage.input_tokens, response.usage.output_tokens)
    # The item opens, for this key, into the summary.
    assert {"role": "user", "content": SUMMARY_HEADER + SUMMARY} in await _replayed(sim, proxy, item)


async def test_a_streamed_compaction_trigger_is_the_event_sequence_codex_reads(sim, make_proxy, http):
    proxy = await make_proxy(SEAL)
    sim.script({"text": SUMMARY})
    body = {"model": MODEL, "input": [*WINDOW, TRIGGER], "tools": TOOLS, "stream": True, "store": False,
            "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "medium", "summary": "auto"}}
    # Codex's own Accept header: events only.
    async with http.post(proxy.url + "/v1/responses", data=orjson.dumps(body),
                         headers={**auth(proxy.api_key), "Accept": "text/event-stream"}) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = parse_sse(await resp.read())
    assert [e["type"] for e in events] == EVENTS
    final = check_sequence(events)
    assert [i["type"] for i in final["output"]] == ["compaction"] and final["usage"]["output_tokens"] > 0
    assert events[3]["item"] == final["output"][0] == events[2]["item"]
    _summary_asked(sim.requests[-1])  # thinking off although the request asked for medium effort
    assert {"role": "user", "content": SUMMARY_HEADER + SUMMARY} in await _replayed(sim, proxy, final["output"][0])


async def test_a_compaction_trigger_over_the_websocket_then_the_next_turn_continues_it(sim, make_proxy, http):
    proxy = await make_proxy({**SEAL, **PRICES})
    sim.script({"text": "Sunny: Alfama first."}, {"text": SUMMARY}, {"text": "Booked."})

    async def turn(ws, body: dict) -> list[dict]:
        await ws.send_str(orjson.dumps({"type": "response.create", **body}).decode())
        events = []
        while True:
            events.append(orjson.loads((await ws.receive()).data))
            if events[-1]["type"] in ("response.completed", "response.failed", "error"):
                return events

    async with http.ws_connect(proxy.url + "/v1/responses", headers=auth(proxy.api_key)) as ws:
        first = await turn(ws, {"model": MODEL, "input": WINDOW[:4], "tools": TOOLS})
        # Codex continues its last response with only the new item: the trigger.
        compacted = await turn(ws, {"model": MODEL, "previous_response_id": first[-1]["response"]["id"],
                                    "input": [TRIGGER], "tools": TOOLS})
        assert [e["type"] for e in compacted] == EVENTS, compacted
        final = check_sequence(compacted)
        assert [i["type"] for i in final["output"]] == ["compaction"]
        assert final["previous_response_id"] == first[-1]["response"]["id"]
        _summary_asked(sim.requests[-1])
        # The next turn continues the compaction: its context is the window and the compaction
        # item (the trigger has done its work).
        after = await turn(ws, {"model": MODEL, "previous_response_id": final["id"],
                                "input": [{"role": "user", "content": "Book it."}]})
        assert after[-1]["type"] == "response.completed", after
    messages = sim.requests[-1]["messages"]
    assert messages[-2:] == [{"role": "user", "content": SUMMARY_HEADER + SUMMARY}, {"role": "user", "content": "Book it."}]
    assert len(await proxy.ledger.list_usage()) == 3


async def test_a_compaction_trigger_must_be_the_last_item(sim, make_proxy, http):
    proxy = await make_proxy(SEAL)
    body = {"model": MODEL, "input": [TRIGGER, {"role": "user", "content": "hi"}]}
    async with http.post(proxy.url + "/v1/responses", json=body, headers=auth(proxy.api_key)) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["code"] == "invalid_compaction_trigger" and error["param"] == "input[0].type"
    async with http.ws_connect(proxy.url + "/v1/responses", headers=auth(proxy.api_key)) as ws:
        await ws.send_str(orjson.dumps({"type": "response.create", **body}).decode())
        event = orjson.loads((await ws.receive()).data)
    validate_spec_ws_error(event)
    assert event["error"]["code"] == "invalid_compaction_trigger"
    assert sim.requests == []


async def test_a_compaction_trigger_needs_a_seal_key(sim, make_proxy, http):
    proxy = await make_proxy({})
    async with http.post(proxy.url + "/v1/responses", json={"model": MODEL, "input": [*WINDOW, TRIGGER]},
                         headers=auth(proxy.api_key)) as resp:
        assert resp.status == 501 and (await resp.json())["error"]["code"] == "compaction_unavailable"
    assert sim.requests == []


async def test_a_reasoning_only_answer_to_a_trigger_is_asked_for_once_more(sim, make_proxy, http):
    proxy = await make_proxy({**SEAL, **PRICES})
    sim.script({"reasoning": "Let me think about all of it."}, {"text": SUMMARY})
    body = {"model": MODEL, "input": [*WINDOW, TRIGGER], "stream": True}
    async with http.post(proxy.url + "/v1/responses", json=body, headers=auth(proxy.api_key)) as resp:
        assert resp.status == 200
        events = parse_sse(await resp.read())
    final = check_sequence(events)
    assert [i["type"] for i in final["output"]] == ["compaction"]
    assert "chat_template_kwargs" not in sim.requests[-1] and "max_tokens" not in sim.requests[-1]
    rows = await proxy.ledger.list_usage()
    assert len(rows) == 2 and final["usage"]["output_tokens"] == sum(r.output_tokens for r in rows)
    assert {"role": "user", "content": SUMMARY_HEADER + SUMMARY} in await _replayed(sim, proxy, final["output"][0])


@pytest.mark.parametrize("switch, kwargs", [("enable_thinking", {"enable_thinking": False}),
                                            ("thinking", {"thinking": False}), ("none", None)])
async def test_the_summary_is_asked_with_the_workers_own_thinking_switch(make_proxy, switch, kwargs):
    """Thinking off where the worker's template can be told (its `thinking_switch`: Qwen3's
    enable_thinking, DeepSeek V3.1's thinking, or none); reasoning_effort "none" always."""
    from proxy.simulator.server import Simulator

    async with Simulator() as sim:
        proxy = await make_proxy(SEAL, workers=[{"name": "w", "url": sim.url, "dialect": "vllm", "models": [MODEL],
                                                 "thinking_switch": switch}])
        sim.script({"text": SUMMARY})
        response = await proxy.openai().responses.create(model=MODEL, input=[*WINDOW, TRIGGER])
        assert [i.type for i in response.output] == ["compaction"]
        asked = sim.requests[-1]
    assert asked.get("chat_template_kwargs") == kwargs and asked["reasoning_effort"] == "none"


def test_the_translation_makes_a_triggered_request_the_summarys():
    from proxy.errors import APIError
    from proxy.protocol.compaction import SummaryAsk
    from proxy.protocol.translate import TranslateOptions, translate_request

    body = {"model": MODEL, "input": [*WINDOW, TRIGGER], "tools": TOOLS, "stream": True, "temperature": 0.5,
            "reasoning": {"effort": "high"}, "text": {"format": {"type": "json_object"}}, "parallel_tool_calls": True}
    t = translate_request(body, TranslateOptions(compaction=SummaryAsk("Sum it up.", 300)))
    chat = t.chat
    assert t.compaction == SummaryAsk("Sum it up.", 300) and t.stream is False and t.max_output_tokens == 300
    assert chat["messages"][-1] == {"role": "user", "content": "Sum it up."} and chat["messages"][0]["role"] == "system"
    assert chat["max_tokens"] == 300 and chat["stream"] is False and "stream_options" not in chat
    assert chat["reasoning_effort"] == "none" and chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["tool_choice"] == "none" and "parallel_tool_calls" not in chat and "response_format" not in chat
    assert chat["temperature"] == 0.5 and t.echo["reasoning"]["effort"] == "high"  # the echo is the client's
    assert t.with_cap(100).compaction == t.compaction  # the balance's copy stays a compaction
    # The client's own cap wins (and is checked as the client's); no seal key: no compaction.
    assert translate_request({**body, "max_output_tokens": 64},
                             TranslateOptions(compaction=SummaryAsk("Sum it up.", 2048))).chat["max_tokens"] == 64
    with pytest.raises(APIError) as info:
        translate_request(body)
    assert info.value.status == 501 and info.value.code == "compaction_unavailable"
    assert translate_request({**body, "input": WINDOW}).compaction is None
