"""The chat-completions leg to the model servers: a lean pooled HTTP/1.1 client.

Why not aiohttp's ClientSession here (it still serves health checks, discovery, /tokenize
and every other upstream call): one ClientSession POST and read costs about ten times the
CPU of a bare asyncio protocol (bench/results.md, "Design measurements"), and the proxy
pays it on every request, before the first token. The generality behind that cost (cookies,
redirects, proxies, tracing, content decoding) is unused on this leg: a known model server,
one JSON POST, an answer framed by Content-Length, chunked encoding or the connection's end.
httptools (the C parser uvicorn uses) does the framing; this module only pools connections.

Semantics the forwarder relies on:
  * keep-alive: a connection goes back to the pool only after a whole answer; an answer left
    unfinished (client gone, failure, timeout) closes its connection, which is how vLLM and
    SGLang learn to abort the generation;
  * a pooled connection the server closed while idle (uvicorn closes after 5 s) is retried
    once on a fresh one, and only when not one byte of an answer came back;
  * one request, one answer: bytes that arrive on an idle pooled connection, or behind the
    end of the answer that was asked for, close the connection (never parsed as the next
    request's answer); 1xx interim answers (100 Continue, 103 Early Hints) are skipped;
  * the request says `Accept-Encoding: identity`; an answer's Content-Encoding (or a
    transfer coding other than chunked) is reported in `content_encoding`, for the caller
    to refuse: the body is never decoded here;
  * backpressure: past HIGH_WATER unread body bytes the socket stops being read until the
    consumer catches up, so a slow client slows the model server's socket, not our memory;
  * errors are UpstreamError subclasses: ConnectFailed (nothing was sent: safe to fail over),
    Disconnected and BadResponse (maybe sent: the forwarder decides).
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import deque
from typing import Any

import httptools
from yarl import URL

_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # CR, LF and other controls (not tab) end a header line

HIGH_WATER = 256 * 1024  # unread body bytes before the socket is paused
KEEPALIVE_S = 30.0  # an idle pooled connection older than this is closed, not reused


class UpstreamError(Exception):
    """The model server could not be talked to."""


class ConnectFailed(UpstreamError):
    """No connection: nothing was sent."""


class ConnectTimeout(ConnectFailed):
    pass


class Disconnected(UpstreamError):
    """The connection ended before the whole answer."""


class BadResponse(UpstreamError):
    """The bytes are not an HTTP/1.1 answer."""


class DeadlinePassed(UpstreamError, TimeoutError):
    """Nothing (more) came before the caller's deadline."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; the parser's callbacks fill `chunks` for the reader."""

    __slots__ = ("pool", "key", "transport", "parser", "status", "headers_done", "complete", "chunks",
                 "buffered", "paused", "waiter", "error", "closed", "got_bytes", "idle_since", "keep_alive",
                 "framed", "linger", "on_body", "idle", "interim", "content_type", "content_encoding")

    def __init__(self, pool: UpstreamPool, key: tuple) -> None:
        self.pool = pool
        self.key = key
        # None until connection_made: every read and write happens after it (the pool's
        # close paths check for None), so it is typed as it is then, no assert per chunk.
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.closed = False
        self.idle_since = 0.0
        self.idle = False  # in the pool: any byte now is unsolicited
        self.linger: asyncio.TimerHandle | None = None  # see UpstreamResponse.release_when_complete
        self._reset()

    def _reset(self) -> None:
        # httptools calls on_body once per HTTP chunk (a coalesced stream: ~100 per read): the
        # list's own append, a C call, instead of a Python method. The parser takes its
        # callbacks when it is made, so `chunks` is only ever cleared, never replaced.
        self.chunks: list[bytes] = []
        self.on_body = self.chunks.append
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future | None = None
        self.error: UpstreamError | None = None
        self.got_bytes = False
        self.keep_alive = False
        self.framed = False  # Content-Length or chunked: otherwise the body ends with the connection
        self.interim = False  # parsing a 1xx answer, which precedes the real one
        self.content_type: bytes | None = None
        self.content_encoding: bytes | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        # The parser's callbacks only record; the reader is woken once per read, not once per
        # HTTP chunk (a coalesced stream brings ~100 of them in one read).
        if self.idle:
            self._drop()  # nobody asked: never let the next request read it as its answer
            return
        self.got_bytes = True
        lingering = self.linger is not None  # (the end of the message, parsed below, ends it)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.complete:
                self._drop()  # bytes behind the whole answer (on_message_begin stopped the parse)
                return
            self._fail(BadResponse(f"unparseable answer: {exc}"))
            self.transport.abort()
            return
        if lingering:  # the reader is gone: only the end of the message mattered
            self.chunks.clear()
            return
        self.buffered += len(data)  # with the framing: close enough for a high-water mark
        if self.buffered > HIGH_WATER and not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()
        if self.waiter is not None:
            self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
        self.pool._forget(self)
        if not self.complete and self.error is None:
            if self.headers_done and not self.framed:
                self.complete = True  # a close-delimited body ends here
            else:
                self.error = Disconnected("the model server closed the connection" +
                                          (f": {exc}" if exc else ""))
        self._wake()

    def _drop(self) -> None:
        """Never reuse this connection: it carries bytes that are no request's answer."""
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            self.transport.abort()

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            # A second answer to one request: stop the parse here (data_received drops the
            # connection) so that none of it reaches this reader or the next request.
            raise BadResponse("bytes after the end of the answer")
        self.framed = False  # after a 1xx, the final answer's headers start afresh
        self.content_type = self.content_encoding = None

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length":
            self.framed = True
        elif lower == b"transfer-encoding":
            codings = [c.strip() for c in value.lower().split(b",")]
            if b"chunked" in codings:
                self.framed = True
            if any(c not in (b"chunked", b"identity", b"") for c in codings):
                self.content_encoding = value
        elif lower == b"content-type":
            self.content_type = value
        elif lower == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            self.content_encoding = value

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:
                raise BadResponse("the model server switched protocols")
            self.interim = True  # 100 Continue, 103 Early Hints: the real answer follows
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
            if self.keep_alive and self.framed:
                self.pool._put(self)
            else:
                self.pool._close(self)

    # -- for the reader
    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, deadline: float | None = None) -> None:
        """Until the parser has news; DeadlinePassed at `deadline` (loop time). One timer
        handle, not an asyncio.timeout() (about half the CPU on the request path)."""
        loop = self.pool.loop
        waiter = self.waiter = loop.create_future()
        timer = loop.call_at(deadline, _expire, waiter) if deadline is not None else None
        try:
            if await waiter:
                raise DeadlinePassed("deadline passed")
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def send(self, data: bytes) -> None:
        self._reset()
        self.transport.write(data)


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(True)


class UpstreamResponse:
    """One answer: status, then the body as it arrives (read) or whole (read_capped)."""

    __slots__ = ("_conn", "status", "_done", "content_type", "content_encoding")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = conn.status
        self._done = False
        self.content_type = conn.content_type  # bytes as sent, None when absent
        self.content_encoding = conn.content_encoding  # None: the body is plain bytes

    async def read(self, deadline: float | None = None) -> bytes:
        """The body bytes that have arrived (waiting for some, until `deadline`), b"" at the end."""
        conn = self._conn
        while not conn.chunks:
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait(deadline)
        chunks = conn.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        conn.buffered = 0
        if conn.paused:
            conn.paused = False
            if not conn.closed:
                conn.transport.resume_reading()
        return data

    async def read_capped(self, limit: int, deadline: float | None = None) -> bytes:
        """The whole body, or its first limit + 1 bytes or more when it is longer (the caller decides)."""
        first = await self.read(deadline)
        if not first or self.at_eof():
            return first  # the common case: the whole body at once, no copies
        buf = bytearray(first)
        while len(buf) <= limit:
            chunk = await self.read(deadline)
            if not chunk:
                break
            buf += chunk
        return bytes(buf)

    def at_eof(self) -> bool:
        conn = self._conn
        return conn.complete and not conn.chunks

    def release(self) -> None:
        """Done with the answer: the connection is pooled if it is whole and reusable, else closed."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        if conn.complete and not conn.chunks and conn.keep_alive and conn.framed and not conn.closed:
            conn.pool._put(conn)
        else:
            conn.pool._close(conn)

    def release_when_complete(self, grace: float) -> None:
        """The answer is whole for the caller (a stream's `data: [DONE]` came), but its framing
        may still be on the way: uvicorn sends the last chunk of a stream on its own, after
        [DONE]. The connection is pooled when the message ends, closed if that takes more
        than `grace` seconds; without this, every stream would cost a new connection."""
        conn = self._conn
        if self._done or conn.complete or conn.closed or conn.error is not None:
            self.release()
            return
        self._done = True
        conn.chunks.clear()
        conn.buffered = 0
        if conn.paused:
            conn.paused = False
            conn.transport.resume_reading()
        conn.linger = conn.pool.loop.call_later(grace, conn.pool._close, conn)

    def close(self) -> None:
        """Abandon the answer: closing the connection is what tells the model server to stop."""
        if not self._done:
            self._done = True
            self._conn.pool._close(self._conn)


class _Target:
    """What a chat URL resolves to, computed once per URL."""

    __slots__ = ("key", "host", "port", "ssl", "head", "headers")

    def __init__(self, url: str, headers: Any) -> None:
        self.headers = headers  # the object it was built from (see UpstreamPool._target)
        parsed = URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"not an http(s) URL: {url}")
        self.host = parsed.host
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.ssl = parsed.scheme == "https"
        self.key = (self.host, self.port, self.ssl)
        host_header = parsed.host_port_subcomponent  # IPv6 in brackets, the port only when not the default
        lines = [f"POST {parsed.raw_path_qs} HTTP/1.1", f"Host: {host_header}", "Accept-Encoding: identity"]
        for name, value in headers.items():
            if name.lower() in ("host", "content-length", "connection", "transfer-encoding", "accept-encoding"):
                continue
            if _UNSAFE.search(name) or _UNSAFE.search(str(value)):
                # Config is checked at start-up (proxy.upstream.workers); this is the last line.
                raise ValueError(f"control character in the header {name!r} for {url}")
            lines.append(f"{name}: {value}")
        self.head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")


class UpstreamPool:
    """Keep-alive connections per (host, port, tls), shared by every request of the app."""

    def __init__(self, *, keepalive_s: float = KEEPALIVE_S) -> None:
        self.loop = asyncio.get_running_loop()
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple, deque[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._targets: dict[str, _Target] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def stats(self) -> dict[str, int]:
        return {"in_use": len(self._busy), "idle": sum(len(q) for q in self._idle.values())}

    def _target(self, url: str, headers: Any) -> _Target:
        # A worker's headers object is built once (Worker.chat_headers is cached): another
        # object for the same URL means other settings, and the target is built again.
        target = self._targets.get(url)
        if target is None or target.headers is not headers:
            if len(self._targets) > 1024:
                self._targets.clear()
            target = self._targets[url] = _Target(url, headers)
        return target

    async def post(self, url: str, headers: Any, body: bytes, *, connect_timeout: float,
                   deadline: float | None = None) -> UpstreamResponse:
        """Send one POST and wait for the answer's status line and headers (until `deadline`,
        loop time: DeadlinePassed; the connect phase alone is bounded by connect_timeout)."""
        target = self._target(url, headers)
        request = b"%s%d\r\n\r\n%s" % (target.head, len(body), body)
        conn = self._take(target.key)
        if conn is not None:
            try:
                return await self._exchange(conn, request, deadline)
            except Disconnected:
                if conn.got_bytes:
                    raise
                # The server closed it while idle, before our request: once more on a new one.
        conn = await self._connect(target, connect_timeout)
        return await self._exchange(conn, request, deadline)

    async def _exchange(self, conn: _Connection, request: bytes, deadline: float | None) -> UpstreamResponse:
        self._busy.add(conn)
        try:
            conn.send(request)
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(deadline)
        except BaseException:
            self._close(conn)
            raise
        return UpstreamResponse(conn)

    async def _connect(self, target: _Target, timeout: float) -> _Connection:
        if self._closed:
            raise ConnectFailed("the proxy is shutting down")
        ssl_ctx = None
        if target.ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_ctx = self._ssl
        try:
            async with asyncio.timeout(timeout):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self, target.key), target.host, target.port, ssl=ssl_ctx)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {target.host}:{target.port} within {timeout:g}s") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"cannot connect to {target.host}:{target.port}: {exc}") from None
        return conn

    def _take(self, key: tuple) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be closed by the server
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                conn.idle = False
                return conn
            conn.transport.close()
        return None

    def _put(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if self._closed:
            conn.transport.close()
            return
        conn.idle_since = now = time.monotonic()
        conn.idle = True
        idle = self._idle.setdefault(conn.key, deque())
        while idle and now - idle[0].idle_since >= self.keepalive_s:  # the oldest first
            idle.popleft().transport.close()
        idle.append(conn)

    def _close(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if not conn.closed and conn.transport is not None:
            conn.transport.close()

    def _forget(self, conn: _Connection) -> None:
        """connection_lost: never hand out a dead connection."""
        self._busy.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        self._closed = True
        conns = [c for q in self._idle.values() for c in q] + list(self._busy)
        self._idle.clear()
        for conn in conns:
            if conn.transport is not None and not conn.closed:
                conn.transport.close()
        if conns:
            await asyncio.sleep(0)  # let the transports run connection_lost
