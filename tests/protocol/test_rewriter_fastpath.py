"""The rewriter's one fast path (TextRun: a run of same-shape text chunks in one read, not
parsed one by one; proxy.protocol.deltas) against parsing every chunk: identical bytes out,
identical state, on the fixtures, on random streams cut anywhere, and on look-alike chunks
that must stay out of a run. Also: the SSE decoder's fast paths against its line-by-line
path, the non-stream answer against the stream of its message as one chunk, and the
forwarder's read watchdog.

Item ids and completed_at are made deterministic (ResponseContext.ids / .clock) so that two
runs can be compared byte for byte.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import re

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response

from proxy.protocol.assembler import Assembler
from proxy.protocol.deltas import OUTPUT_TOKEN, ChunkParser, Text, TextRun, completion_events
from proxy.protocol.encoder import Discard
from proxy.protocol.plain_answer import plain_response
from proxy.protocol.response import random_hex
from proxy.protocol.rewriter import StreamRewriter, response_from_completion
from proxy.protocol.sse import SSEDecoder
from tests.protocol.test_rewriter import BODIES, FIX, STREAMS, ToolOrigin, ctx, det, parse, run, sdk_check


def _run(chunks: list[bytes], c, runs: bool, finish: bool = True) -> tuple[bytes, StreamRewriter]:
    return run(chunks, c, finish=finish, runs=runs)


def _state(rw: StreamRewriter) -> tuple:
    return (rw.done, rw.status, rw.usage, rw.output_tokens_seen, rw.reasoning_deltas_seen, rw.finish_reason,
            rw.response, rw.capped)


def assert_same(chunks: list[bytes], c, finish: bool = True) -> bytes:
    fast, rw_fast = _run(chunks, c, True, finish)
    slow, rw_slow = _run(chunks, c, False, finish)
    assert fast == slow
    assert _state(rw_fast) == _state(rw_slow)
    return fast


def events_of(body: bytes) -> list[bytes]:
    return [p + b"\n\n" for p in body.replace(b"\r\n", b"\n").split(b"\n\n") if p.strip()]


# ---------------------------------------------------------------- fixtures
@pytest.mark.parametrize("name", STREAMS)
def test_fixture_runs_equal_parsed(name):
    body = BODIES[name]
    whole = assert_same([body], ctx())
    assert assert_same(events_of(body), ctx()) == whole  # one feed per upstream event
    sdk_check(parse(whole))


@pytest.mark.parametrize("name", ["r1_stream", "final_chat_stream", "final_required_stream"])
@pytest.mark.parametrize("variant", ["hidden", "sealed", "sealed_clear"])
def test_fixture_runs_equal_parsed_reasoning_variants(name, variant):
    kw = {"hidden": dict(reasoning_items=False),
          "sealed": dict(seal=lambda t: "S:" + t, reasoning_in_clear=False),
          "sealed_clear": dict(seal=lambda t: "S:" + t)}[variant]
    body = BODIES[name]
    whole = assert_same([body], ctx(**kw))
    assert assert_same(events_of(body), ctx(**kw)) == whole


def test_long_stream_past_the_precomputed_sequence_numbers():
    n = 8192 + 50
    parts = [b'data: {"choices":[{"index":0,"delta":{"content":"w"}}]}\n\n'] * n
    parts.append(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    body = b"".join(parts)
    out = assert_same([body], ctx())
    events = parse(out)  # sequence numbers 0..N without a gap
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "w" * n
    assert events[-1]["sequence_number"] > 8192


# ---------------------------------------------------------------- randomised streams
_TEXT = st.text(alphabet=st.sampled_from(list("ab \"\\\n{}é€😀") + ["\u2028", "\x00"]), max_size=6)
_NOISE = st.sampled_from([None, "", 0, 1, [], {}, ["x"], {"a": 1}, True])


def _choice(delta, finish=None, index=0, extra=None):
    ch = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    if extra:
        ch.update(extra)
    return ch


# Weighted: the stream-ending kinds are rare, so that streams get long enough to interleave
# items (reasoning -> message -> calls, parallel calls by index) before they end.
_KINDS = st.sampled_from(
    ["content"] * 8 + ["content_vllm"] * 4 + ["reasoning"] * 6 + ["reasoning_content"] * 3
    + ["tool_start"] * 4 + ["tool_start_noname"] * 2 + ["tool_args"] * 12 + ["tool_args_noindex"] * 3
    + ["tool_args_id"] * 3 + ["usage_in_delta"] * 2
    + ["both", "role", "usage", "empty_choices", "second_choice", "two_choices", "odd_delta", "odd_content",
       "odd_reasoning", "comment", "blank_data", "no_index", "index_none"]
    + ["finish", "finish_length", "error", "done", "not_json", "array"])


@st.composite
def upstream_event(draw) -> bytes:
    kind = draw(_KINDS)
    text = draw(_TEXT)
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    if kind == "content":
        base["choices"] = [_choice({"content": text})]
    elif kind == "content_vllm":
        base["choices"] = [_choice({"content": text}, extra={"token_ids": None})]
    elif kind == "reasoning":
        base["choices"] = [_choice({"reasoning": text})]
    elif kind == "reasoning_content":  # SGLang
        base["choices"] = [_choice({"role": None, "content": None, "reasoning_content": text, "tool_calls": None})]
    elif kind == "both":
        base["choices"] = [_choice({"reasoning": text, "content": draw(_TEXT)})]
    elif kind == "role":
        base["choices"] = [_choice({"role": "assistant", "content": ""})]
    elif kind == "tool_start":
        idx = draw(st.integers(0, 2))
        fn = {"name": draw(st.sampled_from(["get_time", "apply_patch", "ns__grammar", "f"]))}
        if draw(st.booleans()):
            fn["arguments"] = text
        tc = {"id": draw(st.sampled_from(["call_a", "call_b", "call_c", None])), "type": "function",
              "index": idx, "function": fn}
        base["choices"] = [_choice({"content": None, "tool_calls": [tc]})]
    elif kind == "tool_start_noname":  # arguments (and maybe an id) before the name
        tc = {"index": draw(st.integers(0, 2)), "function": {"arguments": text}}
        if draw(st.booleans()):
            tc["id"] = draw(st.sampled_from(["call_a", "call_b", "call_c"]))
        base["choices"] = [_choice({"tool_calls": [tc]})]
    elif kind in ("tool_args", "tool_args_noindex", "tool_args_id"):
        tc: dict = {"function": {"arguments": text if draw(st.booleans()) else draw(_NOISE)}}
        if kind != "tool_args_noindex":
            tc["index"] = draw(st.sampled_from([0, 0, 1, 2, True, "0"]))
        if kind == "tool_args_id":
            tc["id"] = draw(st.sampled_from(["call_a", "call_b", ""]))
        tcs = [tc] if draw(st.integers(0, 4)) else [tc, {"index": 1, "function": {"arguments": "x"}}]
        base["choices"] = [_choice({"content": draw(st.sampled_from([None, None, ""])), "tool_calls": tcs})]
    elif kind == "usage":
        base["choices"] = []
        base["usage"] = {"prompt_tokens": 3, "completion_tokens": draw(st.integers(0, 9)), "total_tokens": 12}
    elif kind == "usage_in_delta":  # continuous usage stats
        base["choices"] = [_choice({"content": text})]
        base["usage"] = {"prompt_tokens": 3, "completion_tokens": draw(st.integers(0, 9))}
    elif kind == "empty_choices":
        base["choices"] = draw(st.sampled_from([[], None]))
    elif kind == "finish":
        base["choices"] = [_choice({"content": text} if draw(st.booleans()) else {}, "stop")]
    elif kind == "finish_length":
        base["choices"] = [_choice({}, draw(st.sampled_from(["length", "tool_calls", "content_filter"])))]
    elif kind == "second_choice":
        base["choices"] = [_choice({"content": text}, index=1)]
    elif kind == "two_choices":
        base["choices"] = [_choice({"content": text}), _choice({"content": "other"}, index=1)]
    elif kind == "odd_delta":
        base["choices"] = [_choice(draw(st.sampled_from([None, {}, [], ""])))]
    elif kind == "odd_content":
        base["choices"] = [_choice({"content": draw(_NOISE)})]
    elif kind == "odd_reasoning":
        base["choices"] = [_choice({"reasoning": draw(_NOISE), "reasoning_content": text})]
    elif kind == "error":
        return b"data: " + orjson.dumps({"error": {"message": "boom", "code": 500}}) + b"\n\n"
    elif kind == "done":
        return b"data: [DONE]\n\n"
    elif kind == "not_json":
        return b"data: {not json\n\n"
    elif kind == "array":
        return b"data: [1,2]\n\n"
    elif kind == "comment":
        return b": keep-alive\n\n"
    elif kind == "blank_data":
        return b"data: \n\n"
    elif kind == "no_index":
        base["choices"] = [{"delta": {"content": text}}]
    elif kind == "index_none":
        base["choices"] = [{"index": None, "delta": {"reasoning": text}, "finish_reason": None}]
    return b"data: " + orjson.dumps(base) + b"\n\n"


_CTXS = {
    "plain": dict(),
    "tools": dict(tools={"apply_patch": ToolOrigin(kind="custom", name="apply_patch"),
                         "ns__grammar": ToolOrigin(kind="custom", name="grammar", namespace="ns"),
                         "get_time": ToolOrigin(kind="function", name="get_time")}),
    "hidden": dict(reasoning_items=False),
    "sealed": dict(seal=lambda t: "S:" + t, reasoning_in_clear=False),
    "sealed_clear": dict(seal=lambda t: "S:" + t),
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(upstream_event(), min_size=1, max_size=60),
       mode=st.sampled_from(["coalesced", "per_event", "random_cuts", "crlf"]),
       cuts=st.lists(st.integers(0, 10_000), max_size=8),
       which=st.sampled_from(sorted(_CTXS)),
       finish=st.booleans())
def test_random_streams_runs_equal_parsed(events, mode, cuts, which, finish):
    body = b"".join(events)
    if mode == "coalesced":
        chunks = [body]
    elif mode == "per_event":
        chunks = events
    elif mode == "crlf":
        chunks = [body.replace(b"\n", b"\r\n")]
    else:
        points = sorted({c % (len(body) + 1) for c in cuts})
        chunks = [body[a:b] for a, b in zip([0, *points], [*points, len(body)])]
    out = assert_same(chunks, ctx(**_CTXS[which]), finish)
    if finish:
        parse(out)  # framing and gap-free sequence numbers


@settings(max_examples=150, deadline=None)
@given(events=st.lists(st.sampled_from(["content", "reasoning", "args"]), min_size=1, max_size=30),
       per_event=st.booleans())
def test_random_well_formed_streams_pass_the_sdk(events, per_event):
    """Streams of the common shape, validated by the openai SDK."""
    parts = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n']
    call_open = False
    for i, kind in enumerate(events):
        if kind == "content":
            d = {"content": f"w{i} "}
        elif kind == "reasoning":
            d = {"reasoning": f"r{i} "}
        elif not call_open:
            call_open = True
            d = {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}
        else:
            d = {"tool_calls": [{"index": 0, "function": {"arguments": f"{i}"}}]}
        parts.append(b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": d, "finish_reason": None}]}) + b"\n\n")
    parts.append(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    chunks = parts if per_event else [b"".join(parts)]
    out = assert_same(chunks, ctx())
    sdk_check(parse(out))


# ---------------------------------------------------------------- decoder fast path
def _decode_slow(chunks: list[bytes]) -> list[bytes]:
    """The line-by-line path only (a byte at a time never takes a fast path)."""
    d = SSEDecoder()
    out = []
    for ch in chunks:
        for i in range(len(ch)):
            out += d.feed(ch[i:i + 1])
    return out + d.flush()


@settings(max_examples=400, deadline=None)
@given(blocks=st.lists(st.sampled_from([
    b"data: {}\n\n", b"data: x\n\n", b"data: \n\n", b"data:x\n\n", b"data:  two spaces\n\n",
    b"data: a\ndata: b\n\n", b": ping\n\n", b"event: e\ndata: y\n\n", b"\n", b"\n\n", b"data: c\r\n\r\n",
    b"data: d\r\r", b"id: 1\n\n", b"data: data: nested\n\n", b"data: e\n\ndata: f\n\n", b"data: g",
]), max_size=12), split=st.booleans())
def test_decoder_fast_paths_equal_line_by_line(blocks, split):
    body = b"".join(blocks)
    chunks = blocks if split else [body]
    d = SSEDecoder()
    got = [p for ch in chunks for p in d.feed(ch)] + d.flush()
    assert got == _decode_slow([body])


@pytest.mark.parametrize("per_event", [False, True])
def test_tool_argument_chunks(per_event):
    """A new id on an index already in use (SGLang: one call per chunk), arguments before the
    name, a custom tool (no argument deltas), and a reasoning item still open."""
    c = ctx(tools={"apply_patch": ToolOrigin(kind="custom", name="apply_patch")})

    def tc(**kw):
        return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [kw]}}]}) + b"\n\n"

    parts = [
        b'data: {"choices":[{"index":0,"delta":{"reasoning":"think"}}]}\n\n',
        tc(index=0, id="call_a", function={"name": "f", "arguments": ""}),
        tc(index=0, function={"arguments": "{\"a\":"}),
        tc(index=0, function={"arguments": "1}"}),
        tc(index=0, id="call_b", function={"arguments": "{\"b\":"}),  # a new call, no name yet
        tc(index=0, function={"arguments": "2}"}),
        tc(index=0, function={"name": "g"}),
        tc(index=0, function={"arguments": ""}),
        tc(index=1, id="call_c", function={"name": "apply_patch", "arguments": "{\"input\":"}),
        tc(index=1, function={"arguments": "\"diff\"}"}),
        tc(index=0, function={"arguments": " "}),
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\ndata: [DONE]\n\n',
    ]
    out = assert_same(parts if per_event else [b"".join(parts)], c)
    events = parse(out)
    sdk_check(events)
    final = events[-1]["response"]["output"]
    assert [(o["type"], o.get("call_id"), o.get("arguments", o.get("input"))) for o in final] == [
        ("reasoning", None, None), ("function_call", "call_a", '{"a":1}'),
        ("function_call", "call_b", '{"b":2} '), ("custom_tool_call", "call_c", "diff")]


# ---------------------------------------------------------------- forwarder: the read watchdog
# _stream_answer times each upstream read with one lazy timer (not an asyncio.timeout per read).
def _timeouts(idle: float, total: float) -> dict:
    return {"connect": 1, "first_byte": 0.6, "idle": idle, "total": total}


async def _stream(sim, make_proxy, timeouts: dict, script: dict):
    from tests.faults.test_upstream import body, call

    proxy = await make_proxy(workers=[{"name": "sim", "url": sim.url, "models": ["tiny-org/tiny-model"],
                                       "timeouts": timeouts}])
    status, _, events = await call(proxy, body(script, stream=True))
    assert status == 200
    return events


async def test_watchdog_idle_timeout_mid_stream(sim, make_proxy):
    from tests.faults.test_upstream import assert_failed_stream

    events = await _stream(sim, make_proxy, _timeouts(0.5, 10), {"text": "one two three four", "stall_after": 2})
    error = assert_failed_stream(events)["error"]
    assert "(idle timeout)" in error["message"] and error.get("type") == "upstream_timeout", error
    assert any(e["type"] == "response.output_text.delta" for e in events)


async def test_watchdog_total_timeout_mid_stream(sim, make_proxy):
    from tests.faults.test_upstream import assert_failed_stream

    words = " ".join(f"w{i}" for i in range(40))
    t0 = asyncio.get_running_loop().time()
    events = await _stream(sim, make_proxy, _timeouts(0.6, 1.2), {"text": words, "delay": 0.15})
    elapsed = asyncio.get_running_loop().time() - t0
    error = assert_failed_stream(events)["error"]
    assert "(total timeout)" in error["message"] and error.get("type") == "upstream_timeout", error
    assert elapsed < 4, elapsed


async def test_watchdog_rearms_across_reads(sim, make_proxy):
    """Gaps shorter than `idle` that add up to several times `idle`: no timeout."""
    words = " ".join(f"w{i}" for i in range(12))
    events = await _stream(sim, make_proxy, _timeouts(0.4, 10), {"text": words, "delay": 0.15})
    assert events[-1]["type"] == "response.completed", events[-1]
    text = events[-1]["response"]["output"][-1]["content"][0]["text"]
    assert text.split() == words.split()


# ---------------------------------------------------------------- non-stream: one chunk through the same assembler
# A chat.completion is the stream of one chunk whose delta is its message: its Response is the
# one that stream ends with (response_from_completion shares the assembler, not this shape).
def _as_stream(completion: dict) -> bytes:
    chunk: dict = {"usage": completion.get("usage")}
    choice = next(c for c in completion["choices"] if isinstance(c, dict) and (c.get("index") or 0) == 0)
    msg = choice.get("message") or {}
    delta = {"reasoning": msg.get("reasoning") if msg.get("reasoning") is not None else msg.get("reasoning_content"),
             "content": msg.get("content")}
    calls = msg.get("tool_calls")
    if calls and isinstance(calls, list):
        delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(calls) if isinstance(tc, dict)]
    chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason") or "stop"}]
    return b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"


def _streamable(completion) -> bool:
    choices = completion.get("choices") if isinstance(completion, dict) else None
    if not isinstance(choices, list) or completion.get("error") or completion.get("object") == "error":
        return False
    choice = next((c for c in choices if isinstance(c, dict) and (c.get("index") or 0) == 0), None)
    return choice is not None and isinstance(choice.get("message") or {}, dict)


def assert_completion_is_its_stream(c, completion) -> dict:
    got = response_from_completion(det(c), copy.deepcopy(completion))
    if _streamable(completion):
        _, rw = run([_as_stream(completion)], c)
        assert orjson.dumps(got) == orjson.dumps(rw.response)
    return got


_NONSTREAM = [p.name[: -len(".body")] for p in sorted(FIX.glob("*.body")) if not p.name.endswith("stream.body")]


@pytest.mark.parametrize("which", sorted(_CTXS))
def test_nonstream_fixtures_equal_their_stream(which):
    for name in _NONSTREAM:
        try:
            completion = orjson.loads((FIX / f"{name}.body").read_bytes())
        except orjson.JSONDecodeError:
            continue
        got = assert_completion_is_its_stream(ctx(**_CTXS[which]), completion)
        if got["status"] != "failed":
            Response.model_validate(got)


def _comp(msg, finish="stop", usage=None) -> dict:
    comp = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": msg, "finish_reason": finish}]}
    if usage is not None:
        comp["usage"] = usage
    return comp


def _tc(name, args, call_id=None) -> dict:
    fn = {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}
    return {"id": call_id, "type": "function", "function": fn} if call_id is not None else {"function": fn}


_USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
          "prompt_tokens_details": {"cached_tokens": 1}, "completion_tokens_details": {"reasoning_tokens": 1}}
_COMPLETIONS = {
    "text": _comp({"content": "hi"}),
    "text_usage": _comp({"content": "hi"}, usage=_USAGE),
    "empty": _comp({"content": ""}),
    "reasoning_only": _comp({"content": None, "reasoning": "think"}),
    "reasoning_only_length": _comp({"reasoning": "think"}, "length"),
    "reasoning_text_length": _comp({"content": "a", "reasoning": "think"}, "length", _USAGE),
    "reasoning_calls_length": _comp({"reasoning": "think", "tool_calls": [_tc("f", '{"a"', "c1")]}, "length"),
    "reasoning_content": _comp({"content": "a", "reasoning_content": "rc", "reasoning": None}),
    "reasoning_empty": _comp({"content": "a", "reasoning": "", "reasoning_content": "rc"}),
    "content_filter": _comp({"reasoning": "r", "content": "a"}, "content_filter"),
    "abort": _comp({"content": "a"}, "abort"),
    "finish_other": _comp({"content": "a"}, "eos"),
    "calls": _comp({"tool_calls": [_tc("get_time", '{"a":1}', "call_1"), _tc("f", "", "call_2")]}, "tool_calls",
                   _USAGE),
    "calls_without_ids": _comp({"content": "pre", "tool_calls": [_tc("f", '{"x":1}'), _tc("g", None)]}, "tool_calls"),
    "calls_same_id": _comp({"tool_calls": [_tc("f", "{}", "c"), _tc("g", "{}", "c"), _tc("h", "{}", "c")]}),
    "call_without_name": _comp({"tool_calls": [_tc(None, '{"a":1}', "c1"), _tc("g", "{}", "c2")]}, "tool_calls"),
    "call_object_arguments": _comp({"tool_calls": [_tc("f", {"a": [1, 2]}, "c1")]}, "tool_calls"),
    "custom_and_namespace": _comp({"reasoning": "r", "tool_calls": [
        _tc("apply_patch", '{"input":"diff"}', "c1"), _tc("apply_patch", '"s"', "c2"), _tc("apply_patch", "[1]", "c3"),
        _tc("apply_patch", '{"input":{"a":1}}', "c4"), _tc("ns__grammar", "bad", "c5")]}, "tool_calls"),
    "calls_not_objects": _comp({"reasoning": "r", "tool_calls": ["x", None]}),
    "calls_an_object": _comp({"content": "a", "tool_calls": {"a": 1}}),
    "function_not_an_object": _comp({"tool_calls": [{"id": "c", "function": "f"}]}, "tool_calls"),
    "usage_not_an_object": _comp({"content": "a"}, usage=[1]),
    "second_choice_first": {"choices": [{"index": 1, "message": {"content": "b"}},
                                        {"index": 0, "message": {"content": "a"}}]},
    "no_choices": {"choices": []},
    "error": {"object": "error", "message": "bad", "code": 400},
}


@pytest.mark.parametrize("which", sorted(_CTXS))
@pytest.mark.parametrize("name", sorted(_COMPLETIONS))
def test_nonstream_shapes_equal_their_stream(name, which):
    assert_completion_is_its_stream(ctx(**_CTXS[which]), _COMPLETIONS[name])


def test_a_function_that_is_not_an_object_fails_cleanly():
    for build in (lambda c: response_from_completion(c, _COMPLETIONS["function_not_an_object"]),
                  lambda c: run([_as_stream(_COMPLETIONS["function_not_an_object"])], c)[1].response):
        r = build(ctx())
        assert r["status"] == "failed" and r["error"]["code"] == "server_error"
        assert "not an object" in r["error"]["message"] and r["output"] == []


_TOOL_NAMES = st.sampled_from(["f", "apply_patch", "ns__grammar", "get_time", None, ""])


@st.composite
def tool_call(draw):
    if not draw(st.integers(0, 9)):
        return draw(_NOISE)
    fn: dict = {}
    if draw(st.integers(0, 4)):
        fn["name"] = draw(_TOOL_NAMES)
    if draw(st.integers(0, 4)):
        fn["arguments"] = draw(st.one_of(_TEXT, _NOISE, st.just('{"input": "diff"}'), st.just('"s"')))
    tc = {"type": "function", "function": fn if draw(st.integers(0, 9)) else draw(st.sampled_from([None, {}, "x"]))}
    if draw(st.integers(0, 3)):
        tc["id"] = draw(st.sampled_from(["call_a", "call_a", "call_b", "", None]))
    return tc


@st.composite
def completion(draw):
    msg: dict = {"role": "assistant"}
    for key in ("content", "reasoning", "reasoning_content"):
        if draw(st.booleans()):
            msg[key] = draw(st.one_of(_TEXT, _NOISE))
    if draw(st.booleans()):
        msg["tool_calls"] = draw(st.lists(tool_call(), max_size=4)) if draw(st.integers(0, 5)) else draw(_NOISE)
    choice = {"index": draw(st.sampled_from([0, 0, 0, None, 1])),
              "message": msg if draw(st.integers(0, 9)) else draw(_NOISE),
              "finish_reason": draw(st.sampled_from([None, "stop", "length", "tool_calls", "content_filter",
                                                     "abort", 7, ""]))}
    choices = [choice, {"index": 0, "message": {"content": "second"}}] if draw(st.integers(0, 5)) == 0 else [choice]
    comp: dict = {"id": "chatcmpl-x", "object": "chat.completion", "choices": choices}
    if draw(st.booleans()):
        comp["usage"] = draw(st.sampled_from([None, [], {"prompt_tokens": 3, "completion_tokens": 2},
                                              {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                               "completion_tokens_details": {"reasoning_tokens": 1}}]))
    return comp


@settings(max_examples=500, deadline=None)
@given(comp=completion(), which=st.sampled_from(sorted(_CTXS)))
def test_random_completions_equal_their_stream(comp, which):
    assert_completion_is_its_stream(ctx(**_CTXS[which]), comp)


# ---------------------------------------------------------------- ids
def test_ids_are_hex_unique_and_reseeded_in_forked_children():
    ids = {random_hex() for _ in range(2000)}
    assert len(ids) == 2000 and all(re.fullmatch("[0-9a-f]{24}", i) for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, then out (no pytest teardown in the child)
        try:
            os.write(write, random_hex().encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert re.fullmatch("[0-9a-f]{24}", child)
    assert child != random_hex()  # without the re-seed, the child repeats the parent's next id


# ---------------------------------------------------------------- TextRun: runs of text chunks in one read
_HEAD = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
         b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n')


def _text_chunk(content_json: bytes) -> bytes:
    return (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
            b'[{"index":0,"delta":{"content":' + content_json + b'},"logprobs":null,"finish_reason":null,'
            b'"token_ids":null}]}\n\n')


_TAIL = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
         b'[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')


def _payloads(chunks: list[bytes]) -> list[bytes]:
    return SSEDecoder().feed(b"".join(chunks))


def test_a_coalesced_read_is_one_text_run_and_the_same_bytes():
    chunks = [_HEAD] + [_text_chunk(orjson.dumps(f" w{i}")) for i in range(40)] + [_TAIL]
    events = ChunkParser().events(_payloads(chunks))
    # The first text is parsed (and its shape learned), the 39 after it are one run.
    assert [type(e).__name__ for e in events] == ["OutputToken", "Text", "TextRun", "Finish", "End"]
    assert events[2].texts == [b" w%d" % i for i in range(1, 40)]
    assert [type(e) for e in ChunkParser(runs=False).events(_payloads(chunks))].count(Text) == 40
    body = assert_same([b"".join(chunks)], ctx())
    assert b'"text":"' + "".join(f" w{i}" for i in range(40)).encode() + b'"' in body
    sdk_check(parse(body))


def test_per_chunk_reads_are_parsed_one_by_one():
    parser = ChunkParser()
    chunks = [_HEAD] + [_text_chunk(orjson.dumps(f" w{i}")) for i in range(5)]
    events = [e for ch in chunks for e in parser.events(_payloads([ch]))]
    assert events == [OUTPUT_TOKEN, Text(" w0"), OUTPUT_TOKEN, Text(" w1"), OUTPUT_TOKEN, Text(" w2"),
                      OUTPUT_TOKEN, Text(" w3"), OUTPUT_TOKEN, Text(" w4")]


@pytest.mark.parametrize("middle", [
    b'"a","role":"b"',        # two strings: the middle is not one content string
    b'"caf\\u00e9"',          # an escape: orjson would write the character itself
    '"café"'.encode(),        # non-ASCII
    b'"tab\\there"',
    b'"\x01"',                # a raw control character: not valid JSON at all
    b'""',                    # empty text
    b'null',
    b'"unterminated',
    b'"quote\\"inside"',
    b'"del\x7f"',            # DEL is plain JSON: stays in the run
])
def test_runs_broken_by_chunks_that_only_look_alike(middle):
    middles = [orjson.dumps(f" a{i}") for i in range(6)] + [middle] + [orjson.dumps(f" b{i}") for i in range(6)]
    chunks = [_HEAD] + [_text_chunk(m) for m in middles] + [_TAIL]
    assert_same([b"".join(chunks[:2]), b"".join(chunks[2:])], ctx())
    assert_same(chunks, ctx())
    parser = ChunkParser()
    parser.events(_payloads(chunks[:2]))  # learns the shape from the first text
    runs = [len(e.texts) for e in parser.events(_payloads(chunks[2:])) if isinstance(e, TextRun)]
    assert runs == ([12] if middle == b'"del\x7f"' else [5, 6])


def test_sglang_first_text_chunk_with_role_then_plain_chunks():
    first = (b'data: {"id":"1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
             b'"delta":{"role":"assistant","content":"Hi"},"logprobs":null,"finish_reason":null}]}\n\n')
    chunks = [first] + [_text_chunk(orjson.dumps(f" w{i}")) for i in range(12)] + [_TAIL]
    out = assert_same([b"".join(chunks)], ctx())
    assert b'"text":"Hi w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11"' in out
    events = ChunkParser().events(_payloads(chunks))
    assert [len(e.texts) for e in events if isinstance(e, TextRun)] == [11]  # learned again from " w0"


@given(texts=st.lists(st.text(max_size=6), min_size=1, max_size=12), per_event=st.booleans())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_text_chunks_runs_equal_parsed(texts, per_event):
    chunks = [_HEAD] + [_text_chunk(orjson.dumps(t)) for t in texts] + [_TAIL]
    if not per_event:
        chunks = [b"".join(chunks)]
    assert_same(chunks, ctx())


@given(texts=st.lists(st.text(alphabet=st.sampled_from(['a', ' ', '"', '\\', '\x01', 'é', '\x7f']), max_size=4),
                      min_size=1, max_size=30),
       cut=st.integers(min_value=1, max_value=6))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_runs_equal_parsed(texts, cut):
    chunks = [_HEAD] + [_text_chunk(orjson.dumps(t)) for t in texts] + [_TAIL]
    cut = min(cut, len(chunks) - 1)
    assert_same([b"".join(chunks[:cut]), b"".join(chunks[cut:])], ctx())


def _role_text_chunk(text: str) -> bytes:  # same tail as a raw chunk, another head (SGLang's first)
    return (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
            b'[{"index":0,"delta":{"role":"assistant","content":' + orjson.dumps(text) + b'},"logprobs":null,'
            b'"finish_reason":null,"token_ids":null}]}\n\n')


def _reasoning_chunk(text: str) -> bytes:
    return (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
            b'[{"index":0,"delta":{"reasoning":' + orjson.dumps(text) + b'},"logprobs":null,'
            b'"finish_reason":null,"token_ids":null}]}\n\n')


_PLAIN = st.text(alphabet=st.sampled_from(list("ab .")), min_size=1, max_size=4)
_EVENT = st.one_of(
    _PLAIN.map(lambda t: _text_chunk(orjson.dumps(t))),  # the run's chunks, most of the time
    _PLAIN.map(lambda t: _text_chunk(orjson.dumps(t))),
    _PLAIN.map(lambda t: _text_chunk(orjson.dumps(t))),
    st.text(alphabet=st.sampled_from(['a', '"', '\\', '\n', 'é']), max_size=3).map(
        lambda t: _text_chunk(orjson.dumps(t))),  # not plain (or empty)
    _PLAIN.map(_role_text_chunk),
    _PLAIN.map(_reasoning_chunk),
    st.just(b": keep-alive\n\n"),
    _PLAIN.map(lambda t: b"event: message\n" + _text_chunk(orjson.dumps(t))),  # an ignored field
    _PLAIN.map(lambda t: b"data: x\n" + _text_chunk(orjson.dumps(t))),  # two data lines: not JSON
    st.just(_text_chunk(b'"x"').replace(b"data: ", b"data:", 1)),  # no space after "data:"
)


@given(events=st.lists(_EVENT, min_size=2, max_size=60), cuts=st.lists(st.integers(0, 20000), max_size=3))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_reads_cut_anywhere_runs_equal_parsed(events, cuts):
    # The raw shape is learned from the first two text chunks (first read), then the rest comes
    # in reads cut anywhere (a cut inside an event leaves the decoder mid-event: no split).
    body = b"".join(events) + _TAIL
    first = b"".join([_HEAD, _text_chunk(b'" one"'), _text_chunk(b'" two"')])
    bounds = sorted({0, len(body), *(c % (len(body) + 1) for c in cuts)})
    reads = [first] + [body[a:b] for a, b in zip(bounds, bounds[1:])]
    assert_same(reads, ctx())


def test_every_byte_boundary_of_a_fixture_equals_the_whole():
    """The assembler fed a stream split at every byte boundary writes what the whole does."""
    body = b"".join([_HEAD, _text_chunk(b'" one"'), _reasoning_chunk("r")]
                    + [_text_chunk(orjson.dumps(f" t{i}")) for i in range(6)]) + _TAIL
    whole, _ = run([body], ctx())
    for at in range(1, len(body)):
        assert run([body[:at], body[at:]], ctx())[0] == whole


@pytest.mark.parametrize("before", [b"data: x\n", b"event: message\n", b"id: 7\n"])
def test_a_run_whose_first_chunk_has_another_line_first(before):
    # The raw chunk's bytes right after another line of the same event: not a run chunk (two
    # data lines are one payload that is not JSON; other fields are ignored).
    first = b"".join([_HEAD, _text_chunk(b'" one"'), _text_chunk(b'" two"')])
    for pre in (_text_chunk(b'" pre"'), b": keep-alive\n\n"):
        read = pre + before + b"".join(_text_chunk(orjson.dumps(f" t{i}")) for i in range(30)) + _TAIL
        assert_same([first, read], ctx())


@pytest.mark.parametrize("tc", [
    {"index": 0, "id": "a", "function": "f"},
    {"index": 0, "id": "a", "function": {"name": ["f"], "arguments": "{}"}},
    {"index": 0, "id": "a", "function": {"name": {"n": 1}, "arguments": "{}"}},
])
@pytest.mark.parametrize("allowed", [None, frozenset({"f"})])
def test_a_malformed_tool_call_fails_the_response_cleanly(tc, allowed):
    """Shapes no dialect sends (a function or a name of the wrong type) end the response as
    response.failed, both ways, instead of raising out of the rewriter."""
    chunk = b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [tc]}}]}) + b"\n\n"
    out, rw = run([chunk], ctx(allowed_tools=allowed))
    events = parse(out)
    assert events[-1]["type"] == "response.failed" and rw.status == "failed"
    assert "invalid tool call" in events[-1]["response"]["error"]["message"]
    comp = _comp({"tool_calls": [tc]}, "tool_calls")
    r = response_from_completion(ctx(allowed_tools=allowed), comp)
    assert r["status"] == "failed" and "invalid tool call" in r["error"]["message"]


@pytest.mark.parametrize("field", [{"id": ["x"]}, {"id": 5}, {"index": ["0"]}])
def test_an_id_or_index_of_the_wrong_type_is_ignored(field):
    tc = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tc.update(field)
    chunks = [b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [tc]}}]}) + b"\n\n",
              b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\ndata: [DONE]\n\n']
    out, rw = run(chunks, ctx())
    sdk_check(parse(out))
    (call,) = rw.response["output"]
    assert call["name"] == "f" and call["arguments"] == "{}" and isinstance(call["call_id"], str)


# ---------------------------------------------------------------- non-stream: the plain answer built directly
# proxy.protocol.plain_answer builds the common shape (one text, no reasoning, no calls)
# without the assembler: the same dict, key order and all, as the assembler's, or None.
def _general(c, completion) -> tuple[dict, dict | None]:
    asm = Assembler(c, Discard())
    asm.feed(completion_events(completion))
    return asm.response, asm.usage


def assert_plain_is_general(c, completion) -> bool:
    plain = plain_response(det(c), copy.deepcopy(completion))
    if plain is None:
        return False
    general = _general(det(c), copy.deepcopy(completion))
    assert orjson.dumps(plain[0]) == orjson.dumps(general[0])
    assert list(plain[0]) == list(general[0])
    assert plain[1] == general[1]
    return True


_COUNTS = st.one_of(st.integers(-2, 50), st.none(), st.just(2**64), st.just(1.0), st.just(1.5), st.just("3"))


@st.composite
def plainish_completion(draw):
    """Completions on both sides of each of plain_response's conditions."""
    msg: dict = {"role": "assistant"}
    msg["content"] = draw(st.one_of(st.text(max_size=8), st.none(), st.just(""), st.integers(0, 2)))
    for key in ("reasoning", "reasoning_content"):
        if draw(st.booleans()):
            msg[key] = draw(st.one_of(st.none(), st.just(""), st.text(min_size=1, max_size=4)))
    if draw(st.integers(0, 3)) == 0:
        msg["tool_calls"] = draw(st.one_of(st.just([]), st.none(), st.just([_tc("f", "{}", "c1")])))
    choice: dict = {"index": draw(st.sampled_from([0, 0, 0, None, 1])), "message": msg,
                    "finish_reason": draw(st.sampled_from(["stop", "length", "content_filter", "tool_calls", None,
                                                           "abort", "eos", 3]))}
    if draw(st.integers(0, 9)) == 0:
        choice["message"] = draw(st.sampled_from([None, "x", []]))
    choices = [choice] + ([dict(choice, index=1)] if draw(st.integers(0, 5)) == 0 else [])
    comp: dict = {"id": "x", "object": "chat.completion", "choices": choices}
    usage_kind = draw(st.integers(0, 5))
    if usage_kind:
        usage = {"prompt_tokens": draw(_COUNTS), "completion_tokens": draw(_COUNTS)}
        if usage_kind > 3:
            usage["prompt_tokens_details"] = draw(st.one_of(st.none(), st.fixed_dictionaries(
                {"cached_tokens": _COUNTS})))
            usage["completion_tokens_details"] = draw(st.one_of(st.none(), st.fixed_dictionaries(
                {"reasoning_tokens": _COUNTS})))
        comp["usage"] = usage if usage_kind != 5 or draw(st.booleans()) else [1]
    if draw(st.integers(0, 15)) == 0:
        comp["object"] = "error"
    return comp


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plainish_completion(), st.sampled_from(sorted(_CTXS)), st.sampled_from([None, -1, 0, 1, 2, 5, 100]))
def test_plain_answer_equals_the_assembler(completion, which, cap):
    assert_plain_is_general(dataclasses.replace(ctx(**_CTXS[which]), output_cap=cap), completion)


def test_plain_answer_takes_the_common_shapes():
    """The fast path is taken where it should be (else the differential test proves nothing)."""
    taken = [assert_plain_is_general(ctx(**_CTXS[w]), orjson.loads((FIX / f"{n}.body").read_bytes()))
             for w in sorted(_CTXS) for n in ("chat_nonstream", "chat_length")]
    assert all(taken)
    assert not assert_plain_is_general(ctx(), _COMPLETIONS["text"])  # no usage: counted by the general path
    # One condition off each: the general path's, each still equal to it through response_from_completion.
    for msg, finish in (({"content": "a", "reasoning_content": "rc"}, "stop"), ({"content": "a", "reasoning": "r"}, "stop"),
                        ({"content": "a", "tool_calls": [_tc("f", "{}", "c1")]}, "tool_calls"),
                        ({"content": ""}, "stop"), ({"content": "a"}, "abort"), ({"content": "a"}, "eos")):
        completion = _comp(msg, finish, _USAGE)
        assert not assert_plain_is_general(ctx(), completion), msg
        assert orjson.dumps(response_from_completion(det(ctx()), completion)) == orjson.dumps(
            _general(det(ctx()), completion)[0])
    assert not assert_plain_is_general(dataclasses.replace(ctx(), output_cap=0), _comp({"content": "a"}, "stop", _USAGE))
