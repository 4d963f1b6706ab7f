"""Open Responses spec clients on the real-vLLM tier: the AI SDK's Open Responses provider
(tests/clients/ai_sdk/) and tool_choice allowed_tools, through the proxy, on the tiny model
served as an org/name id."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.clients.ai_sdk import ensure_ai_sdk, run_ai_sdk
from tests.support.sdk_check import validate_spec_response
from tests.vllm.conftest import MODEL, SCRIPTED_CONTENT
from tests.vllm.test_responses import TOOLS, _check_envelope, _check_function_call

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_ai_sdk_plain_stream_and_tool_loop(proxy_single):
    root = ensure_ai_sdk()
    result = asyncio.run(run_ai_sdk(root, proxy_single.url, "x", MODEL, max_output_tokens=512, timeout=600))
    plain, stream, tools = result["plain"], result["stream"], result["tools"]
    assert "error" not in plain and SCRIPTED_CONTENT in plain["text"] and plain["modelId"] == MODEL, plain
    assert "error" not in stream and not stream["errors"] and SCRIPTED_CONTENT in stream["text"], stream
    assert stream["wireTails"][0].endswith("\n\ndata: [DONE]\n\n")
    assert "error" not in tools, tools
    first, second = tools["steps"]
    # step 1 under tool_choice "required" (a grammar: the tiny model writes a call), step 2 under "none"
    assert first["finishReason"] == "tool-calls" and [c["toolName"] for c in first["toolCalls"]] == ["get_weather"]
    assert len(tools["executed"]) == 1
    assert SCRIPTED_CONTENT in second["text"] and not second["toolCalls"]


def test_allowed_tools_required(client):
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    raw = client.responses.with_raw_response.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                                   tool_choice=choice, max_output_tokens=512)
    validate_spec_response(json.loads(raw.http_response.content))
    resp = raw.parse()
    _check_envelope(resp)
    calls = _check_function_call(resp, {"get_time"})
    assert all(c.name == "get_time" for c in calls)
    assert {t.name for t in resp.tools} == {"get_weather", "get_time"}
    assert resp.temperature == 1.0 and resp.top_p == 1.0 and resp.completed_at
