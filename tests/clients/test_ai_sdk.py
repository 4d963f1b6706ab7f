"""A client built on the Open Responses spec: the Vercel AI SDK with @ai-sdk/open-responses
(tests/clients/ai_sdk/), through a real proxy in front of the simulator. Installed from npm on
first use; no npm means a failure, never a skip."""

from __future__ import annotations

import re

from tests.clients.ai_sdk import ensure_ai_sdk, run_ai_sdk

MODEL = "tiny-org/tiny-model"


async def test_ai_sdk_plain_stream_and_tool_loop(sim, make_proxy):
    root = ensure_ai_sdk()
    proxy = await make_proxy()
    result = await run_ai_sdk(root, proxy.url, proxy.api_key, MODEL)

    plain = result["plain"]
    assert "error" not in plain, plain
    assert plain["text"] and plain["finishReason"] == "stop"
    assert plain["modelId"] == MODEL
    assert plain["usage"]["outputTokens"] > 0 and plain["usage"]["inputTokens"] > 0

    stream = result["stream"]
    assert "error" not in stream and not stream["errors"], stream
    assert len(stream["deltas"]) > 1 and "".join(stream["deltas"]) == stream["text"]
    assert stream["finishReason"] == "stop" and stream["usage"]["outputTokens"] > 0

    assert [tail.endswith("\n\ndata: [DONE]\n\n") for tail in stream["wireTails"]] == [True]
    assert re.search(r'"completed_at":\d+', stream["wireTails"][0])  # [DONE] right after response.completed

    tools = result["tools"]
    assert "error" not in tools, tools
    first, second = tools["steps"]
    assert first["finishReason"] == "tool-calls"
    assert [c["toolName"] for c in first["toolCalls"]] == ["get_weather"]
    assert [t["toolName"] for t in first["toolResults"]] == ["get_weather"]
    assert len(tools["executed"]) == 1
    assert second["finishReason"] == "stop" and second["text"] and not second["toolCalls"]
    assert len(tools["wireTails"]) == 2  # generateText does not stream
    # the second request carried the call and its output back, as the spec's items
    follow_up = sim.requests[-1]["messages"]
    assert any(m.get("tool_calls") for m in follow_up if m["role"] == "assistant")
    assert any(m["role"] == "tool" and "sunny, 21 C" in str(m["content"]) for m in follow_up)
