"""proxy.upstream.exchange.open_upstream, the one opening of a worker's answer that
/v1/responses (proxy.http.responses_handler) and the pass-through endpoints (proxy.http.passthrough_handler)
share: each failure is mapped as the client must read it, and whatever it raises, the upstream
connection is given back first (pooled when its answer was read whole, else closed): none is
left in use. A raw asyncio server plays the worker."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from proxy import state
from proxy.upstream import exchange as upstream_open
from proxy.http.errors import APIError
from proxy.upstream.exchange import AnswerLost, Retryable, open_upstream
from proxy.upstream.client import UpstreamPool
from proxy.config import settings as config_settings
from proxy.upstream.workers import Worker, WorkerPool
from tests.conftest import eventually

JSON_500 = b'{"error": {"message": "boom"}}'


def answer(status: int, body: bytes, *, headers: bytes = b"", content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (status, content_type, len(body),
                                                                                   headers) + body)


STALL_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class Worker1:
    """One raw server that answers each request with the next scripted bytes (None: headers of a
    stream, then nothing)."""

    def __init__(self) -> None:
        self.script: list[bytes | None] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                bytes_ = self.script.pop(0)
                writer.write(STALL_HEAD if bytes_ is None else bytes_)
                await writer.drain()
                if bytes_ is None or b"100000" in bytes_:
                    await reader.read()  # until the proxy closes it
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.fixture
async def setup():
    raw = Worker1()
    server = await asyncio.start_server(raw.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    worker = Worker(name="w", url=f"http://127.0.0.1:{port}",
                    timeouts=config_settings.of("workers[].timeouts",
                                                {"connect": 1, "first_byte": 0.3, "idle": 1, "total": 0.6}))
    app = web.Application()
    upstreams = UpstreamPool()
    app[state.UPSTREAMS] = upstreams
    app[state.POOL] = WorkerPool([worker])
    try:
        yield raw, app, worker, upstreams
    finally:
        await upstreams.close()
        server.close()
        await server.wait_closed()


async def _open(app, worker, *, stream: bool, refine=None):
    return await open_upstream(app[state.UPSTREAMS], app[state.POOL], worker, worker.chat_url, b"{}", stream=stream,
                               refine=refine)


CASES = {
    # what the worker sends -> what open_upstream raises, and whether the connection may be pooled
    "500": (answer(500, JSON_500), False, Retryable, 502, True),
    "400": (answer(400, JSON_500), False, APIError, 400, True),
    "429": (answer(429, b"{}"), True, APIError, 429, True),
    "encoded": (answer(200, b"\x1f\x8b", headers=b"Content-Encoding: gzip\r\n"), False, Retryable, 502, False),
    # the worker did the work: not another worker's to redo (the failover bills it)
    "too_large": (b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 5000, False, AnswerLost, 502, False),
    "no_first_byte": (None, True, APIError, 504, False),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_what_it_raises_gives_the_connection_back(setup, monkeypatch, case):
    raw, app, worker, upstreams = setup
    monkeypatch.setattr(upstream_open, "MAX_JSON_BODY", 1000)
    sent, stream, kind, status, pooled = CASES[case]
    raw.script.append(sent)
    with pytest.raises(kind) as caught:
        await _open(app, worker, stream=stream)
    error = caught.value.final if isinstance(caught.value, Retryable) else caught.value
    assert error.status == status
    await asyncio.sleep(0)  # not a wait: one loop turn, the one a closed transport needs to leave the pool
    assert upstreams.stats() == {"in_use": 0, "idle": 1 if pooled else 0}


async def test_a_refinement_is_asked_first(setup):
    raw, app, worker, upstreams = setup
    raw.script.append(answer(404, b'{"detail": "Not Found"}'))
    mine = APIError(404, "not served here", code="endpoint_not_served")
    with pytest.raises(APIError) as caught:
        await _open(app, worker, stream=False, refine=lambda status, body: mine if status == 404 else None)
    assert caught.value is mine
    assert upstreams.stats() == {"in_use": 0, "idle": 1}


async def test_a_cancelled_opening_gives_the_connection_back(setup):
    raw, app, worker, upstreams = setup
    raw.script.append(None)  # headers, then nothing: the first read waits
    task = asyncio.ensure_future(_open(app, worker, stream=True))
    await eventually(lambda: upstreams.stats()["in_use"], what="the upstream connection in use")
    assert upstreams.stats()["in_use"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert upstreams.stats() == {"in_use": 0, "idle": 0}


async def test_an_answer_that_opens_is_handed_over_in_use(setup):
    raw, app, worker, upstreams = setup
    raw.script.append(answer(200, b'{"ok": true}'))
    upstream, first = await _open(app, worker, stream=False)
    assert first == b'{"ok": true}' and upstreams.stats()["in_use"] == 1
    upstream.release()
    assert upstreams.stats() == {"in_use": 0, "idle": 1}
