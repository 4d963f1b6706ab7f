"""/v1/responses/compact and the WebSocket transport in front of a real vLLM 0.32 (CPU) on the
tiny model: a window compacted by the model and sent back works over HTTP and over the socket,
and a socket's turns continue each other."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

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
    window = orjson.loads(raw.http_response.content)["output"]
    assert window[0]["type"] == "compaction" and window[-1]["content"][0]["text"] == "And the hotel?"
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
