"""One Responses turn run in-process through the app's whole HTTP path: the one entry point
the WebSocket transport and /v1/responses/compact use to create a response.

`run_turn(origin, body, unit=...)` makes the turn's request with aiohttp's public `Request.clone()`
(`POST /v1/responses` with `origin`'s headers: the WebSocket handshake, the compact request),
resolves it with the app's router and runs it through the app's one middleware, the envelope
(`state.ENVELOPE`: request id, context, every phase, error envelope, access line, metrics), to
the route's handler, as a request off the wire. A turn is therefore authenticated, limited, held and billed exactly
as the HTTP request with these headers and this body.

What differs is only where the bytes are and where the answer goes, both said by the request's
`TURN` (a `Turn`): the prepare phase takes the turn's body from it instead of reading the
HTTP body (proxy.http.request), and the handler writes its event stream to `Turn.stream()`, a
`TurnStream`, encoded by `Turn.encoder()` (proxy.http.event_stream): one JSON object per event
and per line, never SSE. Each write's lines are awaited through `send_lines(block)` as they
are (a socket sends each line as a message), so a slow consumer stalls the handler's writes,
which stall its upstream reads (the HTTP path's backpressure); `on_event` sees each non-delta
event as the encoder writes it (the turn's terminal response is read there, not parsed back).
Cancelling the caller cancels the turn as a client disconnect cancels an HTTP handler.

The clone shares the origin's connection, so any other response prepared for a turn (a custom
middleware's own stream) would write HTTP onto it: `refuse_other_answers` (an on_response_prepare
hook of the app) fails such a turn before a byte is written.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from proxy import state
from proxy.protocol.encoder import JSONLinesEncoder, OnEvent
from proxy.units import RESPONSES, Unit

# The events of one write at once: JSON lines (proxy.protocol.encoder.JSONLinesEncoder), whole
# events only, each ending with a line break.
SendLines = Callable[[bytes], Awaitable[None]]
# OnEvent (proxy.protocol.encoder): a non-delta event (proxy.protocol.events) as the encoder is
# about to write it -> the event to write (the same, a copy, or it with the transport's headers).

# Told the answer's headers once the app's response hooks set them, before the first event.
OnPrepare = Callable[[CIMultiDict[str]], None]

TURN_PATH = "/v1/responses"
# Headers of the origin that describe its own framing or connection, not the turn.
_NOT_CARRIED = frozenset({
    "connection", "upgrade", "content-length", "content-type", "content-encoding", "transfer-encoding",
    "accept", "accept-encoding", "expect", "te", "trailer", "keep-alive", "sec-websocket-key",
    "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol", "sec-websocket-accept",
})
# JSON first: a refusal then comes back as the error envelope (never the event-stream-only
# `response.failed` form), which the transports turn into their own error messages.
_ACCEPT = "application/json, text/event-stream"


@dataclass
class TurnAnswer:
    status: int                       # the HTTP status the request would have had
    streamed: bool                    # an event stream was produced (status 200)
    body: bytes = b""                 # the JSON answer (an error envelope) when not streamed
    headers: dict[str, str] = field(default_factory=dict)  # the answer's headers (notices among them)


class TurnStream:
    """Where a turn's event stream goes: the handler prepares, writes and ends it as it would
    its web.StreamResponse (the calls it makes are these); the encoder's JSON lines in, one
    `send_lines` per write out (none without `send_lines`: a turn that reads only `on_event`)."""

    def __init__(self, send_lines: SendLines | None, headers: dict[str, str] | None = None,
                 on_prepare: OnPrepare | None = None) -> None:
        self.status = 200
        self.headers: CIMultiDict[str] = CIMultiDict(headers or {})
        self.prepared = False
        # The flag proxy.app._after_start reads on an aiohttp response: whole, it stands.
        self._eof_sent = False
        self._state: dict[Any, Any] = {}
        self._send_lines = send_lines
        self._on_prepare = on_prepare

    def get(self, key: Any, default: Any = None) -> Any:  # a response is a mapping (ERROR_CODE)
        return self._state.get(key, default)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._state[key] = value

    async def prepare(self, request: web.Request) -> None:
        if not self.prepared:
            self.prepared = True
            # The app's response hooks see it as any answer: x-request-id, notices, ctx.started.
            await request.app.on_response_prepare.send(request, self)  # type: ignore[arg-type]  # duck-typed
            if self._on_prepare is not None:  # the transport's say in them (a socket's first event)
                self._on_prepare(self.headers)

    async def write(self, data: bytes) -> None:
        if data and self._send_lines is not None:
            await self._send_lines(data)

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof_sent:
            return
        if data:
            await self.write(data)
        self._eof_sent = True


# A transport's message (parsed JSON) -> the Responses request body it stands for, and its unit
# (the turn's own, or one of its variants); raises APIError for a message it refuses.
Decode = Callable[[dict[str, Any]], tuple[dict[str, Any], Unit]]


@dataclass
class Turn:
    """A request's `TURN`: the turn's body, its unit of work, and where its event stream goes."""

    body: bytes
    unit: Unit = RESPONSES
    decode: Decode | None = None  # run by the body phase, after auth and limits
    handlers: dict[Unit, Any] = field(default_factory=dict)  # a variant's handler (a warm-up answers itself)
    answer: TurnStream | None = None
    on_prepare: OnPrepare | None = None
    refusal: web.StreamResponse | None = None  # the JSON answer run_turn reads (never written)
    transport: str = "http"  # what carried the turn's message (the access line's `transport`)
    send_lines: SendLines | None = None  # the events of each write (TurnStream)
    on_event: OnEvent | None = None  # each non-delta event, as encoded

    def stream(self, headers: dict[str, str]) -> TurnStream:
        self.answer = TurnStream(self.send_lines, headers, self.on_prepare)
        return self.answer

    def encoder(self) -> JSONLinesEncoder:
        return JSONLinesEncoder(self.on_event)


async def refuse_other_answers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: a turn's answer is its TurnStream or an unprepared web.Response
    (read by run_turn); a stream of its own would be written onto the origin's connection."""
    turn = request.get(TURN)
    if turn is not None and response is not turn.answer and response is not turn.refusal:
        raise RuntimeError("a turn's event stream must be Turn.stream(); another response was prepared")


def _headers(origin: web.Request, body: bytes) -> CIMultiDict[str]:
    headers = CIMultiDict((k, v) for k, v in origin.headers.items() if k.lower() not in _NOT_CARRIED)
    headers["Content-Type"] = "application/json"
    headers["Content-Length"] = str(len(body))
    headers["Accept"] = _ACCEPT
    return headers


async def run_turn(origin: web.Request, body: bytes, *, unit: Unit, send_lines: SendLines | None = None,
                   on_event: OnEvent | None = None, on_prepare: OnPrepare | None = None,
                   decode: Decode | None = None, handlers: dict[Unit, Any] | None = None,
                   transport: str = "http") -> TurnAnswer:
    """Run `body` (JSON: a Responses request body, or a message `decode` turns into one) as
    `POST /v1/responses` with `origin`'s headers through the app, as the unit of work `unit`
    (its phases: proxy.units); the events go to `send_lines` (JSON lines, a block per
    write) and `on_event` (each non-delta event) while it runs. `on_prepare` is told the event
    stream's headers (notices among them) before its first event is encoded; `transport` names
    what carried the message ("websocket"; "http" for a turn of an HTTP request)."""
    request = origin.clone(method="POST", rel_url=TURN_PATH, headers=_headers(origin, body))
    turn = request[TURN] = Turn(body, unit, decode, handlers or {}, on_prepare=on_prepare,
                                      transport=transport, send_lines=send_lines, on_event=on_event)
    app = request.app
    # The app's one middleware, the envelope (the phases, the error envelope, the access line),
    # around the route's handler: as aiohttp runs a request off the wire.
    response = await app[state.ENVELOPE](request, (await app.router.resolve(request)).handler)
    stream = turn.answer
    if stream is not None and stream.prepared:
        await stream.write_eof()  # a handler that returned without finishing its body
        return TurnAnswer(status=stream.status, streamed=True, headers=dict(stream.headers))
    if not response.prepared:
        # The hooks an HTTP refusal meets when aiohttp prepares it (its notices, x-request-id),
        # on the answer read here instead of written.
        turn.refusal = response
        await app.on_response_prepare.send(request, response)
    answer = response.body if isinstance(response, web.Response) else b""
    return TurnAnswer(status=response.status, streamed=False,
                      body=bytes(answer) if isinstance(answer, (bytes, bytearray)) else b"",
                      headers=dict(response.headers))


TURN = web.RequestKey("turn", Turn)
