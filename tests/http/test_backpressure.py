"""A slow client must not make the proxy buffer without limit.

The forwarder awaits `StreamResponse.write`, which waits for the client socket to drain
above aiohttp's high-water mark; while it waits it does not read the upstream, so the
upstream's own writes block (TCP flow control) and its generation pauses. Here an
upstream streams a long answer (~48 MB of chunks, far more than every socket buffer on
the path together) and counts what its writes got through; a client reads the headers
and then nothing for a while. The upstream must stall well before the end, the proxy's
pending output must stay small, and once the client reads again the whole answer arrives.
"""

from __future__ import annotations

import asyncio
import socket

import orjson
from aiohttp import web
from tests.conftest import eventually, only, unchanged_for

NO_AUTH = only("stateless")
CHUNKS = 12_000
TEXT = "x" * 4000  # one delta: ~4 kB upstream, ~4 kB out
PART = 1 << 20


class LongUpstream:
    """A vLLM-shaped chat-completions stream of CHUNKS deltas; counts the bytes its writes let through."""

    def __init__(self) -> None:
        self.written = 0
        self.finished = False
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            return b"data: " + orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                                             "model": "tiny-org/tiny-model", "choices": [{"index": 0, "delta": delta,
                                                                                 "finish_reason": finish}]}) + b"\n\n"

        await resp.write(chunk({"role": "assistant", "content": ""}))
        body = chunk({"content": TEXT})
        for _ in range(CHUNKS):
            await resp.write(body)  # awaits drain: blocks while the proxy does not read
            self.written += len(body)
        await resp.write(chunk({}, "stop") + b"data: [DONE]\n\n")
        self.finished = True
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny-org/tiny-model", "object": "model", "owned_by": "vllm"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def __aenter__(self) -> "LongUpstream":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_slow_client_pauses_the_upstream(make_proxy):
    async with LongUpstream() as upstream:
        proxy = await make_proxy(NO_AUTH, workers=[{"name": "long", "url": upstream.url, "models": ["tiny-org/tiny-model"],
                                                    "timeouts": {"connect": 2, "first_byte": 10, "idle": 60,
                                                                 "total": 120}}])
        host, port = proxy.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # a small client window
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (host, int(port)))
        body = orjson.dumps({"model": "tiny-org/tiny-model", "input": "write a lot", "stream": True})
        await loop.sock_sendall(sock, (f"POST /v1/responses HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                                       f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        received = await loop.sock_recv(sock, 4096)
        assert received.startswith(b"HTTP/1.1 200"), received[:200]

        # The client reads nothing now. Wait until the upstream's progress stops.
        await eventually(unchanged_for(lambda: upstream.written, 1.0),  # one second without any progress
                         what="the upstream's writes to stop while the client reads nothing")
        total = CHUNKS * (len(TEXT) + 150)
        assert not upstream.finished
        # Stalled far from the end: what got through is what the socket buffers hold, not the answer.
        assert upstream.written < total / 2, (upstream.written, total)

        # The proxy itself holds little: its pending client-side output is bounded by the
        # transport's high-water mark, whatever the upstream has in store.
        pending = [t.get_write_buffer_size() for t in _server_transports(proxy)]
        print(f"upstream stalled after {upstream.written} of {total} bytes; proxy pending output {pending}")
        assert pending and max(pending) < 4 * PART, pending

        # The client reads again: everything arrives, the upstream finishes, the stream completes.
        tail, completed = received, False
        while not tail.endswith(b"0\r\n\r\n"):
            data = await asyncio.wait_for(loop.sock_recv(sock, PART), 30)
            if not data:
                break
            window = tail[-64:] + data
            completed = completed or b"event: response.completed" in window
            tail = window
        sock.close()
        assert upstream.finished
        assert completed


def _server_transports(proxy) -> list:
    """The transports of the proxy's open client connections (aiohttp's RequestHandlers)."""
    return [conn.transport for conn in proxy.runner.server.connections if conn.transport is not None]
