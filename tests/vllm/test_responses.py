"""The Responses API through the proxy, in front of one real vLLM 0.32 (CPU) on the tiny model.

The tiny model (scripts/vllm_tier/build_tiny_model.py) answers every unconstrained prompt with
reasoning "Let me think about it" then "Hello! I am a tiny test model." and stops; under a
grammar (tool_choice required / named, json_schema) it writes random but short JSON.
"""
from __future__ import annotations

import json
import uuid

import openai
import pytest

import servers
from tests.vllm.conftest import MAX_MODEL_LEN, MODEL, SCRIPTED_CONTENT, SCRIPTED_REASONING

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME_TOOL = {
    "type": "function",
    "name": "get_time",
    "description": "Get the time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"],
                   "additionalProperties": False},
    "strict": True,
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


def _as_chat_tools(tools):
    """The chat-completions form of Responses function tools (strict rides along, as OpenAI's does)."""
    return [{"type": "function",
             "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}}
            for t in tools]


def _items(resp, kind):
    return [item for item in resp.output if item.type == kind]


def _check_envelope(resp, status="completed"):
    assert resp.object == "response"
    assert resp.id.startswith("resp_")
    assert resp.model == MODEL
    assert resp.status == status, resp.model_dump_json(indent=1)
    assert resp.usage is not None
    assert resp.usage.input_tokens > 0
    assert resp.usage.output_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def _vllm_tokenize(url: str, messages: list, tools: list | None = None) -> int:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    if tools:
        body["tools"] = tools
    status, data = servers.http_post_json(url + "/tokenize", body)
    assert status == 200, data
    return data["count"]


# ---------------------------------------------------------------------------------------------

def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids
    assert "/" in MODEL  # served under an org/name id (--served-model-name), as Hugging Face names are


def test_text(client):
    resp = client.responses.create(model=MODEL, input="What is the weather in Paris?")
    _check_envelope(resp)
    assert SCRIPTED_CONTENT in resp.output_text
    messages = _items(resp, "message")
    assert len(messages) == 1 and messages[0].role == "assistant" and messages[0].status == "completed"
    assert messages[0].content[0].type == "output_text"


def test_text_with_instructions_and_message_list(client):
    resp = client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]},
               {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "What is the time in Tokyo?"}],
        max_output_tokens=64,
    )
    _check_envelope(resp)
    assert SCRIPTED_CONTENT in resp.output_text
    assert resp.instructions == "Answer briefly."
    assert resp.max_output_tokens == 64


def test_streaming(client):
    deltas, types = [], []
    with client.responses.stream(model=MODEL, input="Tell me a story.") as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"
    assert "response.output_text.done" in types
    _check_envelope(final)
    assert "".join(deltas) == final.output_text
    assert SCRIPTED_CONTENT in final.output_text


def test_truncation_at_max_output_tokens(client):
    resp = client.responses.create(model=MODEL, input="Write a long essay.", max_output_tokens=5)
    _check_envelope(resp, status="incomplete")
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5
    assert resp.max_output_tokens == 5


def test_truncation_streaming(client):
    # The SDK's get_final_response() wants response.completed; the terminal event carries the response.
    with client.responses.stream(model=MODEL, input="Write a long essay.", max_output_tokens=5) as stream:
        events = list(stream)
    types = [event.type for event in events]
    assert types[-1] == "response.incomplete"
    assert "response.completed" not in types
    final = events[-1].response
    assert final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"


def _check_function_call(resp, names):
    calls = _items(resp, "function_call")
    assert calls, resp.model_dump_json(indent=1)
    for call in calls:
        assert call.name in names
        assert call.call_id
        args = json.loads(call.arguments)
        assert isinstance(args, dict)
    return calls


def test_tool_choice_required(client):
    resp = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                   tool_choice="required", max_output_tokens=512)
    _check_envelope(resp)
    _check_function_call(resp, {"get_weather", "get_time"})
    assert resp.tool_choice == "required"
    assert {t.name for t in resp.tools} == {"get_weather", "get_time"}


def test_tool_choice_named_function(client):
    resp = client.responses.create(model=MODEL, input="What time is it in Tokyo?", tools=TOOLS,
                                   tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=512)
    _check_envelope(resp)
    calls = _check_function_call(resp, {"get_time"})
    assert all(c.name == "get_time" for c in calls)


def test_tool_choice_required_streaming(client):
    arg_done = []
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                 tool_choice="required", max_output_tokens=512) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.done":
                arg_done.append(event.arguments)
        final = stream.get_final_response()
    _check_envelope(final)
    calls = _check_function_call(final, {"get_weather", "get_time"})
    assert arg_done and [json.loads(a) for a in arg_done] == [json.loads(c.arguments) for c in calls]


def test_tool_result_round_trip(client):
    """A second turn carrying the call and its output is accepted by vLLM's template."""
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=512)
    call = _check_function_call(first, {"get_weather"})[0]
    resp = client.responses.create(
        model=MODEL, tools=TOOLS, max_output_tokens=64,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
    )
    _check_envelope(resp)
    assert SCRIPTED_CONTENT in resp.output_text


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["answer", "n"], "additionalProperties": False}
    resp = client.responses.create(
        model=MODEL, input="Answer in JSON.", max_output_tokens=512,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )
    # A random model under a grammar: only that the request was accepted and the answer is well formed.
    assert resp.status in ("completed", "incomplete"), resp.model_dump_json(indent=1)
    assert resp.text.format.type == "json_schema"
    if resp.status == "completed":
        value = json.loads(resp.output_text)
        assert isinstance(value, dict) and set(value) == {"answer", "n"}


def test_reasoning_effort_high(client):
    resp = client.responses.create(model=MODEL, input="Think hard: what is 2+2?",
                                   reasoning={"effort": "high"}, max_output_tokens=128)
    _check_envelope(resp)
    assert SCRIPTED_CONTENT in resp.output_text
    reasoning = _items(resp, "reasoning")
    assert reasoning, "vLLM (qwen3 parser) returned reasoning but the response has no reasoning item"
    assert SCRIPTED_REASONING in reasoning[0].model_dump_json()
    assert resp.output.index(reasoning[0]) < resp.output.index(_items(resp, "message")[0])
    assert resp.usage.output_tokens_details.reasoning_tokens > 0


def test_cached_tokens_on_repeated_long_prompt(client):
    # A fresh prefix (so earlier tests cannot have warmed it) of several hundred tokens; vLLM's
    # CPU prefix cache works in blocks of 128 tokens.
    salt = uuid.uuid4().hex
    instructions = f"Session {salt}. " + " ".join(
        f"Rule {i}: answer questions about the weather in city number {i} politely." for i in range(40))
    usages = []
    for _ in range(2):
        resp = client.responses.create(model=MODEL, instructions=instructions, input="hi", max_output_tokens=8)
        assert resp.status in ("completed", "incomplete")
        usages.append(resp.usage)
    assert usages[0].input_tokens > 256
    assert usages[1].input_tokens == usages[0].input_tokens
    assert usages[1].input_tokens_details.cached_tokens > 0
    assert usages[1].input_tokens_details.cached_tokens <= usages[1].input_tokens


@pytest.mark.parametrize("with_tools", [False, True], ids=["plain", "tools"])
def test_input_tokens_count_equals_vllm_tokenize(client, proxy_single, with_tools):
    kwargs = {"model": MODEL, "instructions": "Be brief.", "input": "Hello, who are you?"}
    if with_tools:
        kwargs["tools"] = TOOLS
    counted = client.responses.input_tokens.count(**kwargs)
    assert counted.object == "response.input_tokens"
    expected = _vllm_tokenize(proxy_single.workers["vllm-a"].url,
                              [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hello, who are you?"}],
                              _as_chat_tools(TOOLS) if with_tools else None)
    # A generation of the same request: vLLM's own prompt size for what the proxy really sent.
    resp = client.responses.create(max_output_tokens=8, **kwargs)
    assert counted.input_tokens == resp.usage.input_tokens
    assert counted.input_tokens == expected


def test_input_tokens_raw_endpoint(proxy_single):
    status, data = servers.http_post_json(proxy_single.url + "/v1/responses/input_tokens",
                                          {"model": MODEL, "input": "Hello, who are you?"})
    assert status == 200, data
    expected = _vllm_tokenize(proxy_single.workers["vllm-a"].url, [{"role": "user", "content": "Hello, who are you?"}])
    assert data == {"object": "response.input_tokens", "input_tokens": expected}


def test_context_window_exceeded(client, proxy_single):
    text = "hello world " * 1500
    assert _vllm_tokenize(proxy_single.workers["vllm-a"].url, [{"role": "user", "content": text}]) > MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=text, max_output_tokens=16)
    assert err.value.status_code == 400
    assert err.value.code == "context_length_exceeded", err.value.body


def test_context_window_exceeded_streaming(client):
    with pytest.raises(openai.BadRequestError) as err:
        with client.responses.stream(model=MODEL, input="hello world " * 1500, max_output_tokens=16) as stream:
            for _ in stream:
                pass
    assert err.value.code == "context_length_exceeded", err.value.body


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="no-such-model", input="hi")
    assert err.value.status_code == 404
