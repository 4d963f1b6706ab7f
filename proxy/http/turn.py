"""One Responses turn run in-process through the app's whole HTTP path: the one entry point
the WebSocket transport and /v1/responses/compact use to create a response.

`run_turn(origin, body, emit)` builds a `POST /v1/responses` request from the headers of
`origin` (the WebSocket handshake, the compact request) and `body`, and hands it to the app as
aiohttp would hand it a request off the wire: the same router, every middleware of the chain
(auth, limits, tools, balance, notices, custom ones) and the same handler. A turn is therefore
authenticated, limited, held and billed exactly as the HTTP request with these headers and this
body. Its answer is not written to a socket: the event stream's bytes are cut into events and
each one is awaited through `emit(event_type, data_json)`, so a slow consumer stalls the
handler's writes, which stall its upstream reads (the HTTP path's backpressure). Cancelling the
caller cancels the turn as a client disconnect cancels an HTTP handler.

The coupling with the rest of the product is this function's signature and the request path:
a change of the chain's internals does not reach the transports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.http_writer import HttpVersion11
from aiohttp.streams import StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy import state

Emit = Callable[[str, bytes], Awaitable[None]]

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


class _BodyOnly:
    """The flow-control side of a request body that is already whole in memory."""

    _reading_paused = False

    def pause_reading(self, *args: object, **kwargs: object) -> None:
        pass

    def resume_reading(self, *args: object, **kwargs: object) -> None:
        pass


class EventWriter(AbstractStreamWriter):
    """Where the handler's response goes: SSE bytes in, one `emit` per event out."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.pending = bytearray()
        self.started = False
        self.headers: dict[str, str] = {}
        self.buffer_size = 0
        self.output_size = 0
        self.length = None

    async def write(self, chunk) -> None:
        self.output_size += len(chunk)
        self.pending += chunk
        cut = self.pending.rfind(b"\n\n")
        if cut < 0:
            return
        block = bytes(self.pending[:cut])
        del self.pending[:cut + 2]
        for event in block.split(b"\n\n"):
            await self._event(event)

    async def _event(self, event: bytes) -> None:
        start = event.find(b"data: ")
        if start < 0:
            return
        data = event[start + 6:]
        if data == b"[DONE]":
            return
        name = b""
        if event.startswith(b"event: "):
            name = event[7:event.index(b"\n")]
        await self.emit(name.decode("ascii", "replace"), data)

    async def write_eof(self, chunk: bytes = b"") -> None:
        if chunk:
            await self.write(chunk)
        if self.pending.strip():
            await self.write(b"\n\n")

    async def drain(self) -> None:
        pass

    def enable_compression(self, encoding: str = "deflate", strategy=None) -> None:
        pass

    def enable_chunking(self) -> None:
        pass

    async def write_headers(self, status_line: str, headers) -> None:
        self.started = True
        self.headers = dict(headers)

    def send_headers(self) -> None:
        pass


def _request(origin: web.Request, body: bytes, writer: EventWriter) -> web.Request:
    headers = CIMultiDict((k, v) for k, v in origin.headers.items() if k.lower() not in _NOT_CARRIED)
    headers["Content-Type"] = "application/json"
    headers["Content-Length"] = str(len(body))
    headers["Accept"] = _ACCEPT
    raw = tuple((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())
    message = RawRequestMessage("POST", TURN_PATH, HttpVersion11, CIMultiDictProxy(headers), raw,
                                False, None, False, False, URL(TURN_PATH))
    loop = asyncio.get_running_loop()
    payload = StreamReader(_BodyOnly(), max(2**16, len(body)), loop=loop)  # type: ignore[arg-type]
    payload.feed_data(body)
    payload.feed_eof()
    task = asyncio.current_task()
    assert task is not None
    limit = int(origin.app[state.CONFIG].section("server")["max_body_bytes"]) + 1  # as build_app sets it
    return web.Request(message, payload, origin.protocol, writer, task, loop, client_max_size=limit,
                       remote=origin.remote, host=origin.host, scheme=origin.scheme)


async def run_turn(origin: web.Request, body: bytes, emit: Emit) -> TurnAnswer:
    """Run `body` (a Responses request body, JSON) as `POST /v1/responses` with `origin`'s
    headers through the app; the events go to `emit` while it runs."""
    writer = EventWriter(emit)
    request = _request(origin, body, writer)
    # Application._handle is what aiohttp's server calls for each request: routing, the
    # middleware chain, the handler (there is no public name for "serve this request").
    response = await origin.app._handle(request)
    if writer.started:
        if response.prepared:  # a handler that returned without finishing its body
            await response.write_eof()
        return TurnAnswer(status=response.status, streamed=True, headers=writer.headers)
    answer = response.body if isinstance(response, web.Response) else b""
    return TurnAnswer(status=response.status, streamed=False,
                      body=bytes(answer) if isinstance(answer, (bytes, bytearray)) else b"",
                      headers=dict(response.headers))
