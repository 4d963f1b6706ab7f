"""Responses events -> SSE bytes: the only place that numbers events and writes bytes (sans-I/O).

The assembler hands over each event as an object of its type (proxy.protocol.events: its
`type`, its fields in the spec's order as its `__dict__`); the encoder writes

    event: <type>\\ndata: {"type":<type>,"sequence_number":<n>,<fields>}\\n\\n

byte for byte what orjson.dumps writes for the whole event dict. The per-token delta events
come as their class (OutputTextDelta, ReasoningSummaryTextDelta, FunctionCallArgumentsDelta)
and their item instead of an object, and are written from a byte template per item (the
constant parts built once), runs of plain text deltas with one join: the same bytes as the
event object would be (tests/protocol/test_events.py). After the terminal event comes the spec's
literal `data: [DONE]`.

`JSONLinesEncoder` writes the same events as one JSON object per line, nothing else (no
`event:` line, no `[DONE]`): a message transport (a WebSocket turn) sends each line as a
message with no parsing (a line break inside JSON is always escaped). It may pass each
non-delta event through `on_event` first (what a transport adds to them: the turn's
previous_response_id, its headers on the first event as a `WithHeaders`)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import ClassVar, Protocol

import orjson

from proxy.protocol.events import (
    DeltaEvent,
    Event,
    FunctionCallArgumentsDelta,
    OutputTextDelta,
    ReasoningSummaryTextDelta,
    WithHeaders,
)

__all__ = ["Encoder", "SSEEncoder", "JSONLinesEncoder", "Discard", "OnEvent"]


class Encoder(Protocol):
    """What the assembler writes to (SSEEncoder, JSONLinesEncoder, Discard, a test's own)."""

    def event(self, ev: Event) -> None: ...
    def delta(self, kind: type[DeltaEvent], item_id: str, output_index: int, text: str) -> None: ...
    def text_run(self, item_id: str, output_index: int, texts: list[bytes]) -> None: ...
    def end(self) -> None: ...
    def take(self) -> bytes: ...


# A transport's look at each non-delta event: the event to write (another object, never the
# assembler's changed in place), or it with the transport's headers.
OnEvent = Callable[[Event], "Event | WithHeaders"]

# The fields of each delta event around its `delta`: % (JSON item id, output_index), then the rest.
_DELTA_FIELDS: dict[type[DeltaEvent], tuple[bytes, bytes]] = {
    OutputTextDelta: (b',"item_id":%s,"output_index":%d,"content_index":0,"delta":', b',"logprobs":[]}\n\n'),
    ReasoningSummaryTextDelta: (b',"item_id":%s,"output_index":%d,"summary_index":0,"delta":', b"}\n\n"),
    FunctionCallArgumentsDelta: (b',"item_id":%s,"output_index":%d,"delta":', b"}\n\n"),
}
_SEQ = tuple(b"%d" % i for i in range(8192))  # sequence_number digits, precomputed
_NSEQ = len(_SEQ)


def _head(event_type: str) -> bytes:
    """What an event of that type starts with, up to its sequence_number."""
    return b'event: %s\ndata: {"type":%s,"sequence_number":' % (event_type.encode(), orjson.dumps(event_type))


class SSEEncoder:
    __slots__ = ("seq", "_out", "_templates")
    # What an event starts with (by type, shared by every stream), the fields of each delta
    # event around its text, what ends an event, and what ends the stream.
    _HEADS: ClassVar[dict[str, bytes]] = {}
    _HEAD = staticmethod(_head)
    _DELTA_FIELDS: ClassVar[dict[type[DeltaEvent], tuple[bytes, bytes]]] = _DELTA_FIELDS
    _END = b"\n\n"
    _DONE = b"data: [DONE]\n\n"

    def __init__(self) -> None:
        self.seq = 0  # the next event's sequence_number
        self._out: list[bytes] = []
        # item id -> its delta events' template (an item streams one kind of delta)
        self._templates: dict[str, tuple[bytes, bytes, bytes]] = {}

    def event(self, ev: Event) -> None:
        """One event (proxy.protocol.events): its head, its number, its fields as orjson writes them."""
        event_type = ev.type
        head = self._HEADS.get(event_type)
        if head is None:
            head = self._HEADS[event_type] = self._HEAD(event_type)
        seq = self.seq
        self.seq = seq + 1
        self._out.append(b"%s%s,%s%s" % (head, _SEQ[seq] if seq < _NSEQ else b"%d" % seq,
                                         orjson.dumps(ev.__dict__)[1:], self._END))

    def _write(self, event_type: str, fields: bytes) -> None:
        """An event of that type whose fields are the JSON object `fields` (at least one field)."""
        head = self._HEADS.get(event_type)
        if head is None:
            head = self._HEADS[event_type] = self._HEAD(event_type)
        seq = self.seq
        self.seq = seq + 1
        self._out.append(b"%s%s,%s%s" % (head, _SEQ[seq] if seq < _NSEQ else b"%d" % seq, fields[1:], self._END))

    def delta(self, kind: type[DeltaEvent], item_id: str, output_index: int, text: str) -> None:
        """One delta event of an item: `kind` is OutputTextDelta, ReasoningSummaryTextDelta or
        FunctionCallArgumentsDelta, written as that event would be, from the item's template."""
        tpl = self._templates.get(item_id) or self._template(kind, item_id, output_index)
        seq = self.seq
        self.seq = seq + 1
        self._out.extend((tpl[0], _SEQ[seq] if seq < _NSEQ else b"%d" % seq, tpl[1], orjson.dumps(text), tpl[2]))

    def text_run(self, item_id: str, output_index: int, texts: list[bytes]) -> None:
        """An OutputTextDelta event per string, each a plain JSON string body (written as is)."""
        head, mid, end = self._templates.get(item_id) or self._template(OutputTextDelta, item_id, output_index)
        n = len(texts)
        seq = self.seq
        seqs = _SEQ[seq:seq + n] if seq + n <= _NSEQ else [b"%d" % i for i in range(seq, seq + n)]
        # head, then per event: seq, mid + quote, text, quote + end + the next head (the last: end)
        pieces = [mid + b'"'] * (4 * n)
        pieces[0::4] = seqs
        pieces[2::4] = texts
        pieces[3::4] = repeat(b'"' + end + head, n)
        pieces[-1] = b'"' + end
        out = self._out
        out.append(head)
        out.extend(pieces)
        self.seq = seq + n

    def end(self) -> None:
        """After the terminal event: the end of the stream."""
        if self._DONE:
            self._out.append(self._DONE)

    def take(self) -> bytes:
        """The bytes written since the last take."""
        out = self._out
        if not out:
            return b""
        self._out = []
        return b"".join(out)

    def _template(self, kind: type[DeltaEvent], item_id: str, output_index: int) -> tuple[bytes, bytes, bytes]:
        mid, tail = self._DELTA_FIELDS[kind]
        event_type = kind.type
        head = self._HEADS.get(event_type) or self._HEADS.setdefault(event_type, self._HEAD(event_type))
        tpl = self._templates[item_id] = (head, mid % (orjson.dumps(item_id), output_index), tail)
        return tpl


class JSONLinesEncoder(SSEEncoder):
    """The same events, one JSON object per line; `on_event(event)` sees each non-delta event
    first and returns the one to write (the same, another, or it `WithHeaders`)."""

    __slots__ = ("_on_event",)
    _HEADS: ClassVar[dict[str, bytes]] = {}
    _HEAD = staticmethod(lambda event_type: b'{"type":%s,"sequence_number":' % orjson.dumps(event_type))
    _DELTA_FIELDS: ClassVar[dict[type[DeltaEvent], tuple[bytes, bytes]]] = {
        kind: (mid, tail[:-2] + b"\n") for kind, (mid, tail) in _DELTA_FIELDS.items()}
    _END = b"\n"
    _DONE = b""

    def __init__(self, on_event: OnEvent | None = None) -> None:
        super().__init__()
        self._on_event = on_event

    def event(self, ev: Event) -> None:
        if self._on_event is None:
            super().event(ev)
            return
        seen = self._on_event(ev)
        if isinstance(seen, WithHeaders):  # the event's fields, then the transport's headers
            inner = seen.event
            self._write(inner.type, b'%s,"headers":%s}' % (orjson.dumps(inner.__dict__)[:-1],
                                                          orjson.dumps(seen.headers)))
        else:
            self._write(seen.type, orjson.dumps(seen.__dict__))


class Discard:
    """An encoder that writes nothing: the non-stream answer only wants the final response."""

    __slots__ = ()

    def event(self, ev: Event) -> None:
        pass

    def delta(self, kind: type[DeltaEvent], item_id: str, output_index: int, text: str) -> None:
        pass

    def text_run(self, item_id: str, output_index: int, texts: list[bytes]) -> None:
        pass

    def end(self) -> None:
        pass

    def take(self) -> bytes:
        return b""
