"""End to end: the openai SDK -> the proxy -> the simulator, over real HTTP on loopback.

The simulator is scripted per request (sim.script) and records what it received
(sim.requests), so each test checks both what the client got and what the upstream saw.
"""

from __future__ import annotations


import aiohttp
import openai
import orjson
import pytest

from tests.support.sdk_check import check_sequence, normalise, parse_sse, validate_response, validate_sdk_response
from tests.conftest import eventually, only

NO_AUTH = only("stateless")

WEATHER = {
    "type": "function", "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}


async def raw_stream(proxy, body: dict) -> tuple[int, dict, list[dict]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json={**body, "stream": True},
                             headers={"Authorization": f"Bearer {proxy.api_key}"}) as resp:
            raw = await resp.read()
            return resp.status, dict(resp.headers), parse_sse(raw) if resp.status == 200 else orjson.loads(raw)


async def test_plain_text_json(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    sim.script({"text": "The capital of France is Paris."})
    response = await proxy.openai().responses.create(model="tiny-org/tiny-model", input="What is the capital of France?")
    assert response.output_text == "The capital of France is Paris."
    assert response.status == "completed" and response.model == "tiny-org/tiny-model"
    assert response.id.startswith("resp_")
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    extra = response.model_extra or {}
    assert extra.get("ai_generated") is True and extra.get("ai_notice")
    assert sim.requests[-1]["messages"] == [{"role": "user", "content": "What is the capital of France?"}]


async def test_vendor_prefix_is_stripped_and_model_echoed(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    sim.script({"text": "ok"})
    response = await proxy.openai().responses.create(model="acme/tiny-org/tiny-model", input="hi")
    assert response.model == "acme/tiny-org/tiny-model"
    assert sim.requests[-1]["model"] == "tiny-org/tiny-model"


async def test_instructions_and_developer_merge_into_one_system_message(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    sim.script({"text": "ok"})
    await proxy.openai().responses.create(
        model="tiny-org/tiny-model", instructions="Be brief.",
        input=[{"role": "developer", "content": "Use French."}, {"role": "user", "content": "Hello"}])
    messages = sim.requests[-1]["messages"]
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == "Be brief.\n\nUse French."


async def test_stream_events_validate_and_equal_the_json_answer(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    script = {"reasoning": "Think about it.", "text": "Hello there, friend."}
    sim.script(script, script)
    body = {"model": "tiny-org/tiny-model", "input": "hi"}
    status, headers, events = await raw_stream(proxy, body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    final = check_sequence(events)
    assert events[0]["response"].get("ai_generated") is True
    types = [e["type"] for e in events]
    assert "response.reasoning_summary_text.delta" in types and "response.output_text.delta" in types
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json=body) as resp:
            json_answer = await resp.json()
    validate_response(json_answer)
    assert normalise(final) == normalise(json_answer)


async def test_sdk_stream_accumulator_accepts_the_stream(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    sim.script({"reasoning": "Hmm.", "text": "One, two, three."})
    async with proxy.openai().responses.stream(model="tiny-org/tiny-model", input="Count to three.") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == "One, two, three."
    assert final.output_text == "One, two, three."
    assert final.output[0].type == "reasoning"
    assert final.output[0].summary[0].text == "Hmm."


async def test_tool_loop(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    client = proxy.openai()
    sim.script({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})
    first = await client.responses.create(model="tiny-org/tiny-model", input="Weather in Paris?", tools=[WEATHER])
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert orjson.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("fc_") and calls[0].call_id

    sim.script({"text": "It is sunny in Paris."})
    follow_up = [{"role": "user", "content": "Weather in Paris?"},
                 calls[0].model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21C"}]
    second = await client.responses.create(model="tiny-org/tiny-model", input=follow_up, tools=[WEATHER])
    assert second.output_text == "It is sunny in Paris."
    upstream = sim.requests[-1]["messages"]
    assert [m["role"] for m in upstream] == ["user", "assistant", "tool"]
    assert upstream[1]["tool_calls"][0]["id"] == calls[0].call_id
    assert upstream[2] == {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21C"}


async def test_parallel_calls_stream(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    time_tool = {**WEATHER, "name": "get_time"}
    sim.script({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                               {"name": "get_time", "arguments": {"city": "Rome"}}]})
    status, _, events = await raw_stream(proxy, {"model": "tiny-org/tiny-model", "input": "both", "tools": [WEATHER, time_tool]})
    final = check_sequence(events)
    calls = [item for item in final["output"] if item["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls}) == 2 and len({c["call_id"] for c in calls}) == 2
    done = [e for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert all(orjson.loads(e["item"]["arguments"]) for e in done)


async def test_custom_tool_round_trip(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    patch_tool = {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
                  "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/s"}}
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    sim.script({"tool_calls": [{"name": "apply_patch", "arguments": {"input": patch}}]})
    first = await proxy.openai().responses.create(model="tiny-org/tiny-model", input="patch it", tools=[patch_tool])
    call = [i for i in first.output if i.type == "custom_tool_call"][0]
    assert call.name == "apply_patch" and call.input == patch
    sim.script({"text": "done"})
    await proxy.openai().responses.create(model="tiny-org/tiny-model", tools=[patch_tool], input=[
        {"role": "user", "content": "patch it"}, call.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Success"}])
    upstream = sim.requests[-1]
    assert upstream["tools"][0]["function"]["name"] == "apply_patch"
    assistant = upstream["messages"][1]
    assert orjson.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"input": patch}
    assert upstream["messages"][2]["role"] == "tool"


async def test_namespace_tool_round_trip(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                 "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]}
    sim.script({"tool_calls": [{"name": "multi_agent_v1__spawn_agent", "arguments": {}}]})
    status, _, events = await raw_stream(proxy, {"model": "tiny-org/tiny-model", "input": "go", "tools": [namespace]})
    final = check_sequence(events)
    call = [i for i in final["output"] if i["type"] == "function_call"][0]
    assert call["name"] == "spawn_agent" and call["namespace"] == "multi_agent_v1"
    assert sim.requests[-1]["tools"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    sim.script({"text": "ok"})
    await proxy.openai().responses.create(model="tiny-org/tiny-model", tools=[namespace], input=[
        {"role": "user", "content": "go"}, call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "spawned"}])
    assert sim.requests[-1]["messages"][1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"


async def test_truncation_is_incomplete(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    long_text = " ".join(f"word{i}" for i in range(50))
    sim.script({"text": long_text}, {"text": long_text})
    body = {"model": "tiny-org/tiny-model", "input": "talk", "max_output_tokens": 5}
    status, _, events = await raw_stream(proxy, body)
    assert events[-1]["type"] == "response.incomplete"
    final = check_sequence(events)
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert sim.requests[-1]["max_tokens"] == 5
    response = await proxy.openai().responses.create(**body)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


async def test_mid_stream_error_is_response_failed(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    sim.script({"text": "one two three four five six", "error_after": 2})
    status, _, events = await raw_stream(proxy, {"model": "tiny-org/tiny-model", "input": "x"})
    assert status == 200
    final = check_sequence(events)
    assert events[-1]["type"] == "response.failed"
    assert final["status"] == "failed" and final["error"]["message"]
    assert "retry_after_ms" in final and "x_should_retry" in final


async def test_client_disconnect_cancels_upstream(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    sim.script({"text": " ".join(["slow"] * 200), "delay": 0.05})
    async with aiohttp.ClientSession() as http:
        resp = await http.post(proxy.url + "/v1/responses", json={"model": "tiny-org/tiny-model", "input": "x", "stream": True})
        seen = b""
        while b"response.output_text.delta" not in seen:
            seen += await resp.content.readany()
        resp.close()  # vanish mid-stream
    await eventually(lambda: sim.cancelled, what="the upstream request cancelled")
    assert sim.cancelled == 1
    assert sim.in_flight == 0


async def test_errors_are_envelopes(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    async with aiohttp.ClientSession() as http:
        cases = [
            (b"{not json", 400, "invalid_json"),
            (b"[1, 2]", 400, "invalid_json"),
            (orjson.dumps({"model": "tiny-org/tiny-model"}), 400, None),
            (orjson.dumps({"model": "nope", "input": "hi"}), 404, "model_not_found"),
            (orjson.dumps({"model": "tiny-org/tiny-model", "input": "hi", "previous_response_id": "resp_1"}), 400,
             "stateless_only"),
            (orjson.dumps({"model": "tiny-org/tiny-model", "input": [{"type": "mystery_item"}]}), 400, None),
        ]
        for body, status, code in cases:
            async with http.post(proxy.url + "/v1/responses", data=body,
                                 headers={"Content-Type": "application/json"}) as resp:
                data = await resp.json()
                assert resp.status == status, (body, data)
                assert set(data["error"]) == {"message", "type", "param", "code"}
                if code:
                    assert data["error"]["code"] == code
        async with http.get(proxy.url + "/nowhere") as resp:
            assert resp.status == 404 and "error" in await resp.json()


async def test_sdk_raises_the_right_exception_classes(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    client = proxy.openai()
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="missing-model", input="hi")
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="tiny-org/tiny-model", input="hi", previous_response_id="resp_x")
    assert caught.value.code == "stateless_only"


async def test_upstream_unreachable_is_502(make_proxy):
    # Active checks off: with them, a worker down at start-up is never tried (503, tests/upstream/test_startup_health.py).
    proxy = await make_proxy({**NO_AUTH, "health": {"enabled": False}}, workers=[{"name": "dead", "url": "http://127.0.0.1:9", "models": ["tiny-org/tiny-model"],
                                                "timeouts": {"connect": 1, "first_byte": 2}}])
    with pytest.raises(openai.InternalServerError) as caught:
        await proxy.openai().responses.create(model="tiny-org/tiny-model", input="hi")
    assert caught.value.status_code == 502


async def test_first_byte_timeout_is_504(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH, workers=[{"name": "slow", "url": sim.url, "models": ["tiny-org/tiny-model"],
                                                "timeouts": {"connect": 1, "first_byte": 0.5, "idle": 5}}])
    sim.script({"text": "late", "first_byte_delay": 3})
    with pytest.raises(openai.APIStatusError) as caught:
        await proxy.openai().responses.create(model="tiny-org/tiny-model", input="hi", stream=True)
    assert caught.value.status_code == 504


async def test_models_and_input_tokens(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    client = proxy.openai()
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-org/tiny-model"]
    counted = await client.responses.input_tokens.count(model="tiny-org/tiny-model", input="hello there")
    assert counted.input_tokens > 0
    sim.script({"text": "ok"})
    answered = await client.responses.create(model="tiny-org/tiny-model", input="hello there")
    assert counted.input_tokens == answered.usage.input_tokens
    validate_sdk_response(answered.model_dump(mode="json"))


async def test_line_separator_characters_survive_the_stream(sim, make_proxy):
    # JSON strings may carry U+2028, U+2029 and U+0085 raw; SSE lines end only at CR/LF.
    proxy = await make_proxy(NO_AUTH)
    text = "a\u2028b\u2029c\x85d"
    sim.script({"text": text, "chunk_chars": 2}, {"text": text, "chunk_chars": 2})
    status, _, events = await raw_stream(proxy, {"model": "tiny-org/tiny-model", "input": "x", "instructions": "i\u2028j"})
    final = check_sequence(events)
    assert final["output"][-1]["content"][0]["text"] == text and final["instructions"] == "i\u2028j"
    async with proxy.openai().responses.stream(model="tiny-org/tiny-model", input="x") as stream:
        assert (await stream.get_final_response()).output_text == text
