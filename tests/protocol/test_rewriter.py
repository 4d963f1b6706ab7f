"""proxy.protocol.rewriter / proxy.protocol.sse: upstream chat-completions SSE -> Responses SSE.

Every emitted event is validated with the openai SDK's own types and the whole sequence is
run through the SDK's stream accumulator (ResponseStreamState).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from proxy.protocol import events
from proxy.protocol.rewriter import ResponseContext, StreamRewriter, map_usage, response_from_completion
from proxy.protocol.sse import SSEDecoder
from tests.support.paths import FIXTURES

try:  # written in parallel; the rewriter only needs the shape
    from proxy.protocol.translate import ToolOrigin
except Exception:  # pragma: no cover - before proxy/protocol/translate.py lands

    @dataclass
    class ToolOrigin:  # type: ignore[no-redef]
        kind: str
        name: str
        namespace: str | None = None


FIX = FIXTURES / "vllm-0.32-cpu"  # the repository's copy of ../shared
if not FIX.is_dir():  # pragma: no cover
    FIX = Path("/work/shared/fixtures/vllm-0.32-cpu")
ADAPTER = TypeAdapter(ResponseStreamEvent)
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


def _stream_fixtures() -> list[str]:
    names = []
    for h in sorted(FIX.glob("*.headers.txt")):
        name = h.name[: -len(".headers.txt")]
        if "event-stream" in h.read_text() and not name.startswith("anthropic"):
            names.append(name)
    return names


STREAMS = _stream_fixtures()
BODIES = {n: (FIX / f"{n}.body").read_bytes() for n in STREAMS}
SMALL = [n for n in STREAMS if len(BODIES[n]) <= 7_500]
LARGE = [n for n in STREAMS if len(BODIES[n]) > 7_500]
DECODER_ALL_SPLITS = [n for n in LARGE if len(BODIES[n]) <= 25_000]  # O(n^2): keep the suite fast


# ---------------------------------------------------------------- helpers
def ctx(**kw) -> ResponseContext:
    base = dict(response_id="resp_" + "ab" * 12, model="vendor/glm-5.3", created_at=1_795_980_000, echo={}, tools={})
    base.update(kw)
    return ResponseContext(**base)


COMPLETED_AT = 1_795_980_007


def det(c: ResponseContext) -> ResponseContext:
    """The same context with deterministic item ids (0, 1, 2, ... in hex) and completed_at,
    so that two runs can be compared byte for byte."""
    counter = itertools.count()
    return dataclasses.replace(c, ids=lambda: f"{next(counter):024x}", clock=lambda: COMPLETED_AT)


def run(chunks, c: ResponseContext | None = None, *, det_ids: bool = True,
        finish: bool = True, runs: bool = True) -> tuple[bytes, StreamRewriter]:
    """Feed `chunks` through a rewriter; `runs=False` parses every chunk (no TextRun)."""
    c = c or ctx()
    rw = StreamRewriter(det(c) if det_ids else c, runs=runs)
    out = [rw.start()]
    for ch in chunks:
        out.append(rw.feed(ch))
    if finish:
        out.append(rw.finish())
    return b"".join(out), rw


def parse(out: bytes) -> list[dict]:
    """Our SSE output -> event dicts, checking the framing, the sequence numbers and the
    `data: [DONE]` that follows the terminal event (and nothing else)."""
    assert out.endswith(b"\n\n")
    done = out.endswith(b"\n\ndata: [DONE]\n\n")
    if done:
        out = out[: -len(b"data: [DONE]\n\n")]
    assert b"[DONE]" not in out.replace(b'"[DONE]"', b"")
    events = []
    for block in out[:-2].split(b"\n\n"):
        ev_line, data_line = block.split(b"\n")
        assert ev_line.startswith(b"event: ") and data_line.startswith(b"data: ")
        ev = orjson.loads(data_line[6:])
        assert ev["type"] == ev_line[7:].decode()
        events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert done == (events[-1]["type"] in TERMINAL), "[DONE] ends the stream right after its terminal event"
    return events


_ID = re.compile(r"^(rs|msg|fc|ctc|call)_[0-9a-f]{24}$")


def normalise(obj):
    """Replace random item ids by their order of first appearance, and the wall-clock
    completed_at (two runs may straddle a second) by a marker."""
    seen: dict[str, str] = {}

    def walk(o):
        if isinstance(o, dict):
            return {k: ("<time>" if k == "completed_at" and isinstance(v, int) else walk(v)) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, str) and _ID.match(o):
            return seen.setdefault(o, f"{o.split('_')[0]}_#{len(seen)}")
        return o

    return walk(obj)


def sdk_check(events: list[dict]) -> ResponseStreamState:
    """Validate each event with the SDK types and accumulate them like the SDK stream does."""
    assert events[0]["type"] == "response.created" and events[1]["type"] == "response.in_progress"
    Response.model_validate(events[0]["response"])
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for ev in events:
        state.handle_event(ADAPTER.validate_python(ev))
    term = events[-1]
    assert term["type"] in TERMINAL
    assert sum(e["type"] in TERMINAL for e in events) == 1
    final = term["response"]
    Response.model_validate(final)
    assert final["status"] == {"response.completed": "completed", "response.incomplete": "incomplete",
                               "response.failed": "failed"}[term["type"]]
    snap = state._ResponseStreamState__current_snapshot
    # The snapshot the SDK built from added + deltas matches our final output item by item.
    assert [o.id for o in snap.output] == [o["id"] for o in final["output"]]
    for s, f in zip(snap.output, final["output"]):
        assert s.type == f["type"]
        if f["type"] == "message":
            assert s.content[0].text == f["content"][0]["text"]
        elif f["type"] == "function_call":
            assert s.arguments == f["arguments"] and s.call_id == f["call_id"] and s.name == f["name"]
    # Items closed with output_item.done are exactly the final ones.
    done = {i: it.to_dict() for i, it in state._completed_output.items()}
    for i, item in done.items():
        assert item == final["output"][i]
    if term["type"] != "response.failed":
        assert len(done) == len(final["output"])
    if term["type"] == "response.completed":
        got = state._completed_response
        assert got is not None and got.id == final["id"]
        assert [_unparsed(o.to_dict()) for o in got.output] == final["output"]
        assert got.usage.to_dict() == final["usage"]
    return state


def _unparsed(o):
    """Drop the fields the SDK's parse_response adds (parsed, parsed_arguments)."""
    if isinstance(o, dict):
        return {k: _unparsed(v) for k, v in o.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(o, list):
        return [_unparsed(v) for v in o]
    return o


def upstream_parts(body: bytes) -> tuple[str, str, dict[int, str]]:
    """Independent reading of a vLLM fixture: (reasoning, content, arguments by index)."""
    reasoning, content, args = [], [], {}
    for line in body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        for ch in orjson.loads(line[6:]).get("choices") or []:
            d = ch.get("delta") or {}
            reasoning.append(d.get("reasoning") or d.get("reasoning_content") or "")
            content.append(d.get("content") or "")
            for tc in d.get("tool_calls") or []:
                args[tc["index"]] = args.get(tc["index"], "") + (tc.get("function", {}).get("arguments") or "")
    return "".join(reasoning), "".join(content), args


def sse(*objs, done: bool = True, eol: str = "\n") -> bytes:
    parts = []
    for o in objs:
        parts.append(o if isinstance(o, str) else "data: " + orjson.dumps(o).decode() + eol + eol)
    if done:
        parts.append("data: [DONE]" + eol + eol)
    return "".join(parts).encode()


def chunk(delta=None, finish=None, *, usage=None, choices=True):
    o = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    o["choices"] = [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}] if choices else []
    if usage is not None:
        o["usage"] = usage
    return o


USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


# ---------------------------------------------------------------- SSE decoder
def test_fixture_list_is_complete():
    assert len(STREAMS) == 14 and "anthropic_messages_stream" not in STREAMS


def test_decoder_every_split_and_line_endings():
    body = (b": keep-alive\r\nevent: x\r\nid: 3\r\ndata: {\"a\":\"\xc3\xa9\xe2\x82\xac\"}\r\n\r\n"
            b"data:1\rdata: 2\r\rdata: a\r\ndata: b\r\n\r\ndata: [DONE]\n\n")
    want = [b'{"a":"\xc3\xa9\xe2\x82\xac"}', b"1\n2", b"a\nb", b"[DONE]"]
    assert SSEDecoder().feed(body) == want
    for i in range(len(body) + 1):
        d = SSEDecoder()
        assert d.feed(body[:i]) + d.feed(body[i:]) + d.flush() == want, i
    d = SSEDecoder()
    assert [p for b in body for p in d.feed(bytes([b]))] == want


@pytest.mark.parametrize("body", [
    b"data: a\ndata: b\n\ndata: c\n\n",  # two data lines in the first of two events
    b"data: a\n\ndata: b\ndata: c\n\n",  # in the last
    b"data: a\n\nevent: x\ndata: b\n\n",  # another field
    b"data: a\n\n: keep-alive\n\ndata: b\n\n",  # a comment between
    b"data: a\n\ndata: \n\ndata: b\n\n",  # an empty payload
    b"data: {\"x\":1}\n\ndata: {\"y\":2}\n\n",  # the usual case
])
def test_a_whole_read_of_events_decodes_as_byte_by_byte(body):
    # A read of whole "\n"-only events takes the fast paths; fed a byte at a time, every
    # byte goes through the line-by-line path. They must agree.
    d = SSEDecoder()
    want = [p for b in body for p in d.feed(bytes([b]))]
    assert SSEDecoder().feed(body) == want


def test_decoder_flush_unterminated_and_overflow():
    d = SSEDecoder()
    assert d.feed(b"data: [DONE]") == [] and d.flush() == [b"[DONE]"]
    d = SSEDecoder(max_line=16)
    d.feed(b"data: 0123456789")
    assert not d.overflow
    d.feed(b"abcdef")
    assert d.overflow and d.feed(b"\n\n") == []


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODER_ALL_SPLITS)
def test_decoder_every_split_large_fixtures(name):
    body = BODIES[name]
    want = SSEDecoder().feed(body)
    assert want[-1] == b"[DONE]"
    for i in range(len(body) + 1):
        d = SSEDecoder()
        assert d.feed(body[:i]) + d.feed(body[i:]) == want, i


# ---------------------------------------------------------------- fixtures
@pytest.mark.parametrize("name", STREAMS)
def test_fixture_events_valid_and_faithful(name):
    body = BODIES[name]
    out, rw = run([body], det_ids=False)
    events = parse(out)
    sdk_check(events)
    final = events[-1]["response"]
    assert rw.done and rw.response == final and rw.status == final["status"]
    reasoning, content, args = upstream_parts(body)
    by_type = {}
    for it in final["output"]:
        by_type.setdefault(it["type"], []).append(it)
    assert [it["summary"][0]["text"] for it in by_type.get("reasoning", [])] == ([reasoning] if reasoning else [])
    assert [it["content"][0]["text"] for it in by_type.get("message", [])] == ([content] if content else [])
    assert [it["arguments"] for it in by_type.get("function_call", [])] == [args[i] for i in sorted(args)]
    expected = "incomplete" if b'"finish_reason":"length"' in body else "completed"
    assert final["status"] == expected
    if expected == "incomplete":
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
        assert events[-1]["type"] == "response.incomplete"
    # usage: the last upstream usage object, mapped
    usages = [orjson.loads(line[6:])["usage"] for line in body.split(b"\n")
              if line.startswith(b"data: {") and orjson.loads(line[6:]).get("usage")]
    if usages:
        assert final["usage"] == map_usage(usages[-1]) == rw.usage
        assert final["usage"]["total_tokens"] == usages[-1]["prompt_tokens"] + usages[-1]["completion_tokens"]
    else:  # no usage upstream: counted from the deltas
        assert rw.usage is None and final["usage"]["output_tokens"] == rw.output_tokens_seen > 0
        assert final["usage"]["input_tokens"] == 0
    # the deltas' counter: one per upstream chunk carrying text/reasoning/arguments
    assert rw.output_tokens_seen == sum(
        1 for line in body.split(b"\n") if line.startswith(b"data: {")
        for ch in orjson.loads(line[6:]).get("choices") or []
        if (ch["delta"].get("reasoning") or ch["delta"].get("content")
            or any(tc.get("function", {}).get("arguments") for tc in ch["delta"].get("tool_calls") or []))
    )


@pytest.mark.parametrize("name", STREAMS)
def test_fixture_bytewise_equals_unsplit(name):
    body = BODIES[name]
    whole, _ = run([body])
    assert run([body[i:i + 1] for i in range(len(body))])[0] == whole
    # with real random ids too, compared after normalisation
    a = normalise(parse(run([body], det_ids=False)[0]))
    b = normalise(parse(run([body[i:i + 1] for i in range(len(body))], det_ids=False)[0]))
    assert a == b


@pytest.mark.slow
@pytest.mark.parametrize("name", SMALL)
def test_fixture_every_two_way_split(name):
    body = BODIES[name]
    whole, _ = run([body])
    for i in range(len(body) + 1):
        assert run([body[:i], body[i:]])[0] == whole, i


@pytest.mark.slow
@pytest.mark.parametrize("name", LARGE)
def test_fixture_two_way_splits_near_line_breaks(name):
    """Large fixtures: every split within 4 bytes of each line break (the decoder itself is
    checked at every boundary above)."""
    body = BODIES[name]
    whole, _ = run([body])
    points = sorted({p + d for p in (m.start() for m in re.finditer(b"\n", body)) for d in range(-4, 5)
                     if 0 <= p + d <= len(body)})
    for i in points:
        assert run([body[:i], body[i:]])[0] == whole, i


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(STREAMS), st.lists(st.integers(min_value=0, max_value=40_000), max_size=25))
def test_fixture_random_multi_split(name, cuts):
    body = BODIES[name]
    points = sorted({c % (len(body) + 1) for c in cuts})
    pieces = [body[a:b] for a, b in zip([0] + points, points + [len(body)])]
    assert run(pieces)[0] == run([body])[0]


@pytest.mark.parametrize("name", ["final_chat_stream", "final_required_stream", "r1_stream"])
def test_crlf_comments_and_fields_change_nothing(name):
    body = BODIES[name]
    whole, _ = run([body])
    noisy = body.replace(b"data: ", b"event: chunk\r\nid: 7\r\n: ping\r\ndata: ").replace(b"\n", b"\r\n")
    noisy = b": keep-alive\r\n\r\n" + noisy
    noisy = noisy.replace(b"\r\r\n", b"\r\n")
    assert noisy.count(b"\r\n\r\n") >= body.count(b"\n\n")
    assert run([noisy])[0] == whole
    assert run([noisy[i:i + 7] for i in range(0, len(noisy), 7)])[0] == whole
    lone_cr = body.replace(b"\n", b"\r")
    assert run([lone_cr[i:i + 1] for i in range(len(lone_cr))])[0] == whole


def test_utf8_split_everywhere():
    body = sse(chunk({"role": "assistant", "content": ""}), chunk({"reasoning": "思考🤔"}),
               chunk({"content": "héllo wörld € 😀"}), chunk({}, "stop"), chunk(choices=False, usage=USAGE))
    whole, _ = run([body])
    events = parse(whole)
    sdk_check(events)
    assert events[-1]["response"]["output"][1]["content"][0]["text"] == "héllo wörld € 😀"
    for i in range(len(body) + 1):
        assert run([body[:i], body[i:]])[0] == whole, i


# ---------------------------------------------------------------- event shapes
def test_event_sequence_text_and_reasoning():
    out, rw = run([BODIES["final_chat_stream"]])
    events = parse(out)
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.reasoning_summary_part.added"]
    r_done = types.index("response.output_item.done")
    assert types[r_done - 2:r_done] == ["response.reasoning_summary_text.done", "response.reasoning_summary_part.done"]
    # reasoning is closed before the message is added
    assert types[r_done + 1:r_done + 3] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert created["ai_generated"] is True and created["ai_notice"] == "[AI-generated content]"
    assert created["model"] == "vendor/glm-5.3" and created["id"] == "resp_" + "ab" * 12
    added = events[2]["item"]
    assert added["type"] == "reasoning" and added["id"].startswith("rs_") and added["summary"] == []
    msg_added = events[r_done + 1]
    assert msg_added["output_index"] == 1 and msg_added["item"] == {
        "type": "message", "id": msg_added["item"]["id"], "status": "in_progress", "role": "assistant", "content": []}
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(d["delta"] and d["logprobs"] == [] and d["content_index"] == 0 and d["output_index"] == 1
               for d in deltas)
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert all(i["status"] == "completed" for i in final["output"])
    for k in ("instructions", "max_output_tokens", "previous_response_id", "reasoning", "temperature", "top_p",
              "user", "metadata", "max_tool_calls", "prompt_cache_key", "safety_identifier", "top_logprobs",
              "conversation", "prompt", "error", "incomplete_details"):
        assert final[k] is None, k
    assert final["truncation"] == "disabled" and final["background"] is False and final["service_tier"] == "default"
    assert final["object"] == "response" and final["created_at"] == 1_795_980_000


def test_echo_fields_and_owned_fields():
    tools = [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}},
              "strict": False}]
    echo = {"instructions": "Be brief.", "max_output_tokens": 64, "temperature": 0.2, "top_p": 0.9,
            "tools": tools, "tool_choice": "required", "parallel_tool_calls": False, "store": False,
            "metadata": {"a": "b"}, "user": "u1", "prompt_cache_key": "k", "reasoning": {"effort": "low"},
            "status": "hacked", "id": "resp_evil", "output": ["x"]}
    out, rw = run([BODIES["final_required_stream"]], ctx(echo=echo, ai_markers=False, ai_notice="x"))
    events = parse(out)
    sdk_check(events)
    for r in (events[0]["response"], rw.response):
        for k in ("instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
                  "parallel_tool_calls", "metadata", "user", "prompt_cache_key", "reasoning"):
            assert r[k] == echo[k], k
        assert r["id"] == "resp_" + "ab" * 12 and "ai_generated" not in r and "ai_notice" not in r
    assert events[0]["response"]["status"] == "in_progress" and rw.response["status"] == "completed"


def test_function_call_events():
    out, rw = run([BODIES["toolmodel_auto_stream_seed2"]])
    events = parse(out)
    sdk_check(events)
    added = [e for e in events if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"]
    assert len(added) == 1
    item = added[0]["item"]
    assert item["arguments"] == "" and item["status"] == "in_progress" and item["id"].startswith("fc_")
    assert item["call_id"].startswith("chatcmpl-tool-")
    types = [e["type"] for e in events]
    i = types.index("response.function_call_arguments.done")
    assert types[i + 1] == "response.output_item.done" and types[i + 2] == "response.completed"
    # the message (index 0) stays open until the finish too: every done comes after the last delta
    last_delta = max(j for j, t in enumerate(types) if t.endswith(".delta"))
    assert types[last_delta] == "response.function_call_arguments.delta"
    assert all(not t.endswith(".done") for t in types[:last_delta])
    assert rw.response["output"][-1]["status"] == "completed"


def test_vllm_parallel_calls_interleaved():
    body = sse(
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Checking both."}),
        chunk({"tool_calls": [{"id": "chatcmpl-tool-a", "type": "function", "index": 0,
                               "function": {"name": "get_weather"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]}),
        chunk({"tool_calls": [{"id": "chatcmpl-tool-b", "type": "function", "index": 1,
                               "function": {"name": "get_time"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": "{\"tz\": "}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": "\"UTC\"}"}}]}),
        chunk({}, "tool_calls"),
        chunk(choices=False, usage=USAGE),
    )
    out, rw = run([body])
    events = parse(out)
    sdk_check(events)
    out_items = rw.response["output"]
    assert [(i["type"], i.get("name"), i.get("arguments"), i.get("call_id")) for i in out_items] == [
        ("message", None, None, None),
        ("function_call", "get_weather", '{"city": "Paris"}', "chatcmpl-tool-a"),
        ("function_call", "get_time", '{"tz": "UTC"}', "chatcmpl-tool-b"),
    ]
    deltas = [(e["output_index"], e["delta"]) for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == [(1, '{"city": '), (2, '{"tz": '), (1, '"Paris"}'), (2, '"UTC"}')]
    # nothing is closed before the finish chunk
    first_done = min(i for i, e in enumerate(events) if e["type"].endswith(".done"))
    assert first_done > max(i for i, e in enumerate(events) if e["type"].endswith(".delta"))


def _sglang(delta=None, finish=None, usage=None, choices=True):
    d = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
    d.update(delta or {})
    o = {"id": "0f1e2d", "object": "chat.completion.chunk", "created": 1, "model": "glm",
         "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish, "matched_stop": None}]
         if choices else [], "usage": usage}
    return o


def test_sglang_text_and_reasoning():
    body = sse(
        _sglang({"role": "assistant", "content": ""}),
        _sglang({"reasoning_content": "Let me "}),
        _sglang({"reasoning_content": "think."}),
        _sglang({"content": "Hello"}),
        _sglang({"content": " there."}),
        _sglang({}, "stop"),
        _sglang(usage={"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
                       "prompt_tokens_details": None, "reasoning_tokens": 2}, choices=False),
    )
    out, rw = run([body])
    events = parse(out)
    sdk_check(events)
    final = rw.response
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["summary"][0]["text"] == "Let me think."
    assert final["output"][1]["content"][0]["text"] == "Hello there."
    assert final["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                              "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 2},
                              "total_tokens": 11}
    assert rw.output_tokens_seen == 4


def test_sglang_parallel_calls_one_per_chunk():
    body = sse(
        _sglang({"role": "assistant", "content": ""}),
        _sglang({"tool_calls": [{"id": "call_0a1b2c3d4e5f", "index": 0, "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}),
        _sglang({"tool_calls": [{"id": "call_9f8e7d6c5b4a", "index": 1, "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]}),
        # some SGLang builds number every call 0: a new id means a new call
        _sglang({"tool_calls": [{"id": "call_ffff00001111", "index": 0, "type": "function",
                                 "function": {"name": "get_time", "arguments": "{}"}}]}),
        _sglang({}, "tool_calls"),
        _sglang(usage=USAGE, choices=False),
    )
    out, rw = run([body])
    sdk_check(parse(out))
    got = [(i["call_id"], i["name"], i["arguments"]) for i in rw.response["output"]]
    assert got == [("call_0a1b2c3d4e5f", "get_weather", '{"city": "Paris"}'),
                   ("call_9f8e7d6c5b4a", "get_weather", '{"city": "Rome"}'),
                   ("call_ffff00001111", "get_time", "{}")]
    assert rw.status == "completed"


def test_call_without_id_and_duplicate_ids_get_fresh_call_ids():
    body = sse(
        chunk({"tool_calls": [{"index": 0, "function": {"name": "a", "arguments": "{}"}}]}),
        chunk({"tool_calls": [{"id": "dup", "index": 1, "function": {"name": "b", "arguments": "{}"}}]}),
        chunk({"tool_calls": [{"id": "dup", "index": 2, "function": {"name": "c", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
    )
    out, rw = run([body], det_ids=False)
    sdk_check(parse(out))
    ids = [i["call_id"] for i in rw.response["output"]]
    assert re.fullmatch(r"call_[0-9a-f]{24}", ids[0]) and ids[1] == "dup" and ids[2] != "dup"
    assert len(set(ids)) == 3


def test_arguments_before_name_are_held_back():
    body = sse(
        chunk({"tool_calls": [{"index": 0, "id": "x1", "function": {"arguments": "{\"a\""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ": 1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}),  # never named: dropped
        chunk({}, "tool_calls"),
    )
    out, rw = run([body])
    events = parse(out)
    sdk_check(events)
    assert [(i["name"], i["arguments"]) for i in rw.response["output"]] == [("f", '{"a": 1}')]


def test_custom_and_namespace_mapping():
    tools = {
        "apply_patch": ToolOrigin(kind="custom", name="apply_patch"),
        "files__read": ToolOrigin(kind="function", name="read", namespace="files"),
        "ns__grammar": ToolOrigin(kind="custom", name="grammar", namespace="ns"),
    }
    body = sse(
        chunk({"tool_calls": [{"id": "c1", "index": 0, "function": {"name": "apply_patch"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"input\": \"*** Begin"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": " Patch\\n\"}"}}]}),
        chunk({"tool_calls": [{"id": "c2", "index": 1,
                               "function": {"name": "files__read", "arguments": "{\"p\":1}"}}]}),
        chunk({"tool_calls": [{"id": "c3", "index": 2, "function": {"name": "ns__grammar", "arguments": "not json"}}]}),
        chunk({"tool_calls": [{"id": "c4", "index": 3, "function": {"name": "unknown_fn", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
    )
    out, rw = run([body], c=ctx(tools=tools))
    events = parse(out)
    sdk_check(events)
    o = rw.response["output"]
    assert o[0] == {"type": "custom_tool_call", "id": o[0]["id"], "call_id": "c1", "name": "apply_patch",
                    "input": "*** Begin Patch\n"}
    assert o[0]["id"].startswith("ctc_")
    assert o[1] == {"type": "function_call", "id": o[1]["id"], "call_id": "c2", "name": "read",
                    "arguments": "{\"p\":1}", "status": "completed", "namespace": "files"}
    assert o[2]["type"] == "custom_tool_call" and o[2]["name"] == "grammar" and o[2]["namespace"] == "ns"
    assert o[2]["input"] == "not json"  # fallback: the raw arguments
    assert o[3]["name"] == "unknown_fn" and o[3]["type"] == "function_call"
    # custom calls stream no argument deltas; their input comes with the close
    custom_ids = {o[0]["id"], o[2]["id"]}
    assert not [e for e in events
                if e["type"] == "response.function_call_arguments.delta" and e["item_id"] in custom_ids]
    dones = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert [d["input"] for d in dones] == ["*** Begin Patch\n", "not json"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added[0]["input"] == "" and added[1]["namespace"] == "files"


def test_reasoning_items_false_hides_reasoning():
    out, rw = run([BODIES["final_chat_stream"]], ctx(reasoning_items=False))
    events = parse(out)
    sdk_check(events)
    assert not [e for e in events if "reasoning" in e["type"]]
    assert [i["type"] for i in rw.response["output"]] == ["message"]
    assert rw.response["output"][0]["content"][0]["text"] == upstream_parts(BODIES["final_chat_stream"])[1]
    assert rw.usage["output_tokens_details"]["reasoning_tokens"] == 14
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0]


def test_seal_callback():
    sealed = []

    def seal(text):
        sealed.append(text)
        return "gAAAA" + text[::-1]

    out, rw = run([BODIES["final_chat_stream"]], ctx(seal=seal))
    events = parse(out)
    sdk_check(events)
    reasoning = upstream_parts(BODIES["final_chat_stream"])[0]
    assert sealed == [reasoning]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "reasoning"]
    assert done[0]["encrypted_content"] == "gAAAA" + reasoning[::-1]
    assert rw.response["output"][0]["encrypted_content"] == "gAAAA" + reasoning[::-1]


# ---------------------------------------------------------------- endings
def test_length_incomplete_reasoning_only():
    out, rw = run([BODIES["final_chat_stream_length"]])
    events = parse(out)
    sdk_check(events)
    assert events[-1]["type"] == "response.incomplete" and rw.status == "incomplete"
    assert rw.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["status"] for i in rw.response["output"]] == ["incomplete"]


def test_content_filter_incomplete():
    body = sse(chunk({"content": "Some"}), chunk({"content": " text"}, "content_filter"),
               chunk(choices=False, usage=USAGE))
    out, rw = run([body])
    events = parse(out)
    sdk_check(events)
    assert events[-1]["type"] == "response.incomplete"
    assert rw.response["incomplete_details"] == {"reason": "content_filter"}
    assert rw.response["output"][0]["content"][0]["text"] == "Some text"


def test_forced_named_call_ending_in_stop_is_completed():
    body = BODIES["final_named_stream"]
    assert b'"finish_reason":"stop"' in body and b'"tool_calls"' in body
    out, rw = run([body])
    sdk_check(parse(out))
    assert rw.status == "completed" and rw.response["output"][-1]["type"] == "function_call"


def test_tool_calls_finish_without_calls_is_completed():
    body = sse(chunk({"reasoning": " 837,],romarn"}), chunk({"content": ""}, "tool_calls"),
               chunk(choices=False, usage=USAGE))
    out, rw = run([body])
    events = parse(out)
    sdk_check(events)
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in rw.response["output"]] == ["reasoning"]


def test_done_without_finish_reason_fails():
    body = sse(chunk({"content": "partial"}))
    out, rw = run([body])
    events = parse(out)
    sdk_check(events)
    assert events[-1]["type"] == "response.failed" and rw.status == "failed"
    r = rw.response
    assert r["error"]["code"] == "server_error" and "finish_reason" in r["error"]["message"]
    assert r["output"][0]["status"] == "incomplete" and r["output"][0]["content"][0]["text"] == "partial"
    # a half-finished item is not presented as done
    assert not [e for e in events if e["type"] == "response.output_item.done"]
    assert r["retry_after_ms"] == 1000 and r["x_should_retry"] is True


def test_eof_without_finish_fails_and_eof_after_finish_completes():
    out, rw = run([sse(chunk({"content": "x"}), done=False)])
    assert parse(out)[-1]["type"] == "response.failed"
    out, rw = run([sse(chunk({"content": "x"}, "stop"), done=False)])
    assert parse(out)[-1]["type"] == "response.completed" and rw.usage is None
    # unterminated [DONE] at EOF still counts
    out, rw = run([sse(chunk({"content": "x"}, "stop"), done=False) + b"data: [DONE]"])
    assert parse(out)[-1]["type"] == "response.completed"


def test_error_first_event():
    body = b'data: {"error": {"message": "model overloaded", "type": "InternalServerError", "code": 503}}\n\n'
    out, rw = run([body])
    events = parse(out)
    sdk_check(events)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    r = rw.response
    assert r["status"] == "failed" and r["error"] == {"code": "server_error", "message": "model overloaded"}
    assert r["id"] == "resp_" + "ab" * 12 and r["model"] == "vendor/glm-5.3"
    assert r["retry_after_ms"] == 1000 and r["x_should_retry"] is True and r["output"] == []


@pytest.mark.parametrize(
    "err,code,retry",
    [
        ({"object": "error", "message": "slow down", "type": "RateLimitError", "code": 429},
         "rate_limit_exceeded", True),
        ({"object": "error", "message": "context too long", "type": "BadRequestError", "code": 400},
         "server_error", False),
        ({"error": "plain string"}, "server_error", True),
    ],
)
def test_error_mid_stream(err, code, retry):
    body = sse(chunk({"reasoning": "hmm"}), chunk({"content": "Hel"}),
               chunk({"tool_calls": [{"id": "t", "index": 0, "function": {"name": "f", "arguments": "{"}}]}), err)
    out, rw = run([body])
    events = parse(out)
    sdk_check(events)
    assert events[-1]["type"] == "response.failed"
    r = rw.response
    assert r["error"]["code"] == code and r["x_should_retry"] is retry
    assert (r["retry_after_ms"] is not None) is retry
    assert [(i["type"], i["status"]) for i in r["output"]] == [
        ("reasoning", "completed"), ("message", "incomplete"), ("function_call", "incomplete")]
    assert rw.feed(b"data: [DONE]\n\n") == b"" and rw.finish() == b"" and rw.fail("x") == b""


def test_external_fail():
    rw = StreamRewriter(ctx())
    out = rw.start() + rw.feed(sse(chunk({"content": "abc"}), done=False))
    out += rw.fail("upstream timed out after 30s", code="upstream_timeout", retry_after_ms=2500)
    events = parse(out)
    sdk_check(events)
    r = rw.response
    assert r["error"] == {"code": "server_error", "message": "upstream timed out after 30s", "type": "upstream_timeout"}
    assert r["retry_after_ms"] == 2500 and r["x_should_retry"] is True
    assert rw.done and rw.status == "failed"
    assert rw.feed(b"data: {}\n\n") == b"" and rw.fail("again") == b"" and rw.finish() == b""
    rw2 = StreamRewriter(ctx())
    out2 = rw2.fail("refused", code="rate_limit_exceeded", retry_after_ms=None, should_retry=False)
    ev2 = parse(out2)  # fail before start still opens the stream properly
    sdk_check(ev2)
    assert rw2.response["error"]["code"] == "rate_limit_exceeded" and rw2.response["retry_after_ms"] is None


def test_garbage_and_endless_line():
    out, rw = run([b"data: {\"choices\": []}\n\ndata: <html>oops</html>\n\n"])
    events = parse(out)
    sdk_check(events)
    assert rw.status == "failed" and "not JSON" in rw.response["error"]["message"]
    out, rw = run([b"data: [1, 2]\n\n"])
    assert rw.status == "failed" and "not an object" in rw.response["error"]["message"]
    big = b"data: {\"x\": \"" + b"a" * (1 << 20)
    rw = StreamRewriter(ctx())
    out = rw.start() + rw.feed(big[: 1 << 19]) + rw.feed(big[1 << 19:])
    events = parse(out)
    sdk_check(events)
    assert rw.status == "failed" and "longer than" in rw.response["error"]["message"]
    assert rw.feed(b'"}\n\n') == b""


def test_feed_after_done_and_feed_before_start():
    rw = StreamRewriter(ctx())
    out = rw.feed(BODIES["chat_stream_usage"])  # no start(): started implicitly
    events = parse(out)
    sdk_check(events)
    assert rw.done and rw.feed(b"data: [DONE]\n\n") == b"" and rw.finish() == b""
    assert rw.start() == b""


def test_usage_fallback_counts_deltas():
    body = sse(chunk({"reasoning": "a"}), chunk({"reasoning": "b"}), chunk({"content": "c"}),
               chunk({"content": ""}), chunk({"tool_calls": [{"id": "i", "index": 0, "function": {"name": "f"}}]}),
               chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}), chunk({}, "tool_calls"))
    out, rw = run([body])
    sdk_check(parse(out))
    assert rw.usage is None and rw.output_tokens_seen == 4
    assert rw.response["usage"] == {"input_tokens": 0,
                                    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                                    "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 2},
                                    "total_tokens": 4}


def test_usage_mapping_cached_and_written():
    u = orjson.loads((FIX / "final_required.body").read_bytes())["usage"]
    assert map_usage(u) == {"input_tokens": 411,
                            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 384},
                            "output_tokens": 59, "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 470}
    out, rw = run([BODIES["final_named_stream"]])
    assert rw.usage["input_tokens_details"] == {"cached_tokens": 384, "cache_write_tokens": 0}


def test_other_choices_ignored():
    other = chunk({"content": "B"})
    other["choices"][0]["index"] = 1
    body = sse(chunk({"content": "A"}), other, chunk({}, "stop"))
    _, rw = run([body])
    assert rw.response["output"][0]["content"][0]["text"] == "A"


# ---------------------------------------------------------------- non-stream
def _shape(resp):
    return [(i["type"], i.get("status"), i.get("name")) for i in resp["output"]]


@pytest.mark.parametrize(
    "nonstream,stream,exact",
    [
        ("final_chat", "final_chat_stream", True),
        ("qwen3_plain_seed1", "qwen3_plain_stream_seed1", True),
        ("r1_nonstream", "r1_stream", True),
        ("final_json_schema", "final_json_schema_stream", True),
        ("toolmodel_auto_seed2", "toolmodel_auto_stream_seed2", True),
        ("final_required", "final_required_stream", False),
        ("final_named", "final_named_stream", False),
    ],
)
def test_response_from_completion_matches_stream(nonstream, stream, exact):
    completion = orjson.loads((FIX / f"{nonstream}.body").read_bytes())
    got = response_from_completion(det(ctx()), completion)
    Response.model_validate(got)
    _, rw = run([BODIES[stream]])
    want = rw.response
    if exact:  # same seed, same text: the whole Response object is identical (tool ids are upstream-random)
        for r in (got, want):
            for i in r["output"]:
                if "call_id" in i:
                    assert i["call_id"].startswith("chatcmpl-tool-")
                    i["call_id"] = "<upstream>"
        assert normalise(got) == normalise(want)
    else:
        assert _shape(got) == _shape(want) and got["status"] == want["status"]
        calls = [i for i in got["output"] if i["type"] == "function_call"]
        msg = completion["choices"][0]["message"]
        assert [c["arguments"] for c in calls] == [t["function"]["arguments"] for t in msg["tool_calls"]]
        assert [c["call_id"] for c in calls] == [t["id"] for t in msg["tool_calls"]]


def test_response_from_completion_variants():
    # qwen3: finish_reason tool_calls with no tool_calls, reasoning only -> completed
    got = response_from_completion(ctx(), orjson.loads((FIX / "qwen3_required_seed6.body").read_bytes()))
    Response.model_validate(got)
    assert got["status"] == "completed" and _shape(got) == [("reasoning", "completed", None)]
    # ended inside reasoning, content null
    got = response_from_completion(ctx(), orjson.loads((FIX / "qwen3_json_schema_seed6.body").read_bytes()))
    Response.model_validate(got)
    assert [i["type"] for i in got["output"]] == ["reasoning"]
    # n=2: the first choice; length -> incomplete; reasoning_items False; seal
    comp = orjson.loads((FIX / "chat_n2_logprobs.body").read_bytes())
    got = response_from_completion(ctx(reasoning_items=False), comp)
    assert got["status"] == "incomplete" and got["output"] == [] and got["usage"]["output_tokens"] == 10
    got = response_from_completion(ctx(seal=lambda t: "S:" + t), comp)
    assert got["output"][0]["encrypted_content"] == "S:ast]], 948"
    # SGLang: reasoning_content, custom tool
    sg = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning_content": "plan",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "apply_patch", "arguments": "{\"input\": \"diff\"}"}}]}}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    got = response_from_completion(ctx(tools={"apply_patch": ToolOrigin("custom", "apply_patch")}), sg)
    Response.model_validate(got)
    assert [(i["type"], i.get("input")) for i in got["output"]] == [("reasoning", None), ("custom_tool_call", "diff")]
    assert got["ai_generated"] is True
    # an error body or no choices -> failed
    got = response_from_completion(ctx(), {"object": "error", "message": "bad", "code": 400})
    Response.model_validate(got)
    assert got["status"] == "failed" and got["error"]["message"] == "bad" and got["x_should_retry"] is False
    got = response_from_completion(ctx(), {"choices": []})
    assert got["status"] == "failed"


def test_late_deltas_ignored_and_reasoning_after_text_opens_new_item():
    body = sse(chunk({"content": "A"}), chunk({"reasoning": "r2"}), chunk({"content": "B"}, "stop"),
               chunk({"content": "late"}), chunk(choices=False, usage=USAGE))
    out, rw = run([body])
    events = parse(out)
    sdk_check(events)
    o = rw.response["output"]
    assert [(i["type"], i["status"]) for i in o] == [("message", "completed"), ("reasoning", "completed")]
    assert o[0]["content"][0]["text"] == "AB" and o[1]["summary"][0]["text"] == "r2"
    assert rw.output_tokens_seen == 3


def test_seal_without_clear_text():
    reasoning = upstream_parts(BODIES["final_chat_stream"])[0]
    c = ctx(seal=lambda t: "rp1." + t.encode().hex(), reasoning_in_clear=False)
    out, rw = run([BODIES["final_chat_stream"]], c)
    events = parse(out)
    sdk_check(events)
    assert not [e for e in events if e["type"].startswith("response.reasoning_summary")]
    assert reasoning not in out.decode()
    item = rw.response["output"][0]
    assert item["summary"] == [] and item["encrypted_content"] == "rp1." + reasoning.encode().hex()
    # without a seal the flag changes nothing: the text is all there is
    _, rw2 = run([BODIES["final_chat_stream"]], ctx(reasoning_in_clear=False))
    assert rw2.response["output"][0]["summary"][0]["text"] == reasoning
    # a failure mid-reasoning keeps the text hidden too
    _, rw3 = run([sse(chunk({"reasoning": "secret"}), done=False)], ctx(seal=str.upper, reasoning_in_clear=False))
    assert rw3.status == "failed" and rw3.response["output"][0]["summary"] == []


class _EventList:
    """Another transport's encoder (as a WebSocket one would be): events as dicts, no SSE bytes."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def event(self, ev: events.Event) -> None:
        self.events.append({"type": ev.type, "sequence_number": len(self.events), **orjson.loads(
            orjson.dumps(dataclasses.asdict(ev)))})  # type: ignore[call-overload]

    def delta(self, kind: type, item_id: str, output_index: int, text: str) -> None:
        if kind is events.OutputTextDelta:
            self.event(events.OutputTextDelta(item_id, output_index, 0, text))
        elif kind is events.ReasoningSummaryTextDelta:
            self.event(events.ReasoningSummaryTextDelta(item_id, output_index, 0, text))
        else:
            self.event(kind(item_id, output_index, text))

    def text_run(self, item_id: str, output_index: int, texts: list[bytes]) -> None:
        for text in texts:
            self.delta(events.OutputTextDelta, item_id, output_index, text.decode())

    def end(self) -> None:
        pass

    def take(self) -> bytes:
        return b""


@pytest.mark.parametrize("name", ["final_chat_stream", "r1_stream", "final_required_stream"])
def test_another_encoder_gets_the_same_events(name):
    """The rewriter's core with another encoder: the same events, in the same order, as the
    SSE bytes carry (what a WebSocket transport would send as frames)."""
    out, _ = run([BODIES[name]])
    events = _EventList()
    rw = StreamRewriter(det(ctx()), encoder=events)
    assert rw.start() + rw.feed(BODIES[name]) + rw.finish() == b""
    assert events.events == parse(out)
    sdk_check(events.events)


# ---------------------------------------------------------------- the stream's opening


def _big_first_read(*, whole: bool) -> bytes:
    texts = [chunk({"content": f"word{i} "}) for i in range(80)]
    tail = [chunk(finish="stop", usage=USAGE)] if whole else []
    return sse(chunk({"role": "assistant", "content": ""}), *texts, *tail, done=whole)


def test_a_big_first_read_opens_with_its_first_events_before_the_rest_is_rewritten():
    first = _big_first_read(whole=False)
    assert len(first) > 2048
    rw = StreamRewriter(det(ctx()))
    opening = rw.opening(first)
    head, last = next(opening)
    assert not last
    seen = rw.output_tokens_seen  # the rest of the read is not rewritten before the head is written
    assert [e["type"] for e in parse(head)][:3] == ["response.created", "response.in_progress",
                                                    "response.output_item.added"]
    assert b"word0 " in head and b"word1 " not in head
    rest, last = next(opening)
    assert last and rw.output_tokens_seen > seen and b"word79 " in rest
    assert next(opening, None) is None
    # the same bytes as one start and one feed of the whole read
    assert head + rest == run([first], finish=False)[0]


@pytest.mark.parametrize("first", [_big_first_read(whole=True), sse(chunk({"content": "hi"}), done=False)],
                         ids=["whole_answer", "small_read"])
def test_a_first_read_that_is_whole_or_small_is_one_write(first):
    rw = StreamRewriter(det(ctx()))
    writes = list(rw.opening(first))
    assert len(writes) == 1 and writes[0][1] is True
    assert writes[0][0] == run([first], finish=False)[0]
