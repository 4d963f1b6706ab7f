"""The upstream simulator, over real HTTP on 127.0.0.1, checked against real vLLM 0.32 bytes."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from proxy.simulator.server import Simulator, create_app
from proxy.simulator.script import example_value, split_pieces, tokenize
from tests.conftest import eventually
from tests.support.paths import REPO, SHARED

FIXTURES = SHARED / "fixtures" / "vllm-0.32-cpu"
if not FIXTURES.is_dir():  # a checkout elsewhere: fall back to the shared tree
    FIXTURES = Path("/work/shared/fixtures/vllm-0.32-cpu")

TOOLS = json.loads((FIXTURES / "tools.json").read_text())
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def parse_sse(data: bytes) -> list:
    """Data events of an SSE body: dicts, the string "[DONE]", or raw strings when not JSON."""
    out = []
    for block in data.decode().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                payload = line[6:]
                if payload == "[DONE]":
                    out.append("[DONE]")
                else:
                    try:
                        out.append(json.loads(payload))
                    except ValueError:
                        out.append(payload)
    return out


def keys(obj):
    """The key structure of a JSON value (dict key order kept, values ignored except nesting)."""
    if isinstance(obj, dict):
        return [(k, keys(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return [keys(obj[0])] if obj else []
    return None


def kind(chunk) -> str:
    if chunk == "[DONE]":
        return "done"
    if not chunk["choices"]:
        return "usage"
    c = chunk["choices"][0]
    d = c["delta"]
    if c["finish_reason"] is not None:
        return "finish"
    if d.get("role"):
        return "role"
    if d.get("tool_calls"):
        return "tool_head" if d["tool_calls"][0].get("id") else "tool_args"
    if d.get("reasoning") or d.get("reasoning_content"):
        return "reasoning"
    return "content"


def shapes_by_kind(events: list) -> dict:
    out: dict = {}
    for e in events:
        out.setdefault(kind(e), keys(e))
    return out


def assembled(events: list) -> dict:
    """Reasoning, text, tool calls and finish reassembled from chat chunks (either dialect)."""
    r, t, calls, finish, usage = "", "", {}, None, None
    for e in events:
        if not isinstance(e, dict):
            continue
        if e.get("usage") and not e["choices"]:
            usage = e["usage"]
        for c in e.get("choices", []):
            d = c["delta"]
            r += d.get("reasoning") or d.get("reasoning_content") or ""
            t += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                if tc.get("id"):
                    slot["id"] = tc["id"]
                if tc["function"].get("name"):
                    slot["name"] = tc["function"]["name"]
                slot["arguments"] += tc["function"].get("arguments") or ""
            if c["finish_reason"]:
                finish = c["finish_reason"]
    return {"reasoning": r, "text": t, "calls": [calls[i] for i in sorted(calls)], "finish": finish, "usage": usage}


@pytest.fixture
async def sim():
    async with Simulator() as s:
        yield s


@pytest.fixture
async def sgl():
    async with Simulator(dialect="sglang") as s:
        yield s


async def chat(http, sim, body: dict, *, raw: bool = False):
    async with http.post(sim.url + "/v1/chat/completions", json=body) as r:
        data = await r.read()
        if raw:
            return r, data
        return r, (parse_sse(data) if body.get("stream") else json.loads(data))


def req(messages=None, **kw) -> dict:
    return {"model": "tiny-org/tiny-model", "messages": messages or PARIS, **kw}


STREAM = {"stream": True, "stream_options": {"include_usage": True}}


# --------------------------------------------------------------------------- vLLM shapes


async def test_vllm_plain_stream_matches_fixture_shapes(sim, http):
    r, data = await chat(http, sim, req(max_tokens=128, **STREAM), raw=True)
    assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    ours = parse_sse(data)
    theirs = parse_sse(fixture("final_chat_stream.body"))
    assert [kind(e) for e in ours][0] == "role" and ours[-1] == "[DONE]"
    assert list(dict.fromkeys(kind(e) for e in ours)) == ["role", "reasoning", "content", "finish", "usage", "done"]
    assert shapes_by_kind(ours) == shapes_by_kind(theirs)
    assert data.endswith(b"data: [DONE]\n\n") and data.startswith(b'data: {"id":"chatcmpl-')
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", ours[0]["id"])
    assert len({e["id"] for e in ours if isinstance(e, dict)}) == 1
    assert ours[-2]["system_fingerprint"].startswith("vllm-0.32.0-")


async def test_vllm_required_tool_stream_matches_fixture_shapes(sim, http):
    _, ours = await chat(http, sim, req(tools=TOOLS, tool_choice="required", max_tokens=256, **STREAM))
    theirs = parse_sse(fixture("final_required_stream.body"))
    assert shapes_by_kind(ours) == shapes_by_kind(theirs)
    got = assembled(ours)
    assert got["finish"] == "tool_calls"
    assert got["calls"][0]["name"] == "get_weather"
    assert json.loads(got["calls"][0]["arguments"]) == {"city": "x", "unit": "c"}
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", got["calls"][0]["id"])


async def test_vllm_auto_tool_stream_shapes_match_toolmodel_fixture(sim, http):
    sim.script({"text": "Let me look.", "tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}]})
    _, ours = await chat(http, sim, req(tools=TOOLS, tool_choice="auto", **STREAM))
    theirs = parse_sse(fixture("toolmodel_auto_stream_seed2.body"))
    ours_shapes, theirs_shapes = shapes_by_kind(ours), shapes_by_kind(theirs)
    for k in ("role", "content", "tool_head", "tool_args", "finish"):
        assert ours_shapes[k] == theirs_shapes[k], k
    assert [kind(e) for e in ours] == ["role"] + ["content"] * 4 + ["tool_head"] + ["tool_args"] * 9 + [
        "finish", "usage", "done"]


async def test_vllm_nonstream_bodies_match_fixture_shapes(sim, http):
    r, ours = await chat(http, sim, req(max_tokens=128))
    assert r.headers["Content-Type"] == "application/json"
    assert keys(ours) == keys(json.loads(fixture("final_chat.body")))
    _, ours = await chat(http, sim, req(tools=TOOLS, tool_choice="required", max_tokens=256))
    theirs = json.loads(fixture("final_required.body"))
    assert keys(ours) == keys(theirs)
    assert ours["choices"][0]["message"]["content"] == ""
    assert ours["choices"][0]["finish_reason"] == "tool_calls"


async def test_vllm_named_tool_choice_finishes_with_stop(sim, http):
    choice = {"type": "function", "function": {"name": "get_time"}}
    _, ours = await chat(http, sim, req(tools=TOOLS, tool_choice=choice))
    assert keys(ours) == keys(json.loads(fixture("final_named.body")))
    c = ours["choices"][0]
    assert c["finish_reason"] == "stop"
    assert c["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz": "x"}'}
    _, events = await chat(http, sim, req(tools=TOOLS, tool_choice=choice, **STREAM))
    assert assembled(events)["finish"] == "stop"
    assert shapes_by_kind(events) == shapes_by_kind(parse_sse(fixture("final_named_stream.body")))


async def test_vllm_length_finish_rides_on_last_delta(sim, http):
    _, ours = await chat(http, sim, req(max_tokens=4, **STREAM))
    theirs = parse_sse(fixture("final_chat_stream_length.body"))
    assert [kind(e) for e in ours] == [kind(e) for e in theirs]
    assert shapes_by_kind(ours) == shapes_by_kind(theirs)
    assert ours[-3]["choices"][0]["delta"]  # the finish chunk carries the last piece
    assert ours[-2]["usage"]["completion_tokens"] == 4


async def test_vllm_continuous_usage_stats(sim, http):
    so = {"include_usage": True, "continuous_usage_stats": True}
    _, ours = await chat(http, sim, req(max_tokens=5, stream=True, stream_options=so,
                                        chat_template_kwargs={"enable_thinking": False}))
    theirs = parse_sse(fixture("chat_stream_length.body"))
    assert [keys(e) for e in ours[:-2]] == [keys(e) for e in theirs[:-2]]
    assert [e["usage"]["completion_tokens"] for e in ours[:-2]] == [0, 1, 2, 3, 4, 5]
    assert all(e["usage"]["prompt_tokens"] == ours[-2]["usage"]["prompt_tokens"] for e in ours[:-1])


async def test_vllm_without_include_usage_fingerprint_on_finish(sim, http):
    _, ours = await chat(http, sim, req(stream=True))
    assert [kind(e) for e in ours][-2:] == ["finish", "done"]
    assert list(ours[-2])[-1] == "system_fingerprint"
    assert not any("usage" in e for e in ours if isinstance(e, dict))
    theirs = parse_sse(fixture("chat_overlong_stream_nomax.body"))
    assert list(ours[-2]) == list(theirs[-2])


async def test_vllm_exact_error_bodies(http):
    async with Simulator(models=("tiny-model",), max_model_len=2048) as s:  # the served name in the captures
        for name, status in [("chat_bad_json", 400), ("chat_bad_request", 400), ("chat_unknown_model", 404),
                             ("chat_maxtokens_exceeds", 400)]:
            async with http.post(s.url + "/v1/chat/completions", data=fixture(f"{name}.request.json").rstrip(b"\n"),
                                 headers={"content-type": "application/json"}) as r:
                assert r.status == status, name
                assert r.headers["Content-Type"] == "application/json"
                assert await r.read() == fixture(f"{name}.body").rstrip(b"\n"), name


async def test_vllm_overlong_prompt_and_clamp(http):
    async with Simulator(max_model_len=64) as s:
        long = [{"role": "user", "content": "hello world " * 40}]
        r, body = await chat(http, s, req(long))
        assert r.status == 400
        theirs = json.loads(fixture("chat_overlong.body"))
        assert keys(body) == keys(theirs)
        assert body["error"]["param"] == "input_tokens" and body["error"]["type"] == "BadRequestError"
        n = len(tokenize("user:\n" + "hello world " * 40 + "\nassistant:"))
        assert body["error"]["message"] == (
            f"This model's maximum context length is 64 tokens. However, your prompt contains at least {n} input "
            f"tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
            f"input prompt. (parameter=input_tokens, value={n})")
        # prompt + max_tokens over the window: vLLM clamps max_tokens and answers
        short = [{"role": "user", "content": "hello world " * 25}]
        s.script({"text": "word " * 100})
        r, body = await chat(http, s, req(short, max_tokens=60))
        assert r.status == 200
        u = body["usage"]
        assert u["prompt_tokens"] == 54 and u["completion_tokens"] == 64 - 54
        assert body["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- scripts


async def test_script_text_and_reasoning_stream_and_nonstream(sim, http):
    sim.script({"reasoning": "Think hard, then answer.", "text": "Hello, world!"},
               {"reasoning": "Think hard, then answer.", "text": "Hello, world!"})
    _, events = await chat(http, sim, req(**STREAM))
    got = assembled(events)
    assert (got["reasoning"], got["text"], got["finish"]) == ("Think hard, then answer.", "Hello, world!", "stop")
    assert [e["choices"][0]["delta"]["content"] for e in events if kind(e) == "content"] == ["Hello", ",", " world",
                                                                                            "!"]
    assert got["usage"]["completion_tokens"] == 6 + 4
    assert got["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    _, body = await chat(http, sim, req())
    m = body["choices"][0]["message"]
    assert (m["reasoning"], m["content"]) == ("Think hard, then answer.", "Hello, world!")
    assert body["usage"]["completion_tokens"] == 10


async def test_script_parallel_tool_calls(sim, http):
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, "id": "call_fixed"},
             {"name": "get_time", "arguments": '{"tz":"CET"}'}]
    sim.script({"tool_calls": calls}, {"tool_calls": calls})
    _, events = await chat(http, sim, req(tools=TOOLS, **STREAM))
    got = assembled(events)
    assert got["finish"] == "tool_calls" and got["text"] == ""
    assert [c["name"] for c in got["calls"]] == ["get_weather", "get_time"]
    assert got["calls"][0]["id"] == "call_fixed"
    assert got["calls"][0]["arguments"] == '{"city": "Paris", "unit": "c"}'
    assert got["calls"][1]["arguments"] == '{"tz":"CET"}'
    assert got["calls"][1]["id"].startswith("chatcmpl-tool-")
    _, body = await chat(http, sim, req(tools=TOOLS))
    tcs = body["choices"][0]["message"]["tool_calls"]
    assert [t["function"]["arguments"] for t in tcs] == ['{"city": "Paris", "unit": "c"}', '{"tz":"CET"}']


async def test_script_finish_usage_cached_and_chunk_chars(sim, http):
    sim.script({"text": "abcdefghij", "finish": "content_filter", "usage": False, "chunk_chars": 3})
    _, events = await chat(http, sim, req(**STREAM))
    assert [e["choices"][0]["delta"]["content"] for e in events if kind(e) == "content"] == ["abc", "def", "ghi", "j"]
    assert assembled(events)["finish"] == "content_filter"
    assert "usage" not in [kind(e) for e in events]
    sim.script({"text": "ok", "cached_tokens": 7})
    _, events = await chat(http, sim, req(**STREAM))
    assert assembled(events)["usage"]["prompt_tokens_details"]["cached_tokens"] == 7


async def test_script_only_faults_keeps_default_answer(sim, http):
    _, plain = await chat(http, sim, req())
    sim.script({"delay": 0.001})
    _, scripted = await chat(http, sim, req())
    assert scripted["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


async def test_sim_directive_last_user_or_tool_message(sim, http):
    msgs = [{"role": "user", "content": 'please SIM: {"text": "from directive"}'}]
    _, body = await chat(http, sim, req(msgs))
    assert body["choices"][0]["message"]["content"] == "from directive"
    # only the LAST user/tool message counts
    msgs2 = msgs + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "plain"}]
    _, body = await chat(http, sim, req(msgs2))
    assert body["choices"][0]["message"]["content"] != "from directive"
    # a tool result carries a directive too; content parts are read
    msgs3 = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "c1",
              "content": [{"type": "text", "text": 'SIM:{"text": "after tool", "finish": "length"}'}]}]
    _, body = await chat(http, sim, req(msgs3))
    assert body["choices"][0]["message"]["content"] == "after tool"
    assert body["choices"][0]["finish_reason"] == "length"
    # a broken directive falls back to the default answer
    _, body = await chat(http, sim, req([{"role": "user", "content": "SIM:{broken"}]))
    assert body["choices"][0]["message"]["content"]


async def test_queue_beats_directive_and_http_script_endpoints(sim, http):
    async with http.post(sim.url + "/sim/script", json=[{"text": "first"}, {"text": "second"}]) as r:
        assert r.status == 200 and (await r.json())["queued"] == 2
    directive = req([{"role": "user", "content": 'SIM:{"text": "directive"}'}])
    outs = []
    for _ in range(3):
        _, body = await chat(http, sim, directive)
        outs.append(body["choices"][0]["message"]["content"])
    assert outs == ["first", "second", "directive"]
    async with http.get(sim.url + "/sim/requests") as r:
        recorded = await r.json()
    assert len(recorded) == 3 and recorded[0] == directive
    assert sim.requests == recorded
    async with http.delete(sim.url + "/sim/requests") as r:
        assert r.status == 200
    assert sim.requests == []
    async with http.post(sim.url + "/sim/script", json={"text": "one"}) as r:
        assert (await r.json())["queued"] == 1


async def test_default_answer_is_deterministic_across_instances(http):
    bodies = []
    for _ in range(2):
        async with Simulator() as s:
            _, body = await chat(http, s, req())
            _, events = await chat(http, s, req(**STREAM))
            bodies.append((body["choices"][0]["message"], assembled(events)["text"]))
    assert bodies[0] == bodies[1]
    msg, streamed = bodies[0]
    assert msg["content"] == streamed and len(msg["content"].split()) == 12 and msg["reasoning"]
    async with Simulator() as s:
        _, other = await chat(http, s, req([{"role": "user", "content": "Something else entirely"}]))
    assert other["choices"][0]["message"]["content"] != msg["content"]


async def test_enable_thinking_false_has_no_reasoning(sim, http):
    _, body = await chat(http, sim, req(chat_template_kwargs={"enable_thinking": False}))
    assert body["choices"][0]["message"]["reasoning"] is None
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_example_values_from_schema():
    schema = {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "number"}, "i": {"type": "integer"}, "b": {"type": "boolean"},
        "e": {"type": "string", "enum": ["a", "b"]}, "o": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                                          "required": ["x"]},
        "a": {"type": "array"}, "opt": {"type": "string"}}, "required": ["s", "n", "i", "b", "e", "o", "a"]}
    assert example_value(schema) == {"s": "x", "n": 1, "i": 1, "b": True, "e": "a", "o": {"x": True}, "a": []}
    assert "".join(split_pieces("Hi,  there friend ")) == "Hi,  there friend "
    assert split_pieces("Hi, there") == ["Hi", ",", " there"]


async def test_max_tokens_cuts_reasoning_text_and_arguments(sim, http):
    sim.script({"reasoning": "a b c", "text": "d e f", "tool_calls": [{"name": "get_time", "arguments": {"tz": "x"}}]})
    _, events = await chat(http, sim, req(tools=TOOLS, max_tokens=8, **STREAM))
    got = assembled(events)
    assert got["finish"] == "length"
    assert (got["reasoning"], got["text"]) == ("a b c", "d e f")
    assert got["calls"][0]["arguments"] == '{"'
    assert got["usage"]["completion_tokens"] == 8
    sim.script({"text": "one two three four five"})
    _, body = await chat(http, sim, req(max_completion_tokens=2))
    assert body["choices"][0]["message"]["content"] == "one two"
    assert body["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- faults


async def test_error_first_and_error_after(sim, http):
    sim.script({"error_first": {"message": "engine dead", "code": 503}})
    r, events = await chat(http, sim, req(**STREAM))
    assert r.status == 200
    assert events == [{"error": {"message": "engine dead", "type": "ServiceUnavailableError", "param": None,
                                 "code": 503}}, "[DONE]"]
    sim.script({"text": "a b c d e f", "error_after": 2})
    _, data = await chat(http, sim, req(**STREAM), raw=True)
    events = parse_sse(data)
    assert [kind(e) for e in events[:3]] == ["role", "content", "content"]
    assert b'data: {"error": {"message": "simulated upstream error", "type": "InternalServerError", "param": null, ' \
           b'"code": 500}}\n\ndata: [DONE]\n\n' in data
    assert len(events) == 5
    sim.script({"text": "a b", "error_after": 1, "flat_error": True, "error": {"message": "m", "code": 400}})
    _, events = await chat(http, sim, req(**STREAM))
    assert events[2] == {"object": "error", "message": "m", "type": "BadRequestError", "param": None, "code": 400}


async def test_error_script_on_nonstream_is_http_error(sim, http):
    sim.script({"error_first": {"message": "nope", "code": 500}})
    r, body = await chat(http, sim, req())
    assert r.status == 500 and body["error"]["message"] == "nope"


async def test_status_with_html_body(sim, http):
    sim.script({"status": 502, "body": "<html><body>Bad Gateway</body></html>"})
    r, data = await chat(http, sim, req(**STREAM), raw=True)
    assert r.status == 502 and data == b"<html><body>Bad Gateway</body></html>"
    assert r.headers["Content-Type"].startswith("text/html")
    sim.script({"status": 429, "headers": {"Retry-After": "2"}})
    r, data = await chat(http, sim, req(), raw=True)
    assert r.status == 429 and r.headers["Retry-After"] == "2"
    assert json.loads(data)["error"]["code"] == 429


async def test_drop_after_closes_connection_abruptly(sim, http):
    sim.script({"text": "a b c d e", "drop_after": 2})
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(sim.url + "/v1/chat/completions", json=req(**STREAM)) as r:
            async for chunk in r.content.iter_any():
                got += chunk
    assert [kind(e) for e in parse_sse(got)] == ["role", "content", "content"]
    assert sim.cancelled == 0 and sim.in_flight == 0


async def test_reset_before_headers(sim, http):
    sim.script({"reset_before_headers": True})
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await chat(http, sim, req(**STREAM))


async def test_garbage_lines(sim, http):
    sim.script({"garbage": True})
    _, events = await chat(http, sim, req(**STREAM))
    assert kind(events[0]) == "role" and events[-1] == "[DONE]"
    assert any(isinstance(e, str) and e != "[DONE]" for e in events)
    sim.script({"garbage": "{{{"})
    _, events = await chat(http, sim, req(**STREAM))
    assert "{{{" in events


async def test_endless_line_megabytes(sim, http):
    sim.script({"endless_line": 1})
    r, data = await chat(http, sim, req(**STREAM), raw=True)
    head, _, rest = data.partition(b"\n\n")
    assert json.loads(head[6:])["choices"][0]["delta"]["role"] == "assistant"
    assert len(rest) >= 1024 * 1024 and b"\n" not in rest


async def test_delay_first_byte_delay_keepalive_coalesce(sim, http):
    sim.script({"first_byte_delay": 0.3, "text": "a"})
    t0 = time.monotonic()
    async with http.post(sim.url + "/v1/chat/completions", json=req(**STREAM)) as r:
        assert time.monotonic() - t0 >= 0.3
        await r.read()
    sim.script({"text": "a b c d", "delay": 0.1})
    t0 = time.monotonic()
    await chat(http, sim, req(**STREAM))
    assert time.monotonic() - t0 >= 0.6  # 7 events after the first
    sim.script({"text": "a b", "keepalive": True})
    _, data = await chat(http, sim, req(**STREAM), raw=True)
    assert data.count(b": keep-alive\n\n") >= 3 and parse_sse(data)[-1] == "[DONE]"
    _, data = await chat(http, sim, req(**STREAM), raw=True)
    assert b"keep-alive" not in data
    sim.script({"text": "a b c d e f g h", "delay": 0.5, "coalesce": True})
    t0 = time.monotonic()
    async with http.post(sim.url + "/v1/chat/completions", json=req(**STREAM)) as r:
        first = await r.content.readany()
        rest = await r.read()
    assert time.monotonic() - t0 < 0.5
    assert first.endswith(b"data: [DONE]\n\n") and rest == b""


async def test_stall_then_disconnect_is_counted_cancelled(sim, http):
    sim.script({"text": "a b c d", "stall_after": 2})
    async with http.post(sim.url + "/v1/chat/completions", json=req(**STREAM)) as r:
        seen = b""
        while seen.count(b"\n\n") < 3:
            seen += await r.content.readany()
        assert sim.in_flight == 1
        r.close()  # drop the connection mid-stream
    await eventually(lambda: sim.cancelled, what="the stalled stream counted cancelled")
    assert sim.cancelled == 1 and sim.in_flight == 0


async def test_disconnect_during_slow_stream_is_cancelled(sim, http):
    sim.script({"text": "word " * 200, "delay": 0.02})
    async with http.post(sim.url + "/v1/chat/completions", json=req(**STREAM)) as r:
        await r.content.readany()
        r.close()
    await eventually(lambda: sim.cancelled and not sim.in_flight, what="the slow stream counted cancelled")
    assert (sim.cancelled, sim.in_flight) == (1, 0)


# --------------------------------------------------------------------------- prefix cache, tokenize, models


async def test_cached_tokens_grow_on_repeated_prefix(sim, http):
    system = {"role": "system", "content": "You are a helpful assistant that answers about the weather. " * 6}
    conv = [system, {"role": "user", "content": "What is the weather in Paris?"}]
    _, b1 = await chat(http, sim, req(conv))
    conv2 = conv + [b1["choices"][0]["message"], {"role": "user", "content": "And in Rome tomorrow morning?"}]
    _, b2 = await chat(http, sim, req(conv2))
    conv3 = conv2 + [b2["choices"][0]["message"], {"role": "user", "content": "And in Berlin?"}]
    _, b3 = await chat(http, sim, req(conv3))
    c = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in (b1, b2, b3)]
    assert c[0] == 0 and 0 < c[1] < c[2] and all(x % 16 == 0 for x in c)
    assert c[1] == (b1["usage"]["prompt_tokens"] // 16) * 16
    assert b1["usage"]["prompt_tokens_details"]["created_cache_tokens"] == (b1["usage"]["prompt_tokens"] // 16) * 16
    _, again = await chat(http, sim, req(conv))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == ((b1["usage"]["prompt_tokens"] - 1) // 16) * 16


async def test_tokenize_counts_match_chat_prompt_tokens(sim, http):
    body = {"model": "tiny-org/tiny-model", "messages": PARIS, "tools": TOOLS, "add_generation_prompt": True}
    async with http.post(sim.url + "/tokenize", json=body) as r:
        tok = await r.json()
    assert list(tok) == list(json.loads(fixture("final_tokenize.body")))
    assert tok["max_model_len"] == 32768 and tok["token_strs"] is None and len(tok["tokens"]) == tok["count"]
    _, b = await chat(http, sim, req(tools=TOOLS))
    assert b["usage"]["prompt_tokens"] == tok["count"]
    async with http.post(sim.url + "/tokenize", json=json.loads(fixture("tokenize_prompt.request.json"))) as r:
        tok = await r.json()
    assert keys(tok) == keys(json.loads(fixture("tokenize_prompt.body"))) and tok["count"] == 2
    async with http.post(sim.url + "/tokenize", json={"prompt": "Hi, you", "return_token_strs": True}) as r:
        assert (await r.json())["token_strs"] == ["Hi", ",", "you"]
    async with http.post(sim.url + "/v1/tokenize", json={"prompt": "x"}) as r:
        assert r.status == 404


async def test_models_and_health_vllm(http):
    async with Simulator(models=("tiny-org/tiny-model", "other"), max_model_len=4096) as s:
        async with http.get(s.url + "/v1/models") as r:
            models = await r.json()
        theirs = json.loads(fixture("models.json"))
        assert keys(models) == keys(theirs)
        assert [m["id"] for m in models["data"]] == ["tiny-org/tiny-model", "other"]
        assert models["data"][0]["max_model_len"] == 4096 and models["data"][0]["owned_by"] == "vllm"
        async with http.get(s.url + "/health") as r:
            assert r.status == 200 and await r.read() == b""
        _, b = await chat(http, s, req(model="other"))
        assert b["model"] == "other"


# --------------------------------------------------------------------------- SGLang


async def test_sglang_stream_shapes(sgl, http):
    r, events = await chat(http, sgl, req(**STREAM))
    assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert [k for k in dict.fromkeys(kind(e) for e in events)] == ["role", "reasoning", "content", "finish", "usage",
                                                                   "done"]
    for e in events[:-2]:
        assert list(e) == ["id", "object", "created", "model", "choices", "usage"] and e["usage"] is None
        c = e["choices"][0]
        assert list(c) == ["index", "delta", "logprobs", "finish_reason", "matched_stop"]
        assert list(c["delta"]) == ["role", "content", "reasoning_content", "tool_calls"]
    assert re.fullmatch(r"[0-9a-f]{32}", events[0]["id"])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "reasoning_content": None,
                                                "tool_calls": None}
    fin = events[-3]["choices"][0]
    assert fin["delta"] == {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
    assert fin["finish_reason"] == "stop" and fin["matched_stop"] is not None
    usage = events[-2]
    assert usage["choices"] == [] and list(usage["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens",
                                                               "prompt_tokens_details", "reasoning_tokens"]
    assert events[-1] == "[DONE]"
    got = assembled(events)
    assert got["usage"]["reasoning_tokens"] > 0 and got["text"]


async def test_sglang_tool_calls_whole_and_reserialised(sgl, http):
    calls = [{"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'},
             {"name": "get_time", "arguments": {"tz": "CET"}}]
    sgl.script({"text": "", "tool_calls": calls}, {"tool_calls": calls})
    _, events = await chat(http, sgl, req(tools=TOOLS, **STREAM))
    tc_chunks = [e for e in events if kind(e) == "tool_head"]
    assert len(tc_chunks) == 2
    first = tc_chunks[0]["choices"][0]["delta"]["tool_calls"][0]
    assert list(first) == ["id", "index", "type", "function"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", first["id"])
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}
    fin = events[-3]["choices"][0]
    assert fin["finish_reason"] == "tool_calls" and fin["matched_stop"] is None
    _, body = await chat(http, sgl, req(tools=TOOLS))
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    msg = body["choices"][0]["message"]
    assert list(msg) == ["role", "content", "reasoning_content", "tool_calls"]
    assert [t["function"]["arguments"] for t in msg["tool_calls"]] == ['{"city": "Paris", "unit": "c"}',
                                                                        '{"tz": "CET"}']
    assert msg["content"] is None


async def test_sglang_errors_endpoints_and_tokenize(http):
    async with Simulator(dialect="sglang", max_model_len=64) as s:
        r, body = await chat(http, s, req(model="nope"))
        assert r.status == 404 and list(body) == ["object", "message", "type", "param", "code"]
        assert body["object"] == "error" and body["code"] == 404
        r, body = await chat(http, s, req([{"role": "user", "content": "x " * 100}]))
        assert r.status == 400 and "context length" in body["message"]
        r, body = await chat(http, s, req(max_tokens=60))
        assert r.status == 400 and "maximum context length" in body["message"]
        s.script({"text": "a b", "error_after": 1})
        _, events = await chat(http, s, req(**STREAM))
        assert events[2] == {"error": {"object": "error", "message": "simulated upstream error",
                                       "type": "InternalServerError", "param": None, "code": 500}}
        async with http.get(s.url + "/v1/models") as r:
            m = (await r.json())["data"][0]
        assert m["owned_by"] == "sglang" and m["max_model_len"] == 64
        for path in ("/health", "/ready", "/health_generate"):
            async with http.get(s.url + path) as r:
                assert r.status == 200, path
        async with http.post(s.url + "/v1/tokenize", json={"messages": PARIS}) as r:
            tok = await r.json()
        assert list(tok) == ["tokens", "count", "max_model_len"]
        _, b = await chat(http, s, req())
        assert b["usage"]["prompt_tokens"] == tok["count"]


# --------------------------------------------------------------------------- app factory and CLI


def test_create_app_rejects_unknown_dialect():
    with pytest.raises(ValueError):
        create_app(dialect="tgi")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_cli_serves(http):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "proxy.simulator.server", "--host", "127.0.0.1", "--port", str(port),
                             "--dialect", "sglang", "--model", "tiny-org/tiny-model", "--max-model-len", "1000"],
                            cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        async def models():
            try:
                async with http.get(f"http://127.0.0.1:{port}/v1/models") as r:
                    return await r.json()
            except aiohttp.ClientConnectionError:
                return None

        data = await eventually(models, what="the simulator CLI up")
        assert data["data"][0]["owned_by"] == "sglang" and data["data"][0]["max_model_len"] == 1000
    finally:
        proc.terminate()
        proc.wait(timeout=10)
