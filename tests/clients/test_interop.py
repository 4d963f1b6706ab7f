"""Interoperability with clients that follow the Open Responses specification (openresponses.org)
and with model servers that serve Hugging Face org/name ids (issue 14)."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from proxy.ledger import KeyLimits
from proxy.protocol.models import resolve_model
from proxy.simulator.server import Simulator
from tests.conftest import only

NO_AUTH = only("stateless")
TIMEOUTS = {"connect": 2, "first_byte": 10, "idle": 10, "total": 60}


def sim_worker(name: str, sim: Simulator, models: list[str]) -> dict:
    return {"name": name, "url": sim.url, "dialect": "vllm", "models": models, "timeouts": TIMEOUTS}


async def post(proxy, body: dict, key: str | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json=body,
                             headers={"Authorization": f"Bearer {key or proxy.api_key}"}) as resp:
            return resp.status, orjson.loads(await resp.read())


# --------------------------------------------------------------------------- model names


def test_resolve_model_rule():
    served = {"Qwen/Qwen3-8B", "tiny-model"}
    assert resolve_model("Qwen/Qwen3-8B", served) == "Qwen/Qwen3-8B"
    assert resolve_model("openai/tiny-model", served) == "tiny-model"
    assert resolve_model("hf/Qwen/Qwen3-8B", served) == "Qwen/Qwen3-8B"
    assert resolve_model("Qwen3-8B", served) is None  # nothing is ever added, only one segment stripped
    assert resolve_model("x/y/tiny-model", served) is None
    assert resolve_model("tiny-model", served.__contains__) == "tiny-model"


async def test_hugging_face_name_is_served_and_echoed(make_proxy):
    async with Simulator(models=("Qwen/Qwen3-8B",)) as qwen:
        proxy = await make_proxy(NO_AUTH, workers=[sim_worker("qwen", qwen, ["Qwen/Qwen3-8B"])])
        models = await proxy.openai().models.list()
        assert [m.id for m in models.data] == ["Qwen/Qwen3-8B"]
        status, body = await post(proxy, {"model": "Qwen/Qwen3-8B", "input": "hi"})
        assert status == 200, body
        assert body["model"] == "Qwen/Qwen3-8B" and body["status"] == "completed"
        assert qwen.requests[-1]["model"] == "Qwen/Qwen3-8B"
        # a vendor prefix in front of the org/name id is stripped (the exact name is served by nobody)
        status, body = await post(proxy, {"model": "hf/Qwen/Qwen3-8B", "input": "hi"})
        assert status == 200, body
        assert body["model"] == "hf/Qwen/Qwen3-8B"
        assert qwen.requests[-1]["model"] == "Qwen/Qwen3-8B"
        status, body = await post(proxy, {"model": "Qwen3-8B", "input": "hi"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert "'Qwen3-8B'" in body["error"]["message"]
        counted = await proxy.openai().responses.input_tokens.count(model="Qwen/Qwen3-8B", input="hello there")
        assert counted.input_tokens > 0


async def test_exact_name_wins_over_the_stripped_one(make_proxy):
    async with Simulator(models=("org/m",)) as org, Simulator(models=("m",)) as bare:
        proxy = await make_proxy(NO_AUTH, workers=[sim_worker("org", org, ["org/m"]), sim_worker("bare", bare, ["m"])])
        assert (await post(proxy, {"model": "org/m", "input": "hi"}))[0] == 200
        assert len(org.requests) == 1 and not bare.requests
        status, body = await post(proxy, {"model": "other/m", "input": "hi"})
        assert status == 200 and body["model"] == "other/m"
        assert len(bare.requests) == 1 and bare.requests[-1]["model"] == "m"


async def test_key_allowed_models_follow_the_same_rule(make_proxy):
    async with Simulator(models=("Qwen/Qwen3-8B", "other/Qwen3-8B")) as qwen:
        proxy = await make_proxy(workers=[sim_worker("qwen", qwen, ["Qwen/Qwen3-8B", "other/Qwen3-8B"])])
        secret, _ = await proxy.ledger.create_key("k", balance_micros=10_000_000,
                                                  limits=KeyLimits(allowed_models=["Qwen/Qwen3-8B"]))
        assert (await post(proxy, {"model": "Qwen/Qwen3-8B", "input": "hi"}, secret))[0] == 200
        assert (await post(proxy, {"model": "hf/Qwen/Qwen3-8B", "input": "hi"}, secret))[0] == 200
        # the same last segment is another model: not allowed
        status, body = await post(proxy, {"model": "other/Qwen3-8B", "input": "hi"}, secret)
        assert status == 403 and body["error"]["code"] == "model_not_allowed"


def test_default_simulator_model_is_an_org_name_id():
    from proxy.config.load import DEFAULTS

    assert DEFAULTS["simulator"]["model"] == "tiny-org/tiny-model"
    assert DEFAULTS["workers"][0]["models"] == ["tiny-org/tiny-model"]
    assert tuple(Simulator().state.models) == ("tiny-org/tiny-model",)


# --------------------------------------------------------------------------- the rewriter (unit)


def _tool_stream(names: list[str]) -> bytes:
    from tests.protocol.test_rewriter import USAGE, chunk, sse

    parts = [chunk({"role": "assistant", "content": ""})]
    for i, name in enumerate(names):
        parts.append(chunk({"tool_calls": [{"index": i, "id": f"call_{i}", "type": "function",
                                            "function": {"name": name, "arguments": ""}}]}))
        parts.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": '{"city": "Paris"}'}}]}))
    parts.append(chunk({}, "tool_calls"))
    parts.append(chunk(None, None, usage=USAGE, choices=False))
    return sse(*parts)


def _completion(names: list[str]) -> dict:
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": '{"city": "Paris"}'}}
             for i, n in enumerate(names)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": calls},
                         "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


@pytest.mark.parametrize("runs", [True, False])
def test_a_call_outside_allowed_tools_never_reaches_the_client(runs):
    from tests.protocol.test_rewriter import COMPLETED_AT, ctx, parse, run, sdk_check

    c = ctx(allowed_tools=frozenset({"get_time"}))
    out, rw = run([_tool_stream(["get_weather", "get_time", "get_weather"])], c, runs=runs)
    assert b"get_weather" not in out
    events = parse(out)
    sdk_check(events)
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["completed_at"] == COMPLETED_AT
    assert [(i["type"], i["name"]) for i in final["output"]] == [("function_call", "get_time")]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0]
    # without the limit, all three reach the client
    out, _ = run([_tool_stream(["get_weather", "get_time", "get_weather"])], ctx(), runs=runs)
    assert [i["name"] for i in parse(out)[-1]["response"]["output"]] == ["get_weather", "get_time", "get_weather"]


def test_a_call_outside_allowed_tools_is_dropped_from_a_non_stream_answer():
    from proxy.protocol.rewriter import response_from_completion
    from tests.protocol.test_rewriter import ctx

    r = response_from_completion(ctx(allowed_tools=frozenset({"get_time"}), clock=lambda: 1_800_000_000),
                                 _completion(["get_weather", "get_time"]))
    assert [i["name"] for i in r["output"]] == ["get_time"]
    assert r["status"] == "completed" and r["completed_at"] == 1_800_000_000
    r = response_from_completion(ctx(allowed_tools=frozenset()), _completion(["get_weather"]))
    assert r["output"] == [] and r["status"] == "completed"
    # a choice other than 0 in front
    odd = _completion(["get_weather", "get_time"])
    odd["choices"].insert(0, dict(odd["choices"][0], index=1))
    r = response_from_completion(ctx(allowed_tools=frozenset({"get_time"})), odd)
    assert "get_weather" not in orjson.dumps(r).decode()


def test_completed_at_only_on_completed_responses():
    from tests.protocol.test_rewriter import COMPLETED_AT, USAGE, chunk, ctx, parse, run, sse

    out, _ = run([sse(chunk({"content": "Hi"}), chunk({}, "length"), chunk(None, usage=USAGE, choices=False))])
    assert parse(out)[-1]["response"]["status"] == "incomplete"
    assert parse(out)[-1]["response"]["completed_at"] is None
    out, _ = run([sse(chunk({"content": "Hi"}), chunk({}, "stop"))])
    assert parse(out)[-1]["response"]["completed_at"] == COMPLETED_AT
    assert out.endswith(b"\n\ndata: [DONE]\n\n") and out.count(b"[DONE]") == 1
    _, rw = run([sse(chunk({"content": "Hi"}), done=False)], ctx(), finish=False)
    assert not rw.done
    failed = rw.fail("gone")
    assert failed.endswith(b"\n\ndata: [DONE]\n\n")


# --------------------------------------------------------------------------- through the proxy (HTTP)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"type": "function", "name": "get_time", "description": "Time",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def stream(proxy, body: dict) -> bytes:
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json=dict(body, stream=True),
                             headers={"Authorization": f"Bearer {proxy.api_key}"}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.read()


async def test_sampling_values_are_numbers_and_penalties_reach_the_model(sim, make_proxy):
    from tests.support.sdk_check import check_sequence, parse_sse, validate_response

    proxy = await make_proxy(NO_AUTH)
    status, body = await post(proxy, {"model": "tiny-org/tiny-model", "input": "hi"})
    assert status == 200
    validate_response(body)
    assert (body["temperature"], body["top_p"], body["presence_penalty"], body["frequency_penalty"],
            body["top_logprobs"]) == (1.0, 1.0, 0.0, 0.0, 0)
    assert isinstance(body["completed_at"], int) and body["completed_at"] >= body["created_at"]
    upstream = sim.requests[-1]
    assert not {"temperature", "top_p", "presence_penalty", "frequency_penalty", "logprobs"} & upstream.keys()

    asked = {"temperature": 0.3, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_logprobs": 0}
    status, body = await post(proxy, {"model": "tiny-org/tiny-model", "input": "hi", **asked})
    assert status == 200 and {k: body[k] for k in asked} == asked
    upstream = sim.requests[-1]
    assert (upstream["presence_penalty"], upstream["frequency_penalty"]) == (0.5, -0.5)
    assert "logprobs" not in upstream and "top_logprobs" not in upstream

    events = parse_sse(await stream(proxy, {"model": "tiny-org/tiny-model", "input": "hi", **asked}))
    final = check_sequence(events)
    assert {k: final[k] for k in asked} == asked and isinstance(final["completed_at"], int)
    assert events[0]["response"]["completed_at"] is None  # not completed yet


async def test_streams_end_with_done_after_the_terminal_event(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    raw = await stream(proxy, {"model": "tiny-org/tiny-model", "input": "hi"})
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and raw.count(b"data: [DONE]") == 1
    last_event = raw[: -len(b"data: [DONE]\n\n")].rsplit(b"\n\n", 2)[-2]
    assert last_event.startswith(b"event: response.completed\n")
    sim.script({"text": "a b c d e f", "error_after": 2})
    raw = await stream(proxy, {"model": "tiny-org/tiny-model", "input": "hi"})
    assert b"event: response.failed\n" in raw and raw.endswith(b"}\n\ndata: [DONE]\n\n")


@pytest.mark.parametrize("streamed", [False, True])
async def test_allowed_tools_is_a_hard_limit(sim, make_proxy, streamed):
    from tests.support.sdk_check import check_sequence, parse_sse, validate_response

    proxy = await make_proxy(NO_AUTH)
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_time"}]}
    body = {"model": "tiny-org/tiny-model", "input": "Weather and time in Paris?", "tools": [WEATHER, TIME],
            "tool_choice": choice}
    # the model calls a tool it was not allowed (and was not shown) next to an allowed one
    sim.script({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                               {"name": "get_time", "arguments": {"city": "Paris"}}]})
    if streamed:
        events = parse_sse(await stream(proxy, body))
        # only the echoed `tools` of the response envelopes name it; no item or delta does
        assert not [e for e in events if "response" not in e and "get_weather" in orjson.dumps(e).decode()]
        final = check_sequence(events)
        added = [e["item"]["name"] for e in events if e["type"] == "response.output_item.added"]
        assert added == ["get_time"]
    else:
        status, final = await post(proxy, body)
        assert status == 200
        validate_response(final)
    assert [(i["type"], i["name"]) for i in final["output"]] == [("function_call", "get_time")]
    assert final["tool_choice"] == choice and [t["name"] for t in final["tools"]] == ["get_weather", "get_time"]
    upstream = sim.requests[-1]
    assert [t["function"]["name"] for t in upstream["tools"]] == ["get_time"] and upstream["tool_choice"] == "auto"

    # mode "required": the model must call one of the allowed tools
    sim.script({"tool_calls": [{"name": "get_time", "arguments": {"city": "Paris"}}]})
    status, final = await post(proxy, dict(body, tool_choice=dict(choice, mode="required")))
    assert status == 200 and [i["name"] for i in final["output"]] == ["get_time"]
    assert sim.requests[-1]["tool_choice"] == "required"
    status, final = await post(proxy, dict(body, tool_choice=dict(choice, tools=[{"type": "function",
                                                                                  "name": "nope"}])))
    assert status == 400 and final["error"]["param"] == "tool_choice.tools[0]"


async def test_allowed_tools_echo_carries_its_mode(sim, make_proxy):
    from tests.support.sdk_check import validate_response

    proxy = await make_proxy(NO_AUTH)
    choice = {"type": "allowed_tools", "tools": [{"type": "function", "name": "get_time"}]}
    status, body = await post(proxy, {"model": "tiny-org/tiny-model", "input": "hi", "tools": [WEATHER, TIME],
                                      "tool_choice": choice})
    assert status == 200
    assert body["tool_choice"] == dict(choice, mode="auto")
    validate_response(body)


async def test_a_models_own_sampling_defaults_are_echoed(sim, make_proxy):
    from tests.support.sdk_check import validate_response

    own = {"temperature": 0.6, "top_p": 0.95}
    proxy = await make_proxy({**NO_AUTH, "responses": {"sampling_defaults": {"tiny-org/tiny-model": own}}})
    status, body = await post(proxy, {"model": "vendor/tiny-org/tiny-model", "input": "hi"})
    assert status == 200
    validate_response(body)
    assert (body["temperature"], body["top_p"], body["presence_penalty"]) == (0.6, 0.95, 0.0)
    assert "temperature" not in sim.requests[-1] and "top_p" not in sim.requests[-1]  # the server applies its own
    status, body = await post(proxy, {"model": "tiny-org/tiny-model", "input": "hi", "temperature": 0.1})
    assert (body["temperature"], body["top_p"]) == (0.1, 0.95) and sim.requests[-1]["temperature"] == 0.1


@pytest.mark.parametrize("section", [
    [], {"m": 1}, {"m": {"temperature": 3}}, {"m": {"top_p": "1"}}, {"m": {"seed": 1}}, {"m": {"temperature": True}},
])
def test_sampling_defaults_are_checked_at_start_up(section):
    from proxy.config.load import Config, ConfigError
    from proxy.protocol.models import sampling_defaults

    with pytest.raises(ConfigError, match="responses.sampling_defaults"):
        Config.from_dict({"responses": {"sampling_defaults": section}})
    given = Config.from_dict({"responses": {"sampling_defaults": {"m": {"temperature": 0, "frequency_penalty": -2}}}})
    assert sampling_defaults(given.responses.sampling_defaults) == {"m": {"temperature": 0.0, "frequency_penalty": -2.0}}
