"""The Responses stream's events, one class per event type of the spec (sans-I/O, pure data).

The assembler makes them, an encoder writes them (proxy.protocol.encoder), a transport may
look at them on the way (a WebSocket turn's `on_event`). Each class knows its `type` (a class
attribute, the spec's string) and holds the event's fields in the spec's order, without
`type` and `sequence_number` (the encoder numbers the events of a stream). Its instance
`__dict__` is therefore the event's fields, in order: the encoder writes

    {"type":<type>,"sequence_number":<n>, ...orjson.dumps(event.__dict__) without its "{"}

which is, byte for byte, orjson.dumps of the whole event dict the spec names
(tests/protocol/test_events.py holds every class to it).

Fields that are always the same on this proxy's events (`content_index`, `summary_index`: one
part per item; `logprobs`: none) have defaults; `logprobs` is the empty tuple, which JSON
writes as `[]` as it writes an empty list.

Why plain dataclasses: measured per event (construct + serialize, one process, timeit), a
dict literal and orjson.dumps 235 ns; this class and orjson.dumps(ev.__dict__) 345 ns; a
dict subclass 354 ns; a slots dataclass serialized natively by orjson 844 ns (orjson reads
a slot per field through getattr); a NamedTuple turned into a dict 733 ns. Only the events
around the deltas are built this way (about ten per response); each streamed delta is
written by the encoder from a byte template per item (`SSEEncoder.delta`, `text_run`) and
never made an object: its class (OutputTextDelta, ...) names the template.

`WithHeaders` is no event: a transport's own `headers` object after an event's fields (a
WebSocket turn carries its answer's notices header so on its first event).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "Event", "ResponseEvent", "TerminalEvent", "DeltaEvent",
    "ResponseCreated", "ResponseInProgress", "ResponseCompleted", "ResponseIncomplete", "ResponseFailed",
    "OutputItemAdded", "OutputItemDone", "ContentPartAdded", "ContentPartDone",
    "OutputTextDelta", "OutputTextDone",
    "ReasoningSummaryPartAdded", "ReasoningSummaryPartDone",
    "ReasoningSummaryTextDelta", "ReasoningSummaryTextDone",
    "FunctionCallArgumentsDelta", "FunctionCallArgumentsDone",
    "CustomToolCallInputDelta", "CustomToolCallInputDone",
    "WithHeaders", "EVENT_TYPES", "terminal_event",
]


class Event:
    """A Responses stream event: `type` (the spec's name) and its fields as instance attributes."""

    __slots__ = ()
    type: ClassVar[str]


# ---------------------------------------------------------------- the response's own events
@dataclass(eq=True)
class ResponseEvent(Event):
    """An event that carries the whole Response object (its state at that point)."""

    response: dict[str, Any]


@dataclass(eq=True)
class ResponseCreated(ResponseEvent):
    type: ClassVar[str] = "response.created"


@dataclass(eq=True)
class ResponseInProgress(ResponseEvent):
    type: ClassVar[str] = "response.in_progress"


@dataclass(eq=True)
class TerminalEvent(ResponseEvent):
    """The last event of a response: its final Response object (then the stream ends)."""


@dataclass(eq=True)
class ResponseCompleted(TerminalEvent):
    type: ClassVar[str] = "response.completed"


@dataclass(eq=True)
class ResponseIncomplete(TerminalEvent):
    type: ClassVar[str] = "response.incomplete"


@dataclass(eq=True)
class ResponseFailed(TerminalEvent):
    type: ClassVar[str] = "response.failed"


_TERMINAL: dict[str, type[TerminalEvent]] = {
    "completed": ResponseCompleted, "incomplete": ResponseIncomplete, "failed": ResponseFailed}


def terminal_event(response: dict[str, Any]) -> TerminalEvent:
    """The terminal event of a final Response object, by its status (failed unless completed
    or incomplete)."""
    return _TERMINAL.get(response.get("status"), ResponseFailed)(response)  # type: ignore[arg-type]


# ---------------------------------------------------------------- output items
@dataclass(eq=True)
class OutputItemAdded(Event):
    type: ClassVar[str] = "response.output_item.added"
    output_index: int
    item: dict[str, Any]


@dataclass(eq=True)
class OutputItemDone(Event):
    type: ClassVar[str] = "response.output_item.done"
    output_index: int
    item: dict[str, Any]


# ---------------------------------------------------------------- a message's content part
@dataclass(eq=True)
class ContentPartAdded(Event):
    type: ClassVar[str] = "response.content_part.added"
    item_id: str
    output_index: int
    content_index: int
    part: dict[str, Any]


@dataclass(eq=True)
class ContentPartDone(Event):
    type: ClassVar[str] = "response.content_part.done"
    item_id: str
    output_index: int
    content_index: int
    part: dict[str, Any]


class DeltaEvent(Event):
    """A per-token event of an item (its `delta`): written from the encoder's template."""

    __slots__ = ()


@dataclass(eq=True)
class OutputTextDelta(DeltaEvent):
    type: ClassVar[str] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: tuple[()] | list[Any] = ()


@dataclass(eq=True)
class OutputTextDone(Event):
    type: ClassVar[str] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: tuple[()] | list[Any] = ()


# ---------------------------------------------------------------- a reasoning item's summary
@dataclass(eq=True)
class ReasoningSummaryPartAdded(Event):
    type: ClassVar[str] = "response.reasoning_summary_part.added"
    item_id: str
    output_index: int
    summary_index: int
    part: dict[str, Any]


@dataclass(eq=True)
class ReasoningSummaryPartDone(Event):
    type: ClassVar[str] = "response.reasoning_summary_part.done"
    item_id: str
    output_index: int
    summary_index: int
    part: dict[str, Any]


@dataclass(eq=True)
class ReasoningSummaryTextDelta(DeltaEvent):
    type: ClassVar[str] = "response.reasoning_summary_text.delta"
    item_id: str
    output_index: int
    summary_index: int
    delta: str


@dataclass(eq=True)
class ReasoningSummaryTextDone(Event):
    type: ClassVar[str] = "response.reasoning_summary_text.done"
    item_id: str
    output_index: int
    summary_index: int
    text: str


# ---------------------------------------------------------------- tool calls
@dataclass(eq=True)
class FunctionCallArgumentsDelta(DeltaEvent):
    type: ClassVar[str] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


@dataclass(eq=True)
class FunctionCallArgumentsDone(Event):
    type: ClassVar[str] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    arguments: str


@dataclass(eq=True)
class CustomToolCallInputDelta(Event):
    """Not a template delta: a custom tool's input is only known whole, one delta at its end."""

    type: ClassVar[str] = "response.custom_tool_call_input.delta"
    item_id: str
    output_index: int
    delta: str


@dataclass(eq=True)
class CustomToolCallInputDone(Event):
    type: ClassVar[str] = "response.custom_tool_call_input.done"
    item_id: str
    output_index: int
    input: str


# ---------------------------------------------------------------- a transport's addition
@dataclass(eq=True)
class WithHeaders:
    """An event and the `headers` object a transport writes after its fields."""

    event: Event
    headers: dict[str, str]


# Every event type this proxy writes, by its `type`.
EVENT_TYPES: dict[str, type[Event]] = {cls.type: cls for cls in (
    ResponseCreated, ResponseInProgress, ResponseCompleted, ResponseIncomplete, ResponseFailed,
    OutputItemAdded, OutputItemDone, ContentPartAdded, ContentPartDone, OutputTextDelta, OutputTextDone,
    ReasoningSummaryPartAdded, ReasoningSummaryPartDone, ReasoningSummaryTextDelta, ReasoningSummaryTextDone,
    FunctionCallArgumentsDelta, FunctionCallArgumentsDone, CustomToolCallInputDelta, CustomToolCallInputDone)}
