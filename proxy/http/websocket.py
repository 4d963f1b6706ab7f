"""The Responses WebSocket transport: `GET /v1/responses` with an upgrade (Open Responses
2026-04-24, "WebSocket Transport").

The handshake is the unit WS_HANDSHAKE (proxy.units): the key is checked from its headers
(the same header as HTTP) before the socket opens, then the socket is admitted: at most
`max_sockets_per_key` open sockets per key and `max_sockets` in all, in this process (429
`too_many_connections` otherwise). Each `response.create` message is one turn, the unit WS_TURN:
`proxy.http.turn.run_turn` runs it through the whole HTTP path (the key checked again, so a
revoked key stops at its next turn; the limits before the message is parsed; its size, models,
policies, the same hold and debit), and the body phase turns the message into the body of a
`POST /v1/responses` with the connection's `Continuation` (proxy.protocol.continuation). A
`generate: false` message is the variant WS_WARMUP: the same phases but the balance, answered
without a model (proxy.http.warmup). Each event of a turn's stream is sent as one text message,
the same objects with the same sequence numbers.

One turn is in flight at a time; later messages wait in order, at most `max_queued_turns` of
them and `max_queued_bytes` (counted as received, after permessage-deflate inflated them; a
message is bounded by `max_message_bytes` while it is inflated). Past either bound the socket
gets an error event `websocket_queue_full` and is closed (1008): the reader never stops reading,
so a close frame is seen at once, and a close (or a peer that goes away) cancels the turn in
flight, as a client disconnect cancels an HTTP request, and drops the queued ones. Pings and
pongs from the peer are answered within `max_control_frames_per_s` (twice that as a burst);
a flood past it closes the socket (1008).

A turn's per-response headers have no place on a socket: the notices HTTP sends in the
notices header (`x-token-notice`) come as a `headers` object on the turn's first event
(`response.created`), or on its error event when it is refused, as OpenAI's WebSocket mode
carries a response's headers on its events. The spec lets an implementation extend its
schemas; the events keep their types, order and sequence numbers.

Ends of a connection: the client closes; `idle_timeout_s` without a message or a turn;
`max_connection_minutes` (an error event `websocket_connection_limit_reached`, then close);
a missed pong (`ping_interval_s`); a bound above.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from itertools import chain
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import ClientConnectionResetError, WSCloseCode, WSMsgType, web

from proxy import state
from proxy.errors import APIError
from proxy.http.turn import TurnAnswer, run_turn
from proxy.http.warmup import warmup_handler
from proxy.logs import log
from proxy.protocol.continuation import (
    Continuation,
    TurnRefused,
    check_client_event,
    client_param,
    error_event,
    with_previous,
)
from proxy.protocol.events import Event, ResponseEvent, TerminalEvent, WithHeaders
from proxy.units import WS_TURN, WS_WARMUP, Unit

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Websocket

_CLOSED = object()  # the queue's end: the peer closed, or the socket failed
_REFUSED_AGAIN = frozenset({402, 429})  # refusals the same socket would meet again at once
_CONTROL = (WSMsgType.PING, WSMsgType.PONG)


class SocketAdmission:
    """Open sockets, per key and in all, in this process: a socket is admitted at its handshake
    (after auth, before the upgrade) or refused with 429, and counted until it ends."""

    def __init__(self, settings: Websocket) -> None:
        self.settings = settings
        self.total = 0
        self.per_key: dict[str | None, int] = {}
        # key -> until when its sockets get no permessage-deflate: a key whose turns keep being
        # refused would otherwise make the proxy inflate every message it sends before saying no.
        self.refused: dict[str | None, float] = {}
        # key -> (until when, the status) its handshakes are refused: a socket of it was just
        # closed for refused turns, and a reconnect per few turns would cost a handshake each.
        self.closed_for: dict[str | None, tuple[float, int]] = {}

    @staticmethod
    def _bounded(table: dict[str | None, Any], now: float) -> None:
        if len(table) >= 10_000:  # the expired go first, else the oldest
            expired = [k for k, v in table.items() if (v[0] if isinstance(v, tuple) else v) <= now]
            for k in expired or list(table)[:1000]:
                del table[k]

    def note_refused(self, key_id: str | None, now: float) -> None:
        self._bounded(self.refused, now)
        self.refused[key_id] = now + self.settings.refused_for_s

    def note_closed(self, key_id: str | None, now: float, status: int) -> None:
        """A socket of this key closed for its refused turns: its next handshakes, for
        refuse_sockets_s, get that refusal as a plain HTTP answer (the same cost as a refused
        request), not an upgrade whose turns would only be refused again."""
        if key_id is None or self.settings.refuse_sockets_s <= 0:
            return
        self._bounded(self.closed_for, now)
        self.closed_for[key_id] = (now + self.settings.refuse_sockets_s, status)

    def _refuse_if_closed(self, key_id: str | None, now: float) -> None:
        closed = self.closed_for.get(key_id)
        if closed is None:
            return
        until, status = closed
        if until <= now:
            del self.closed_for[key_id]
            return
        wait = max(1, int(until - now + 0.999))
        what = "balance does not cover a turn" if status == 402 else "rate limit refused its turns"
        raise APIError(status, f"This API key's {what} and its last socket was closed for it; new sockets are "
                               f"refused for {wait} s. Retry after that.",
                       code="insufficient_quota" if status == 402 else "rate_limit_exceeded",
                       type="insufficient_quota" if status == 402 else None, headers={"Retry-After": str(wait)})

    def compress(self, key_id: str | None, now: float) -> bool:
        until = self.refused.get(key_id)
        if until is not None and until <= now:
            del self.refused[key_id]
            until = None
        return self.settings.permessage_deflate and until is None

    def admit(self, key_id: str | None, now: float) -> None:
        settings = self.settings
        if self.closed_for:
            self._refuse_if_closed(key_id, now)
        if settings.max_sockets is not None and self.total >= settings.max_sockets:
            raise APIError(429, "The proxy is at its limit of open WebSocket connections; retry shortly.",
                           code="too_many_connections", headers={"Retry-After": "1"})
        held = self.per_key.get(key_id, 0)
        if key_id is not None and settings.max_sockets_per_key is not None and held >= settings.max_sockets_per_key:
            raise APIError(429, f"This API key already has {held} WebSocket connections open; close one first.",
                           code="too_many_connections", headers={"Retry-After": "1"})
        self.total += 1
        self.per_key[key_id] = held + 1

    def release(self, key_id: str | None) -> None:
        self.total -= 1
        left = self.per_key[key_id] - 1
        if left:
            self.per_key[key_id] = left
        else:
            del self.per_key[key_id]


def _is_upgrade(request: web.Request) -> bool:
    return (request.headers.get("Upgrade", "").lower() == "websocket"
            and "upgrade" in request.headers.get("Connection", "").lower())


async def websocket_handler(request: web.Request) -> web.StreamResponse:
    settings = request.app[state.CONFIG].websocket
    if not settings.enabled or not _is_upgrade(request):
        raise APIError(405, f"Method not allowed on this endpoint ({request.method} {request.path}); "
                            "POST a request, or open a WebSocket.")
    admission = request.app[SOCKETS]
    key = state.context(request).key
    key_id = key.key_id if key is not None else None
    now = asyncio.get_running_loop().time()
    admission.admit(key_id, now)
    try:
        # autoping off: the reader answers pings itself, within the control-frame budget.
        compress = admission.compress(key_id, now)
        ws = web.WebSocketResponse(heartbeat=settings.ping_interval_s, max_msg_size=settings.max_message_bytes,
                                   autoping=False, compress=compress)
        await ws.prepare(request)
        try:
            await _Connection(request, ws, settings, admission, key_id).serve()
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
    finally:
        admission.release(key_id)


def _refused(exc: TurnRefused) -> APIError:
    return APIError(exc.status, exc.message, code=exc.code, param=exc.param)


class _Connection:
    """One socket: a reader task queues the client's messages (never blocking, so a close frame
    is read at once); the handler's task runs them one by one, each turn in a task of its own
    that a close or a vanished peer cancels. A message is neither parsed nor decompressed
    further here: each turn's phases (auth, limits, then the body) decide what it costs."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, settings: Websocket,
                 admission: SocketAdmission, key_id: str | None) -> None:
        self.request = request
        self.ws = ws
        self.settings = settings
        self.admission = admission
        self.key_id = key_id
        self.refused_in_a_row = 0  # turns refused for rate or balance since the last one served
        self.memory = Continuation()
        self.queue: deque[bytes] = deque()
        self.queued_bytes = 0
        self.arrived = asyncio.Event()
        self.gone = asyncio.Event()  # the peer closed or the socket failed: set by _set_gone
        self.in_flight: asyncio.Task | None = None  # the turn running, which _set_gone cancels
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + settings.max_connection_minutes * 60
        rate = settings.max_control_frames_per_s
        self.control_budget = (rate, max(rate, 1.0) * 2)  # refill per second, burst
        self.control_tokens = self.control_budget[1]
        self.control_at = self.loop.time()

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
            self.queue.clear()
            if not self.ws.closed:
                await self.ws.close()

    async def _read(self) -> None:
        ws = self.ws
        try:
            while True:
                msg = await ws.receive()
                kind = msg.type
                if kind is WSMsgType.TEXT:
                    data = msg.data.encode()
                elif kind is WSMsgType.BINARY:
                    data = msg.data
                elif kind in _CONTROL:
                    if not self._control_frame_allowed():
                        await self._close_for(WSCloseCode.POLICY_VIOLATION, "too many control frames")
                        break
                    if kind is WSMsgType.PING:
                        await ws.pong(msg.data)
                    continue
                else:  # CLOSE, CLOSING, CLOSED, ERROR: the socket's end
                    break
                if not self._enqueue(data):
                    await self._queue_full()
                    break
        finally:
            self._set_gone()
            self.arrived.set()

    def _control_frame_allowed(self) -> bool:
        """A token bucket over pings and pongs: a flood of them is answered by closing."""
        now = self.loop.time()
        rate, burst = self.control_budget
        self.control_tokens = min(burst, self.control_tokens + (now - self.control_at) * rate)
        self.control_at = now
        if self.control_tokens < 1:
            return False
        self.control_tokens -= 1
        return True

    def _enqueue(self, data: bytes) -> bool:
        """Queue a message behind the turn in flight; False past the socket's bounds (messages,
        and their bytes as received, inflated)."""
        if (len(self.queue) >= self.settings.max_queued_turns
                or self.queued_bytes + len(data) > self.settings.max_queued_bytes):
            return False
        self.queue.append(data)
        self.queued_bytes += len(data)
        self.arrived.set()
        return True

    async def _queue_full(self) -> None:
        settings = self.settings
        await self._send_json(error_event(429, {
            "type": "rate_limit_error", "code": "websocket_queue_full", "param": None,
            "message": f"More than {settings.max_queued_turns} messages or {settings.max_queued_bytes} bytes "
                       "wait behind the turn in flight; send the next response.create after the last one ended."}))
        await self._close_for(WSCloseCode.POLICY_VIOLATION, "queue full")

    async def _close_for(self, code: int, reason: str) -> None:
        self._set_gone()  # before the close handshake: the turn in flight is cancelled meanwhile
        try:
            await self.ws.close(code=code, message=reason.encode())
        except Exception:  # the transport may be gone already
            pass

    async def _next(self) -> Any:
        """The next message; _CLOSED when the peer is gone, idle too long or out of time."""
        while not self.queue:
            if self.gone.is_set():  # what the peer queued before it left has no one to answer
                return _CLOSED
            self.arrived.clear()
            wait = min(self.settings.idle_timeout_s, self.deadline - self.loop.time())
            try:
                async with asyncio.timeout(max(wait, 0)):
                    await self.arrived.wait()
            except TimeoutError:
                if self.loop.time() >= self.deadline:
                    await self._limit_reached()
                else:
                    await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"idle timeout")
                return _CLOSED
        if self.gone.is_set():
            return _CLOSED
        data = self.queue.popleft()
        self.queued_bytes -= len(data)
        return data

    async def _limit_reached(self) -> None:
        minutes = self.settings.max_connection_minutes
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
            self._set_gone()

    def _set_gone(self) -> None:
        """The peer is gone (or is being closed on): the turn in flight is cancelled."""
        self.gone.set()
        turn = self.in_flight
        if turn is not None and not turn.done():
            turn.cancel()

    async def _run(self, message: bytes) -> None:
        """One turn in a task of its own; a peer that closes or goes away meanwhile cancels it."""
        turn = self.in_flight = asyncio.create_task(self._turn(message))
        if self.gone.is_set():
            turn.cancel()
        try:
            # Waits for the turn's end, a cancelled one's too; a cancellation of this task
            # cancels the turn, waits for it, and goes on.
            results = await asyncio.gather(turn, return_exceptions=True)
        finally:
            self.in_flight = None
        error = results[0]
        if isinstance(error, BaseException) and not isinstance(error, (asyncio.CancelledError, ConnectionResetError)):
            log.error("websocket turn failed", request_id=state.context(self.request).request_id,
                      error=f"{type(error).__name__}: {error}")
            if not self.gone.is_set():
                await self._send_json(error_event(500, {"type": "server_error", "code": "internal_error",
                                                        "message": "The proxy failed to handle this turn."}))

    async def _turn(self, message: bytes) -> None:
        terminal: list[TerminalEvent] = []  # the turn's last event, as written
        carried: dict[str, str] = {}  # the turn's headers, for its first event
        names = self._carried_headers()
        decoded: dict[str, Any] = {}  # what the body phase made of the message, once it ran

        def decode(event: dict[str, Any]) -> tuple[dict[str, Any], Unit]:
            """Run by the turn's body phase, after auth and limits passed."""
            try:
                body, previous = self.memory.expand(check_client_event(event))
            except TurnRefused as exc:  # nothing ran: an unknown id had nothing to evict
                raise _refused(exc) from None
            # The remembered items come first in a continuation's input: an error's param is
            # told relative to the client's own items (continuation.client_param).
            decoded.update(body=body, previous=previous, remembered=len(self.memory.context) if previous else 0)
            if body.pop("generate", True) is False:
                return body, WS_WARMUP
            body["stream"] = True
            return body, WS_TURN

        def prepared(headers: Any) -> None:
            carried.update(_carried(headers, names))

        def on_event(event: Event) -> Event | WithHeaders:
            if isinstance(event, ResponseEvent):  # its response: the id this turn continued
                event = with_previous(event, decoded.get("previous"))
                if isinstance(event, TerminalEvent):
                    terminal.append(event)
            if carried:
                headed = WithHeaders(event, dict(carried))
                carried.clear()
                return headed
            return event

        async def send_lines(block: bytes) -> None:
            await send_messages(self.ws, block)

        try:
            answer = await run_turn(self.request, message, unit=WS_TURN, send_lines=send_lines, on_event=on_event,
                                    on_prepare=prepared, decode=decode, handlers={WS_WARMUP: warmup_handler},
                                    transport="websocket")
        except BaseException:
            self.memory.failed(decoded.get("previous"))
            raise
        if decoded:
            self._remember(answer, terminal, decoded["body"], decoded["previous"])
        if not answer.streamed:
            await self._send_json(_error_of(answer, names, decoded.get("remembered", 0)))
        await self._count_refusal(answer.status)

    async def _count_refusal(self, status: int) -> None:
        """A socket whose turns keep being refused for rate or balance is closed (1008): each
        message costs its inflating and decoding before the refusal, and no answer comes of it.
        Its key's next sockets are not compressed for a while (SocketAdmission.refused)."""
        if status not in _REFUSED_AGAIN:
            self.refused_in_a_row = 0
            return
        self.refused_in_a_row += 1
        self.admission.note_refused(self.key_id, self.loop.time())
        if self.refused_in_a_row >= self.settings.max_refused_turns:
            self.admission.note_closed(self.key_id, self.loop.time(), status)
            await self._close_for(WSCloseCode.POLICY_VIOLATION, f"{self.refused_in_a_row} turns refused in a row")

    def _carried_headers(self) -> tuple[str, ...]:
        """The answer headers a turn carries on its events: the notices header, when the
        notices policy is on (proxy.state.NOTICES_HEADER)."""
        notice = self.request.app.get(state.NOTICES_HEADER)
        return (notice,) if notice else ()

    def _remember(self, answer: TurnAnswer, terminal: list[TerminalEvent], body: dict[str, Any],
                  previous: str | None) -> None:
        response = terminal[-1].response if terminal else None
        if answer.streamed and response is not None and response.get("status") in ("completed", "incomplete"):
            self.memory.completed(body, response)
        else:
            self.memory.failed(previous)


# Whether a turn's events of one write go out together (send_messages); False: one send_frame
# per event, the general path tests/http/test_ws_frames.py compares it with.
BATCH_FRAMES = True
_HEAD2 = struct.Struct("!BBH").pack  # 126, then a 16-bit length
_HEAD3 = struct.Struct("!BBQ").pack  # 127, then a 64-bit length
_FIN_TEXT = 0x80 | WSMsgType.TEXT
_SHORT = 4096  # every delta event is shorter (~150 bytes): the table is ~150 kB


def _frame_head(n: int) -> bytes:
    """The header of an unmasked final text frame of n bytes."""
    return bytes((_FIN_TEXT, n)) if n < 126 else _HEAD2(_FIN_TEXT, 126, n) if n < 65536 else _HEAD3(_FIN_TEXT, 127, n)


_SHORT_HEAD = {n: _frame_head(n) for n in range(_SHORT)}.get


def _frame_heads(lengths: list[int]) -> list[bytes]:
    """The frame header of each length: the short ones looked up in C, the few long ones
    (a response event with a long answer in it) built one by one."""
    heads = list(map(_SHORT_HEAD, lengths))
    i = -1
    try:
        while True:
            i = heads.index(None, i + 1)
            heads[i] = _frame_head(lengths[i])
    except ValueError:  # no long one left
        return heads  # type: ignore[return-value]


async def send_messages(ws: web.WebSocketResponse, block: bytes) -> None:
    """The events of one write (JSON lines, proxy.protocol.encoder.JSONLinesEncoder), one text
    frame each. One event (a read of one delta: the usual stream) goes by aiohttp's public
    send_frame; several in one transport write when the frames are neither compressed nor
    masked (the headers and the join run in C, whatever the number of events), else one
    send_frame each. Measured (bench.instructions, see _plain_writer): a read of one event costs
    ~8k Ir less by send_frame than by the batch; a read of 100 costs ~690k Ir more by it."""
    messages = block.split(b"\n")
    if messages[-1] == b"":
        messages.pop()
    if len(messages) == 1:
        await ws.send_frame(messages[0], WSMsgType.TEXT)
        return
    if not messages:
        return
    writer = _plain_writer(ws) if BATCH_FRAMES else None
    if writer is None:
        for message in messages:
            await ws.send_frame(message, WSMsgType.TEXT)
        return
    heads = _frame_heads(list(map(len, messages)))
    await _write_frames(writer, b"".join(chain.from_iterable(zip(heads, messages))))


def _plain_writer(ws: web.WebSocketResponse) -> Any:
    """aiohttp's WebSocketWriter of `ws` when its frames can be built here (neither compressed
    nor masked: a server's without permessage-deflate), else None. aiohttp (3.14) has no public
    batch send: the private names read here and in _write_frames are listed in
    tests/test_architecture.py, each pinned on the installed aiohttp by
    tests/http/test_ws_frames.py (test_aiohttps_private_names_are_as_the_batch_writer_reads_them:
    an aiohttp that renames or reshapes one fails it), and the bytes they write pinned against
    send_frame's there too.

    Why not the public API: one `ws.send_frame` per event (BATCH_FRAMES = False) measured
    against this batch, `python -m bench.instructions --only proxy --ws-only --no-edge
    --no-deflate --parallel 1`, Ir per socket turn (the same tree but for the flag):
        coalesced turn (100 deltas in one upstream read)  batch 2,500,031  send_frame 3,195,405 (+27.8%)
        one delta per read                                 batch 8,911,569  send_frame 8,141,937 (-8.6%)
    (repeated: 3,186,396 and 8,068,994). So a write of one event takes send_frame
    (send_messages; with it the paced turn measured 7,998,268) and only a write of several
    takes the batch, whose public alternative costs +27.8%."""
    writer = ws._writer
    if writer is None or writer.compress or writer.use_mask or not hasattr(writer, "_output_size"):
        return None
    return writer


async def _write_frames(writer: Any, frames: bytes) -> None:
    """Whole frames in one transport write, with aiohttp's writer's checks and flow control:
    once its output passes its limit, wait for a paused transport to drain. The private names,
    each what WebSocketWriter.send_frame reads for the same step (the cost of calling that
    instead, per frame: _plain_writer): `_closing` (closed by ws.close), `_output_size` and
    `_limit` (its count of bytes since the last drain check), the protocol's `_paused` and
    `_drain_helper()` (the wait for a paused transport; aiohttp has no public awaitable)."""
    if writer._closing:
        raise ClientConnectionResetError("Cannot write to closing transport")
    transport = writer.transport
    if transport.is_closing():
        raise ClientConnectionResetError("Cannot write to closing transport")
    transport.write(frames)
    writer._output_size += len(frames)
    if writer._output_size > writer._limit:
        writer._output_size = 0
        protocol = writer.protocol
        if protocol._paused:
            await protocol._drain_helper()


def _carried(headers: Any, names: tuple[str, ...]) -> dict[str, str]:
    """The `names` among an answer's headers, as the event's `headers` object (lower case)."""
    found = {}
    for name in names:
        value = headers.get(name)
        if value:
            found[name.lower()] = value
    return found


def _error_of(answer: TurnAnswer, names: tuple[str, ...] = (), remembered: int = 0) -> dict[str, Any]:
    """An HTTP refusal (the OpenAI error envelope) as the spec's WebSocket error event: the same
    error object (its code, type and message), its param about the client's own items (a
    continuation's input starts with the `remembered` ones), and the answer's carried headers
    (its notices) as it had them."""
    try:
        error = orjson.loads(answer.body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if not isinstance(error, dict):
        error = {"type": "server_error", "message": "The request failed.", "code": None, "param": None}
    elif remembered and error.get("param") is not None:
        error = {**error, "param": client_param(error["param"], remembered)}
    retry_after = answer.headers.get("Retry-After")
    if retry_after is not None:
        error = {**error, "retry_after": retry_after}
    event = error_event(answer.status, error)
    headers = _carried(answer.headers, names)
    if headers:
        event["headers"] = headers
    return event


SOCKETS = web.AppKey("socket_admission", SocketAdmission)  # proxy.http.websocket: open sockets per key
