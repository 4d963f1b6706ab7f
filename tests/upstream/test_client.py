"""proxy.upstream.client, the chat leg's HTTP/1.1 client, against raw loopback servers that send
exactly the bytes each case needs (framing, keep-alive, stale connections, faults)."""

from __future__ import annotations

import asyncio

import pytest
from multidict import CIMultiDict

from proxy.upstream import client as up
from proxy.upstream.client import BadResponse, ConnectFailed, ConnectTimeout, Disconnected, UpstreamPool
from tests.conftest import eventually

HEADERS = CIMultiDict({"Content-Type": "application/json", "Authorization": "Bearer up-key"})


class RawServer:
    """Answers each request on a connection with the next of `answers` (bytes, or a callable
    taking the writer); records requests and connections."""

    def __init__(self, answers) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> "RawServer":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if callable(answer):
                    if await answer(writer) == "close":
                        break
                else:
                    writer.write(answer)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def chunked(*parts: bytes) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    for part in parts:
        out += b"%x\r\n%s\r\n" % (len(part), part)
    return out + b"0\r\n\r\n"


async def read_all(response) -> bytes:
    out = b""
    while chunk := await response.read():
        out += chunk
    return out


async def test_request_bytes_and_content_length_answer():
    async with RawServer([ok(b'{"a":1}')]) as srv:
        pool = UpstreamPool()
        resp = await pool.post(srv.url, HEADERS, b'{"x":2}', connect_timeout=5)
        assert resp.status == 200
        assert await resp.read_capped(1000) == b'{"a":1}' and resp.at_eof()
        resp.release()
        assert pool.stats() == {"in_use": 0, "idle": 1}
        await pool.close()
    head, body = srv.requests[0].split(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    assert f"Host: 127.0.0.1:{srv.port}".encode() in lines
    assert b"Authorization: Bearer up-key" in lines and b"Content-Length: 7" in lines
    assert body == b'{"x":2}'


async def test_chunked_body_and_keep_alive_reuse():
    async with RawServer([chunked(b"data: 1\n\n", b"data: 2\n\n"), ok(b"{}")]) as srv:
        pool = UpstreamPool()
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        assert await read_all(resp) == b"data: 1\n\ndata: 2\n\n"
        resp.release()
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        assert await resp.read_capped(100) == b"{}"
        resp.release()
        assert srv.connections == 1  # the second request reused the first connection
        await pool.close()


async def test_close_delimited_body_is_read_to_the_end_and_not_pooled():
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{\"late\": true}"

    async def send_and_close(writer):
        writer.write(answer)
        await writer.drain()
        return "close"

    async with RawServer([send_and_close]) as srv:
        pool = UpstreamPool()
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        assert await read_all(resp) == b'{"late": true}'
        resp.release()
        assert pool.stats() == {"in_use": 0, "idle": 0}
        await pool.close()


async def test_stale_pooled_connection_is_retried_once_on_a_fresh_one():
    async def answer_then_close(writer):
        writer.write(ok(b"1"))
        await writer.drain()
        return "close"  # the server drops the kept-alive connection, as uvicorn does when idle

    async with RawServer([answer_then_close, ok(b"2")]) as srv:
        pool = UpstreamPool()
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        assert await resp.read_capped(10) == b"1"
        resp.release()
        # Send before the pool has seen the close (the race the retry is for).
        conn = pool._idle[next(iter(pool._idle))][0]
        conn.closed = False
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        assert await resp.read_capped(10) == b"2"
        resp.release()
        assert srv.connections == 2
        await pool.close()


async def test_disconnect_mid_body_raises_disconnected():
    async def half(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()
        return "close"

    async with RawServer([half]) as srv:
        pool = UpstreamPool()
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        assert await resp.read() == b"only part"
        with pytest.raises(Disconnected):
            await resp.read()
        resp.close()
        assert pool.stats() == {"in_use": 0, "idle": 0}
        await pool.close()


async def test_garbage_is_a_bad_response():
    async with RawServer([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"]) as srv:
        pool = UpstreamPool()
        with pytest.raises(BadResponse):
            await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        assert pool.stats() == {"in_use": 0, "idle": 0}
        await pool.close()


async def test_connect_refused_and_connect_timeout():
    async with RawServer([]) as srv:
        url = srv.url
    pool = UpstreamPool()
    with pytest.raises(ConnectFailed):
        await pool.post(url, HEADERS, b"{}", connect_timeout=5)  # nothing listens there any more
    with pytest.raises(ConnectTimeout):
        await pool.post(url, HEADERS, b"{}", connect_timeout=0)
    await pool.close()


async def test_unread_body_pauses_the_socket_and_reading_resumes_it():
    body = b"x" * (4 * up.HIGH_WATER)
    async with RawServer([ok(body)]) as srv:
        pool = UpstreamPool()
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        conn = resp._conn
        await eventually(lambda: conn.paused, what="the socket paused")
        await asyncio.sleep(0.05)  # not a wait: time for more bytes to arrive, were the socket still read
        assert conn.buffered < 2 * up.HIGH_WATER  # not the whole body: the socket stopped
        assert await resp.read_capped(len(body) + 1) == body  # and reading resumed it
        resp.release()
        await pool.close()


async def test_close_abandons_the_answer_and_the_connection():
    async with RawServer([chunked(b"data: 1\n\n" * 3)]) as srv:
        pool = UpstreamPool()
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        resp.close()
        await eventually(lambda: pool.stats() == {"in_use": 0, "idle": 0}, what="the closed connection out of the pool")
        await pool.close()


async def test_deadline_passes_while_waiting_for_the_answer():
    async def silent(writer):
        await asyncio.sleep(1)  # a silent upstream: the deadline passes meanwhile
        return "close"

    async with RawServer([silent]) as srv:
        pool = UpstreamPool()
        loop = asyncio.get_running_loop()
        with pytest.raises(up.DeadlinePassed):
            await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5, deadline=loop.time() + 0.05)
        assert pool.stats() == {"in_use": 0, "idle": 0}  # the connection is not reused
        await pool.close()


async def stream_up_to_done(writer) -> None:
    """A chunked SSE answer up to its `data: [DONE]` chunk, without the terminating chunk."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"e\r\ndata: [DONE]\n\n\r\n")
    await writer.drain()


async def test_a_stream_over_at_done_keeps_its_connection_when_the_last_chunk_follows():
    async def done_then_terminator(writer):
        await stream_up_to_done(writer)
        await asyncio.sleep(0.05)  # uvicorn sends the last chunk on its own
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with RawServer([done_then_terminator, ok(b"{}")]) as srv:
        pool = UpstreamPool()
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        assert await resp.read() == b"data: [DONE]\n\n"
        assert not resp.at_eof()
        resp.release_when_complete(5)
        assert pool.stats() == {"in_use": 1, "idle": 0}
        await eventually(lambda: pool.stats()["idle"], what="the connection back in the pool")
        assert pool.stats() == {"in_use": 0, "idle": 1}
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        assert await resp.read_capped(10) == b"{}"
        resp.release()
        assert srv.connections == 1
        await pool.close()


async def test_a_stream_whose_framing_never_ends_is_closed_after_the_grace():
    async def never_ends(writer):
        await stream_up_to_done(writer)
        await asyncio.sleep(2)  # the framing never ends within the grace
        return "close"

    async with RawServer([never_ends]) as srv:
        pool = UpstreamPool()
        resp = await pool.post(srv.url, HEADERS, b"{}", connect_timeout=5)
        assert await resp.read() == b"data: [DONE]\n\n"
        resp.release_when_complete(0.05)
        await eventually(lambda: pool.stats() == {"in_use": 0, "idle": 0}, what="the connection closed after the grace")
        await pool.close()


def test_host_header_and_path_of_the_target():
    t = up._Target("http://[::1]:8000/prefix/v1/chat/completions?x=1", HEADERS)
    assert t.key == ("::1", 8000, False)
    assert t.head.startswith(b"POST /prefix/v1/chat/completions?x=1 HTTP/1.1\r\nHost: [::1]:8000\r\n")
    t = up._Target("https://models.example/v1/chat/completions", HEADERS)
    assert t.key == ("models.example", 443, True) and b"\r\nHost: models.example\r\n" in t.head
    with pytest.raises(ValueError):
        up._Target("ftp://x/y", HEADERS)
