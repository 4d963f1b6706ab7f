"""The edge of the proxy's own connections, below the app: errors raised by aiohttp's HTTP
parser (a header line past `max_field_size`, a malformed request line) answered in the OpenAI
envelope too, the bounds on a request's head (its request line and headers: total bytes and
the time to arrive), and HTTP/1.0 with Transfer-Encoding closed after its answer.

aiohttp builds parser-error answers in `RequestHandler.handle_error` as text/plain and quotes
the offending bytes; `EnvelopeRequestHandler` answers JSON, never echoes the client's bytes, and
says 431 for oversized headers. `ProxyRunner` (a web.AppRunner) gives the proxy's own
connections that handler, and only them: any other aiohttp server in the process (the embedded
simulator, a test's upstream) keeps aiohttp's answers.

No public hook exists for this: parser errors never reach the app, its middlewares or its
on_response_prepare signal, and web.Server, web.AppRunner and web.run_app take no
request-handler class or protocol factory. So `ProxyRunner` implements BaseRunner's
`_make_server` (the method aiohttp's own runners implement) by letting AppRunner make the
app's web.Server as usual and making its connections `EnvelopeRequestHandler`s: the subclass
adds no state (`__slots__ = ()`) and only replaces the public `handle_error`,
`connection_made`, `connection_lost` and `finish_response`. Pinned by
tests/integration/test_hostile.py::test_a_malformed_request_line_is_a_400_envelope_that_echoes_nothing,
::test_limits_answer_clear_4xx (431) and
::test_only_the_proxys_own_connections_answer_parser_errors_in_the_envelope.

The head bounds (server.max_header_bytes, server.header_read_timeout_s; `HeadLimits`, on the
app as HEAD_LIMITS): aiohttp bounds one header line (max_field_size) and the number of
lines (max_headers), so a head may hold max_headers x max_field_size bytes (1 MiB by default)
and trickle in for as long as keepalive_timeout. `HeadBound` wraps the connection's parser
(the one private name written: BaseProtocol's `_parser`, in `bound_heads`): every byte the
parser is fed passes its `feed_data`, which counts the bytes of a head still incomplete and
raises `HeadTooLarge` past the budget or `HeadTimeout` when the head's timer fired. aiohttp
answers a parser exception as it answers a malformed request (in order, behind any request
in flight, then closes), and `handle_error` here makes them a 431 and a 408 envelope. The
count and the timer stop when the parser emits the request (its body, a WebSocket after an
upgrade, are never counted or timed) and start again for the next request on the connection.
Pinned by tests/integration/test_edge_bounds.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import HttpVersion11, web, web_protocol
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD

from proxy.errors import APIError
from proxy.http.errors import error_response


@dataclass(frozen=True, slots=True)
class HeadLimits:
    """server.max_header_bytes and server.header_read_timeout_s."""

    max_bytes: int
    timeout_s: float


class HeadTooLarge(BadHttpMessage):
    """The request line and headers of one request past server.max_header_bytes."""

    code = 431


class HeadTimeout(BadHttpMessage):
    """The request line and headers of one request not complete within server.header_read_timeout_s."""

    code = 408


_HEAD, _BODY, _OFF, _REFUSED = range(4)  # what the parser reads next
_NOTHING: tuple[tuple[()], bool, bytes] = ((), False, b"")  # feed_data's result: no message, no upgrade, no tail


def _head_size(msg: Any) -> int:
    """The bytes of a parsed head, less any optional whitespace around header values."""
    size = len(msg.method) + len(msg.path) + 13  # "GET /x HTTP/1.1\r\n", the blank line
    for name, value in msg.raw_headers:
        size += len(name) + len(value) + 3  # ":" and CRLF
    return size


class HeadBound:
    """A connection's parser, whose heads are bounded in bytes and time (module docstring).

    A head is counted from the first read after the previous request was whole (its body
    complete) or from the connection's start, until the parser emits the request; its timer
    runs from the connection's start for the first request, from the head's first byte for
    the next ones (an idle keep-alive connection is keepalive_timeout's business). Bytes of
    a next head that came in the same read as the end of the previous request are not
    counted (a pipelining client; one read at most); when the request had no body and the
    read did not end with it, the next head's timer starts there."""

    __slots__ = ("_parser", "_protocol", "_limits", "_loop", "_state", "_bytes", "_seen", "_body", "_timer",
                 "_timed_out")

    def __init__(self, parser: Any, protocol: EnvelopeRequestHandler, limits: HeadLimits) -> None:
        self._parser = parser
        self._protocol = protocol
        self._limits = limits
        self._loop = asyncio.get_running_loop()
        self._state = _HEAD
        self._bytes = 0  # of the head being read
        self._seen = False  # a byte of the head being read has arrived
        self._body: Any = None  # the StreamReader of the request whose body is arriving
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False

    def __getattr__(self, name: str) -> Any:  # pause_reading, feed_eof, ...: the parser's own
        return getattr(self._parser, name)

    def start_timer(self) -> None:
        if self._timer is None and self._state == _HEAD:
            self._timer = self._loop.call_later(self._limits.timeout_s, self._expired)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._state != _HEAD:
            return
        if not self._seen:  # a connection that never sent a byte: nothing to answer
            self._protocol.force_close()
            return
        self._timed_out = True
        self._protocol.data_received(b"")  # feed_data raises HeadTimeout: aiohttp queues the answer

    def _next_head(self) -> None:
        self._state, self._bytes, self._seen, self._body = _HEAD, 0, False, None

    def feed_data(self, data: bytes) -> Any:
        st = self._state
        if st == _REFUSED:
            return _NOTHING  # the refusal is queued; the connection closes after it
        if st == _BODY and self._body.is_eof():
            self._next_head()
            st = _HEAD
        if st == _HEAD:
            if self._timed_out:
                self._refuse()
                raise HeadTimeout("The request headers did not arrive in time.")
            if data:
                if not self._seen:
                    self._seen = True
                    self.start_timer()
                self._bytes += len(data)
        messages, upgraded, _tail = result = self._parser.feed_data(data)
        if upgraded:
            self._state = _OFF  # a WebSocket (or refused upgrade: set_upgraded) from here on
            self._body = None
            self.stop_timer()
        elif messages:
            self.stop_timer()
            if self._bytes > self._limits.max_bytes and st == _HEAD and any(
                    _head_size(msg) > self._limits.max_bytes for msg, _ in messages):
                # A head past the budget that arrived whole in one read (the read's count
                # includes any body after it, so the head is measured from what was parsed).
                self._refuse()
                raise HeadTooLarge("The request headers are too large.")
            payload = messages[-1][1]
            if not payload.is_eof():
                self._state, self._body = _BODY, payload
            else:
                self._next_head()
                if payload is EMPTY_PAYLOAD and data and not data.endswith((b"\n\r\n", b"\n\n")):
                    # no body, and the read went on past this head's end: the next head began in it
                    self._seen = True
                    self.start_timer()
        elif st == _HEAD and self._bytes > self._limits.max_bytes:
            self._refuse()
            raise HeadTooLarge("The request headers are too large.")
        elif st == _BODY and self._body.is_eof():
            self._next_head()
        return result

    def set_upgraded(self, val: bool) -> None:
        """aiohttp's answer to an upgrade request that was not taken: HTTP again, a new head."""
        self._parser.set_upgraded(val)
        if not val and self._state == _OFF:
            self._next_head()

    def message_consumed(self) -> None:
        self._parser.message_consumed()

    def _refuse(self) -> None:
        self._state = _REFUSED
        self.stop_timer()


class EnvelopeRequestHandler(web_protocol.RequestHandler):
    __slots__ = ()  # the layout of aiohttp's RequestHandler: see _EnvelopeServer

    def bound_heads(self, limits: HeadLimits) -> None:
        # BaseProtocol's parser, wrapped: every byte it is fed passes HeadBound.feed_data
        # (no public hook sees a head before the parser emits it; module docstring).
        self._parser = HeadBound(self._parser, self, limits)  # type: ignore[assignment]  # the parser, wrapped

    def _head_bound(self) -> HeadBound | None:
        parser = self._parser
        return parser if isinstance(parser, HeadBound) else None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        bound = self._head_bound()
        if bound is not None:
            bound.start_timer()  # the first head's time counts from the connection's start

    def connection_lost(self, exc: BaseException | None) -> None:
        bound = self._head_bound()
        if bound is not None:
            bound.stop_timer()
        super().connection_lost(exc)

    async def finish_response(self, request, resp, start_time):
        # RFC 9112 6.1: a request in HTTP/1.0 with Transfer-Encoding has faulty framing;
        # the server closes the connection after answering it. Every answer passes here
        # (refusals before the handler and streamed answers too), before its keep-alive
        # decides whether the connection takes another request.
        if (isinstance(resp, web.StreamResponse) and request.version < HttpVersion11
                and "Transfer-Encoding" in request.headers):
            resp.force_close()
        return await super().finish_response(request, resp, start_time)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None):
        if request.writer.output_size > 0:  # an answer is already on the wire
            return super().handle_error(request, status, exc, message)
        if isinstance(exc, (LineTooLong, HeadTooLarge)):
            error = APIError(431, "A request header, the request line or the headers together are too large.",
                             code="request_header_too_large")
        elif isinstance(exc, HeadTimeout):
            error = APIError(408, "The request headers did not arrive in time.", code="request_header_timeout")
        elif isinstance(exc, BadHttpMessage) or 400 <= status < 500:
            error = APIError(status if 400 <= status < 500 else 400, "The HTTP request is malformed.",
                             code="bad_http_request")
        else:
            return super().handle_error(request, status, exc, message)
        self.log_debug("refused a malformed request from %s: %r", request.remote, exc)
        response = error_response(error)
        response.force_close()  # the parser state is unknown after a broken message
        return response


class _EnvelopeServer(web.Server):
    """The app's web.Server whose connections are EnvelopeRequestHandlers. web.Server builds
    each connection's handler itself (its __call__ is the protocol factory the sites listen
    with); the handler it builds, with every handler_args, becomes the subclass, which has the
    same slots and so the same layout. `head_limits` (set by ProxyRunner) bounds its heads."""

    head_limits: HeadLimits | None = None

    def __call__(self) -> web_protocol.RequestHandler:
        handler = super().__call__()
        handler.__class__ = EnvelopeRequestHandler
        if self.head_limits is not None:
            handler.bound_heads(self.head_limits)  # type: ignore[attr-defined]  # its class, swapped above
        return handler


class ProxyRunner(web.AppRunner):
    """web.AppRunner for the proxy's app: the same lifecycle (startup, cleanup contexts,
    shutdown), parser errors answered in the envelope and heads bounded (module docstring:
    why this way)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _EnvelopeServer  # only its protocol factory differs
        server.head_limits = self.app.get(HEAD_LIMITS)  # type: ignore[attr-defined]  # as above
        return server


__all__ = ["EnvelopeRequestHandler", "HeadBound", "HeadLimits", "HeadTimeout", "HeadTooLarge", "ProxyRunner"]


HEAD_LIMITS = web.AppKey("head_limits", HeadLimits)  # proxy.http.parse_errors: bounds on a request's head
