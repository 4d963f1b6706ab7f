"""/v1/responses/compact, a compaction_trigger and the WebSocket transport in front of a real
vLLM 0.32 (CPU) on the tiny model (a 2048-token window, a Qwen3-style template with a thinking
switch and the qwen3 reasoning parser), with the shipped `compact` settings: a window compacted
by the model (the openai SDK's CompactedResponse: the user messages, then one compaction item)
and sent back works over HTTP and over the socket, and a socket's turns continue each other."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from tests.support.sdk_check import validate_sdk_compaction
from tests.vllm.conftest import MODEL, SCRIPTED_CONTENT

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

WINDOW = [
    {"role": "user", "content": "Plan three days in Lisbon."},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Day one: Alfama.", "annotations": []}]},
    {"role": "user", "content": "And the hotel?"},
]


async def _ws_turn(ws, body: dict) -> dict:
    await ws.send_str(orjson.dumps({"type": "response.create", **body}).decode())
    while True:
        event = orjson.loads((await ws.receive()).data)
        if event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return event


def test_compacted_window_continues_over_http_and_the_socket(proxy_sealed):
    client = proxy_sealed.client()
    compacted = client.responses.compact(model=MODEL, input=WINDOW)
    assert compacted.object == "response.compaction" and compacted.usage.output_tokens > 0
    raw = client.responses.with_raw_response.compact(model=MODEL, input=WINDOW)
    answer = orjson.loads(raw.http_response.content)
    validate_sdk_compaction(answer)  # the openai SDK's own types
    window = answer["output"]
    assert [m["content"][0]["text"] for m in window[:-1]] == ["Plan three days in Lisbon.", "And the hotel?"]
    assert window[-1]["type"] == "compaction"
    nxt = {"role": "user", "content": "Book it."}
    response = client.responses.create(model=MODEL, input=[*window, nxt], max_output_tokens=64)
    assert response.status in ("completed", "incomplete") and response.usage.input_tokens > 0

    async def over_the_socket() -> tuple[dict, dict]:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(proxy_sealed.url + "/v1/responses") as ws:
                first = await _ws_turn(ws, {"model": MODEL, "input": [*window, nxt], "max_output_tokens": 64})
                second = await _ws_turn(ws, {"model": MODEL, "previous_response_id": first["response"]["id"],
                                             "input": "Thanks.", "max_output_tokens": 64})
                return first, second

    first, second = asyncio.run(over_the_socket())
    assert first["type"] == "response.completed", first
    assert SCRIPTED_CONTENT in first["response"]["output"][-1]["content"][0]["text"]
    assert second["type"] == "response.completed" and second["response"]["previous_response_id"] == first["response"]["id"]
    # The continuation carried the whole context: more input than the first turn's.
    assert second["response"]["usage"]["input_tokens"] > first["response"]["usage"]["input_tokens"]


def test_a_compaction_trigger_is_summarized_with_thinking_off(proxy_sealed):
    """A compaction_trigger (Codex's remote compaction v2) with the shipped settings on the
    2048-token model: one compaction item, the summary written with the thinking switch off (the
    tiny model then answers its content and no reasoning), over HTTP as JSON and as events."""
    client = proxy_sealed.client()
    response = client.responses.create(model=MODEL, input=[*WINDOW, {"type": "compaction_trigger"}])
    assert response.status == "completed" and [i.type for i in response.output] == ["compaction"]
    assert response.usage.output_tokens > 0 and response.usage.output_tokens_details.reasoning_tokens == 0
    item = response.output[0].model_dump()
    with client.responses.create(model=MODEL, input=[*WINDOW, {"type": "compaction_trigger"}], stream=True) as stream:
        types = [event.type for event in stream]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.output_item.done", "response.completed"], types
    # Sent back as Codex does: the user messages, the compaction item, the next message.
    nxt = client.responses.create(model=MODEL, input=[WINDOW[0], WINDOW[2], item, {"role": "user", "content": "Book it."}],
                                  max_output_tokens=64)
    assert nxt.status in ("completed", "incomplete") and nxt.usage.input_tokens > 0
