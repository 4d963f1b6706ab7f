"""The Responses events as types (proxy.protocol.events) against the dicts the spec names.

Each event class's type and field order are pinned here by a table written from the spec
(not read from the classes), each one's encoded bytes (SSE and JSON lines, the template path of
the deltas too) equal orjson.dumps of the whole event dict, the SDK's own model of each type
reads what is written, and a property test over the assembler checks every event it makes,
in every order it makes them, and the bytes of the stream they are."""

from __future__ import annotations

import dataclasses
import typing

import orjson
import pytest
from hypothesis import given, settings, strategies as st
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from proxy.protocol import events
from proxy.protocol.assembler import Assembler
from proxy.protocol.deltas import (
    END,
    OUTPUT_TOKEN,
    Finish,
    Invalid,
    Reasoning,
    Text,
    TextRun,
    ToolCallFragment,
    UpstreamError,
    Usage,
)
from proxy.protocol.encoder import JSONLinesEncoder, SSEEncoder
from proxy.protocol.events import EVENT_TYPES, DeltaEvent, Event, WithHeaders
from proxy.protocol.response import ResponseContext
from proxy.protocol.translate import ToolOrigin

# Every event the proxy writes: its type, and its fields after type and sequence_number, in
# the order the spec's examples write them (what the bytes carry).
SPEC: dict[str, tuple[str, ...]] = {
    "response.created": ("response",),
    "response.in_progress": ("response",),
    "response.completed": ("response",),
    "response.incomplete": ("response",),
    "response.failed": ("response",),
    "response.output_item.added": ("output_index", "item"),
    "response.output_item.done": ("output_index", "item"),
    "response.content_part.added": ("item_id", "output_index", "content_index", "part"),
    "response.content_part.done": ("item_id", "output_index", "content_index", "part"),
    "response.output_text.delta": ("item_id", "output_index", "content_index", "delta", "logprobs"),
    "response.output_text.done": ("item_id", "output_index", "content_index", "text", "logprobs"),
    "response.reasoning_summary_part.added": ("item_id", "output_index", "summary_index", "part"),
    "response.reasoning_summary_part.done": ("item_id", "output_index", "summary_index", "part"),
    "response.reasoning_summary_text.delta": ("item_id", "output_index", "summary_index", "delta"),
    "response.reasoning_summary_text.done": ("item_id", "output_index", "summary_index", "text"),
    "response.function_call_arguments.delta": ("item_id", "output_index", "delta"),
    "response.function_call_arguments.done": ("item_id", "output_index", "arguments"),
    "response.custom_tool_call_input.delta": ("item_id", "output_index", "delta"),
    "response.custom_tool_call_input.done": ("item_id", "output_index", "input"),
}
CLASS_NAMES = {
    "ResponseCreated": "response.created", "ResponseInProgress": "response.in_progress",
    "ResponseCompleted": "response.completed", "ResponseIncomplete": "response.incomplete",
    "ResponseFailed": "response.failed", "OutputItemAdded": "response.output_item.added",
    "OutputItemDone": "response.output_item.done", "ContentPartAdded": "response.content_part.added",
    "ContentPartDone": "response.content_part.done", "OutputTextDelta": "response.output_text.delta",
    "OutputTextDone": "response.output_text.done",
    "ReasoningSummaryPartAdded": "response.reasoning_summary_part.added",
    "ReasoningSummaryPartDone": "response.reasoning_summary_part.done",
    "ReasoningSummaryTextDelta": "response.reasoning_summary_text.delta",
    "ReasoningSummaryTextDone": "response.reasoning_summary_text.done",
    "FunctionCallArgumentsDelta": "response.function_call_arguments.delta",
    "FunctionCallArgumentsDone": "response.function_call_arguments.done",
    "CustomToolCallInputDelta": "response.custom_tool_call_input.delta",
    "CustomToolCallInputDone": "response.custom_tool_call_input.done",
}
_RESPONSE = {"id": "resp_1", "object": "response", "status": "in_progress", "output": [], "usage": None}
_ITEM = {"type": "message", "id": "msg_1", "status": "in_progress", "role": "assistant", "content": []}
_PART = {"type": "output_text", "text": "hé \"\n", "annotations": [], "logprobs": []}
# A value per field name (the spec's dict and the object get the same one).
_VALUES: dict[str, typing.Any] = {
    "response": _RESPONSE, "output_index": 3, "item": _ITEM, "item_id": "msg_\u00e9\"x", "content_index": 0,
    "summary_index": 0, "part": _PART, "delta": "a\nb\\c\u2028😀", "text": "whole \"text\"", "logprobs": [],
    "arguments": '{"city":"Paris"}', "input": "ls -la\n",
}


def spec_dict(event_type: str, seq: int, values: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """The whole event as the spec names it."""
    return {"type": event_type, "sequence_number": seq, **{name: values[name] for name in SPEC[event_type]}}


def sse(event: dict[str, typing.Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (event["type"].encode(), orjson.dumps(event))


def make(cls: type[Event], values: dict[str, typing.Any]) -> Event:
    return cls(*(values[name] for name in SPEC[cls.type]))  # type: ignore[call-arg]


def fields_of(ev: Event) -> dict[str, typing.Any]:
    """An event object's fields by the spec's names, in the spec's order (a tuple as the list
    JSON makes of it)."""
    return {name: list(v) if isinstance(v := getattr(ev, name), tuple) else v for name in SPEC[ev.type]}


def test_every_event_type_is_a_class_named_after_it():
    assert set(EVENT_TYPES) == set(SPEC)
    assert {name: getattr(events, name).type for name in CLASS_NAMES} == CLASS_NAMES
    for event_type, cls in EVENT_TYPES.items():
        assert cls.type == event_type and issubclass(cls, Event)
        assert tuple(f.name for f in dataclasses.fields(cls)) == SPEC[event_type]  # the wire's order
    assert {cls.type for cls in EVENT_TYPES.values() if issubclass(cls, DeltaEvent)} == {
        "response.output_text.delta", "response.reasoning_summary_text.delta", "response.function_call_arguments.delta"}
    terminal = {cls.type for cls in EVENT_TYPES.values() if issubclass(cls, events.TerminalEvent)}
    assert terminal == {"response.completed", "response.incomplete", "response.failed"}


@pytest.mark.parametrize("event_type", sorted(SPEC))
def test_each_event_encodes_as_the_spec_dict(event_type):
    cls = EVENT_TYPES[event_type]
    ev = make(cls, _VALUES)
    for seq in (0, 1, 8191, 8192, 123_456):  # the precomputed sequence numbers and past them
        enc = SSEEncoder()
        enc.seq = seq
        enc.event(ev)
        assert enc.take() == sse(spec_dict(event_type, seq, _VALUES))
        lines = JSONLinesEncoder()
        lines.seq = seq
        lines.event(ev)
        assert lines.take() == orjson.dumps(spec_dict(event_type, seq, _VALUES)) + b"\n"
    # with a transport's headers: after the event's own fields
    lines = JSONLinesEncoder(lambda e: WithHeaders(e, {"x-token-notice": "n"}))
    lines.event(ev)
    headed = {**spec_dict(event_type, 0, _VALUES), "headers": {"x-token-notice": "n"}}
    assert lines.take() == orjson.dumps(headed) + b"\n"


_SDK = TypeAdapter(ResponseStreamEvent)


@pytest.mark.parametrize("event_type", sorted(SPEC))
def test_the_sdk_reads_each_event_as_its_type(event_type):
    enc = JSONLinesEncoder()
    values = {**_VALUES, "response": {**_RESPONSE, "created_at": 1, "model": "m", "parallel_tool_calls": True,
                                      "tool_choice": "auto", "tools": []},
              "part": {"type": "summary_text", "text": "t"} if "reasoning" in event_type else _PART}
    enc.event(make(EVENT_TYPES[event_type], values))
    parsed = _SDK.validate_json(enc.take())
    assert parsed.type == event_type and parsed.sequence_number == 0


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted((c for c in EVENT_TYPES.values() if issubclass(c, DeltaEvent)),
                                   key=lambda c: c.type)),
       item_id=st.text(min_size=1, max_size=12), index=st.integers(0, 300),
       texts=st.lists(st.text(max_size=8), min_size=1, max_size=5), seq=st.sampled_from([0, 8190, 9000]))
def test_the_delta_templates_are_the_delta_events(kind, item_id, index, texts, seq):
    """SSEEncoder.delta and text_run (the byte templates) write what event() writes for the
    delta event objects, so the fast path is the typed event."""
    def ev(text: str) -> Event:
        values = {**_VALUES, "item_id": item_id, "output_index": index, "delta": text}
        return make(kind, values)

    for cls in (SSEEncoder, JSONLinesEncoder):
        fast, typed = cls(), cls()
        fast.seq = typed.seq = seq
        for text in texts:
            fast.delta(kind, item_id, index, text)
            typed.event(ev(text))
        assert fast.take() == typed.take()
        plain = [t.encode() for t in texts if t.isascii() and t.isprintable() and '"' not in t and "\\" not in t]
        if kind is events.OutputTextDelta and plain:
            fast.text_run(item_id, index, plain)
            for text in plain:
                typed.event(ev(text.decode()))
            assert fast.take() == typed.take()


# ------------------------------------------------------------ every event the assembler makes
class Recording:
    """An SSEEncoder that keeps each event it is handed (a delta as its event object)."""

    def __init__(self) -> None:
        self.inner = SSEEncoder()
        self.seen: list[Event] = []
        self.ended = False

    def event(self, ev: Event) -> None:
        self.seen.append(ev)
        self.inner.event(ev)

    def delta(self, kind: type[DeltaEvent], item_id: str, output_index: int, text: str) -> None:
        values = {**_VALUES, "item_id": item_id, "output_index": output_index, "delta": text, "logprobs": []}
        self.seen.append(make(kind, values))
        self.inner.delta(kind, item_id, output_index, text)

    def text_run(self, item_id: str, output_index: int, texts: list[bytes]) -> None:
        for text in texts:
            self.seen.append(events.OutputTextDelta(item_id, output_index, 0, text.decode()))
        self.inner.text_run(item_id, output_index, texts)

    def end(self) -> None:
        self.ended = True
        self.inner.end()

    def take(self) -> bytes:
        return self.inner.take()


_plain = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\'),
                 min_size=1, max_size=6)
_deltas = st.one_of(
    st.builds(Text, st.text(min_size=1, max_size=6)),
    st.builds(Reasoning, st.text(min_size=1, max_size=6)),
    st.builds(ToolCallFragment, st.sampled_from([0, 1, None]), st.sampled_from([None, "call_a", "call_b"]),
              st.sampled_from([None, "get_weather", "shell", "other"]), st.one_of(st.none(), st.text(max_size=6))),
    st.just(OUTPUT_TOKEN),
    st.builds(TextRun, st.lists(_plain.map(str.encode), min_size=1, max_size=4)),
    st.builds(Usage, st.just({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})),
    st.builds(Finish, st.sampled_from(["stop", "length", "tool_calls", "content_filter", "abort"])),
    st.just(END),
    st.builds(Invalid, st.just("bad chunk")),
    st.builds(UpstreamError, st.just("overloaded"), st.just("server_error"), st.just(1000), st.just(True)),
)


@settings(max_examples=150, deadline=None)
@given(deltas=st.lists(_deltas, max_size=14), reasoning_items=st.booleans(), sealed=st.booleans(),
       cap=st.one_of(st.none(), st.integers(0, 6)), fail=st.booleans())
def test_every_event_the_assembler_makes_is_its_type_and_the_spec_dict(deltas, reasoning_items, sealed, cap, fail):
    counter = iter(range(10_000))
    c = ResponseContext(response_id="resp_" + "ab" * 12, model="m", created_at=1, echo={},
                        tools={"shell": ToolOrigin("custom", "shell")}, reasoning_items=reasoning_items,
                        seal=(lambda t: "sealed:" + t) if sealed else None, reasoning_in_clear=not sealed,
                        output_cap=cap, ids=lambda: f"{next(counter):024x}", clock=lambda: 7)
    rec = Recording()
    asm = Assembler(c, rec)
    asm.start()
    asm.feed(deltas)
    if fail:
        asm.fail("upstream timed out", "upstream_timeout", 1000, True)
    asm.end_of_input()
    assert asm.done and rec.ended
    expected = []
    for seq, ev in enumerate(rec.seen):
        cls = EVENT_TYPES[ev.type]
        assert type(ev) is cls  # each event is its type's class, nothing else
        expected.append(sse({"type": ev.type, "sequence_number": seq, **fields_of(ev)}))
    assert rec.take() == b"".join(expected) + b"data: [DONE]\n\n"
    kinds = [type(ev) for ev in rec.seen]
    assert kinds[:2] == [events.ResponseCreated, events.ResponseInProgress]
    assert issubclass(kinds[-1], events.TerminalEvent)
    assert not any(issubclass(k, events.TerminalEvent) for k in kinds[:-1])
    assert rec.seen[-1].response is asm.response  # type: ignore[attr-defined]
