"""The Responses WebSocket transport: `GET /v1/responses` with an upgrade (Open Responses
2026-04-24, "WebSocket Transport").

The handshake passes the middleware chain as any request to /v1/responses does, so the key is
checked there (the same header as HTTP) before the socket opens. Each `response.create`
message is one turn: the connection's `Continuation` (proxy.protocol.continuation) turns it
into the body of a `POST /v1/responses`, `proxy.http.turn.run_turn` runs that through the whole
HTTP path (every policy, the same hold and debit), and each event of its stream is sent as one
text message, the same objects with the same sequence numbers. One turn is in flight at a
time; later messages wait in order (`max_queued_turns`, then the socket is not read). A peer
that goes away cancels the turn in flight as a client disconnect cancels an HTTP request.

A turn's per-response headers have no place on a socket: the notices HTTP sends in the
notices header (`x-token-notice`) come as a `headers` object on the turn's first event
(`response.created`), or on its error event when it is refused, as OpenAI's WebSocket mode
carries a response's headers on its events. The spec lets an implementation extend its
schemas; the events keep their types, order and sequence numbers.

Ends of a connection: the client closes; `idle_timeout_s` without a message or a turn;
`max_connection_minutes` (an error event `websocket_connection_limit_reached`, then close);
a missed pong (`ping_interval_s`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from proxy import state
from proxy.http.errors import APIError
from proxy.http.turn import TurnAnswer, TurnStream, run_turn
from proxy.http.warmup import warmup_stream
from proxy.protocol.continuation import (
    RESPONSE_EVENTS,
    TERMINAL_EVENTS,
    Continuation,
    TurnRefused,
    error_event,
    parse_client_event,
    with_previous,
)
from proxy.runtime.logs import log

_CLOSED = object()  # the queue's end: the peer closed, or the socket failed


@dataclass(frozen=True)
class WebSocketSettings:
    enabled: bool = True
    max_connection_s: float = 3600.0
    idle_timeout_s: float = 600.0
    ping_interval_s: float | None = 30.0
    max_queued_turns: int = 4
    max_message_bytes: int = 4 * 1024 * 1024

    @classmethod
    def from_config(cls, section: dict[str, Any], max_body_bytes: int) -> "WebSocketSettings":
        ping = section.get("ping_interval_s", 30)
        return cls(enabled=bool(section.get("enabled", True)),
                   max_connection_s=float(section.get("max_connection_minutes", 60)) * 60,
                   idle_timeout_s=float(section.get("idle_timeout_s", 600)),
                   ping_interval_s=float(ping) if ping is not None else None,
                   max_queued_turns=int(section.get("max_queued_turns", 4)),
                   max_message_bytes=int(max_body_bytes))


def _is_upgrade(request: web.Request) -> bool:
    return (request.headers.get("Upgrade", "").lower() == "websocket"
            and "upgrade" in request.headers.get("Connection", "").lower())


async def websocket_handler(request: web.Request) -> web.StreamResponse:
    settings = request.app.get(state.WEBSOCKET_SETTINGS) or WebSocketSettings()
    if not settings.enabled or not _is_upgrade(request):
        raise APIError(405, f"Method not allowed on this endpoint ({request.method} {request.path}); "
                            "POST a request, or open a WebSocket.", code=None)
    ws = web.WebSocketResponse(heartbeat=settings.ping_interval_s, max_msg_size=settings.max_message_bytes,
                               autoping=True)
    await ws.prepare(request)
    try:
        await _Connection(request, ws, settings).serve()
    except asyncio.CancelledError:
        # aiohttp cancels the handler of a connection that is lost, which is how most sockets
        # end (often before the close frame is read): that is the socket's end (logged 101),
        # not a client that gave up on an answer. Any other cancellation goes on.
        task = asyncio.current_task()
        transport = request.transport
        if task is None or not (ws.closed or transport is None or transport.is_closing()):
            raise
        task.uncancel()
    return ws


class _Connection:
    """One socket: a reader task queues the client's messages; the handler's task runs them
    one by one, each turn in a task of its own that a vanished peer cancels."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, settings: WebSocketSettings) -> None:
        self.request = request
        self.ws = ws
        self.settings = settings
        self.memory = Continuation()
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=settings.max_queued_turns)
        self.gone = asyncio.Event()  # the peer closed or the socket failed
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + settings.max_connection_s

    async def serve(self) -> None:
        reader = asyncio.create_task(self._read())
        try:
            while True:
                message = await self._next()
                if message is _CLOSED:
                    break
                if self.loop.time() >= self.deadline:
                    await self._limit_reached()
                    break
                await self._run(message)
                if self.gone.is_set():
                    break
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            if not self.ws.closed:
                await self.ws.close()

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await self.queue.put(msg.data)
                elif msg.type == WSMsgType.ERROR:
                    break
        finally:
            self.gone.set()
            try:
                self.queue.put_nowait(_CLOSED)
            except asyncio.QueueFull:
                pass  # serve() sees `gone` after the turn in flight

    async def _next(self) -> Any:
        """The next message; _CLOSED when the peer is gone, idle too long or out of time."""
        if self.gone.is_set():  # what the peer queued before it left has no one to answer
            return _CLOSED
        wait = min(self.settings.idle_timeout_s, self.deadline - self.loop.time())
        try:
            async with asyncio.timeout(max(wait, 0)):
                return await self.queue.get()
        except TimeoutError:
            if self.loop.time() >= self.deadline:
                await self._limit_reached()
            else:
                await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"idle timeout")
            return _CLOSED

    async def _limit_reached(self) -> None:
        minutes = self.settings.max_connection_s / 60
        await self._send_json(error_event(400, {
            "type": "invalid_request_error", "code": "websocket_connection_limit_reached", "param": None,
            "message": f"WebSocket connections are limited to {minutes:g} minutes; open a new connection."}))
        await self.ws.close(code=WSCloseCode.OK, message=b"connection limit reached")

    async def _send_json(self, payload: dict[str, Any]) -> None:
        if self.ws.closed:
            return
        try:
            await self.ws.send_frame(orjson.dumps(payload), WSMsgType.TEXT)
        except ConnectionResetError:  # the peer left: nobody to tell
            self.gone.set()

    async def _run(self, message: Any) -> None:
        """One turn in a task of its own; a peer that goes away meanwhile cancels it."""
        turn = asyncio.create_task(self._turn(message))
        gone = asyncio.create_task(self.gone.wait())
        try:
            await asyncio.wait((turn, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not turn.done():
                turn.cancel()
            results = await asyncio.gather(turn, return_exceptions=True)
        error = results[0]
        if isinstance(error, BaseException) and not isinstance(error, (asyncio.CancelledError, ConnectionResetError)):
            log.error("websocket turn failed", request_id=state.context(self.request).request_id,
                      error=f"{type(error).__name__}: {error}")
            if not self.gone.is_set():
                await self._send_json(error_event(500, {"type": "server_error", "code": "internal_error",
                                                        "message": "The proxy failed to handle this turn."}))

    async def _turn(self, message: Any) -> None:
        try:
            event = parse_client_event(message)
            body, previous = self.memory.expand(event)
        except TurnRefused as exc:  # nothing ran: an unknown id had nothing to evict
            await self._send_json(exc.event())
            return
        terminal: dict[str, Any] = {}
        carried: dict[str, str] = {}  # the turn's headers, for its first event
        send = self.ws.send_frame
        names = self._carried_headers()

        def prepared(headers: Any) -> None:
            carried.update(_carried(headers, names))

        async def emit(name: str, data: bytes) -> None:
            if name in RESPONSE_EVENTS:
                data = with_previous(data, previous)
                if name in TERMINAL_EVENTS:
                    terminal.update(orjson.loads(data))
            if carried:
                data = _with_headers(data, carried)
                carried.clear()
            await send(data, WSMsgType.TEXT)

        try:
            if body.pop("generate", True) is False:
                answer = await self._warmup(body, emit)
            else:
                body["stream"] = True
                answer = await run_turn(self.request, orjson.dumps(body), emit, prepared)
        except BaseException:
            self.memory.failed(previous)
            raise
        self._remember(answer, terminal, body, previous)
        if not answer.streamed:
            await self._send_json(_error_of(answer, names))

    def _carried_headers(self) -> tuple[str, ...]:
        """The answer headers a turn carries on its events: the notices header, when the
        notices policy is on (proxy.state.NOTICES_HEADER)."""
        notice = self.request.app.get(state.NOTICES_HEADER)
        return (notice,) if notice else ()

    async def _warmup(self, body: dict[str, Any], emit: Any) -> TurnAnswer:
        """`generate: false`: a response with no output, no model call (proxy.http.warmup)."""
        try:
            stream = warmup_stream(self.request, body)
        except APIError as exc:
            return TurnAnswer(status=exc.status, streamed=False, body=orjson.dumps(exc.envelope()))
        await TurnStream(emit).write_eof(stream)
        return TurnAnswer(status=200, streamed=True)

    def _remember(self, answer: TurnAnswer, terminal: dict[str, Any], body: dict[str, Any],
                  previous: str | None) -> None:
        response = terminal.get("response")
        if answer.streamed and isinstance(response, dict) and response.get("status") in ("completed", "incomplete"):
            self.memory.completed(body, response)
        else:
            self.memory.failed(previous)


def _carried(headers: Any, names: tuple[str, ...]) -> dict[str, str]:
    """The `names` among an answer's headers, as the event's `headers` object (lower case)."""
    found = {}
    for name in names:
        value = headers.get(name)
        if value:
            found[name.lower()] = value
    return found


def _with_headers(data: bytes, headers: dict[str, str]) -> bytes:
    """An event's JSON (an object, as the encoder writes it) with a `headers` member added."""
    data = data.rstrip()
    return data[:-1] + b',"headers":' + orjson.dumps(headers) + b"}"


def _error_of(answer: TurnAnswer, names: tuple[str, ...] = ()) -> dict[str, Any]:
    """An HTTP refusal (the OpenAI error envelope) as the spec's WebSocket error event, with
    the answer's carried headers (its notices) as it had them."""
    try:
        error = orjson.loads(answer.body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if not isinstance(error, dict):
        error = {"type": "server_error", "message": "The request failed.", "code": None, "param": None}
    retry_after = answer.headers.get("Retry-After")
    if retry_after is not None:
        error = {**error, "retry_after": retry_after}
    event = error_event(answer.status, error)
    headers = _carried(answer.headers, names)
    if headers:
        event["headers"] = headers
    return event
