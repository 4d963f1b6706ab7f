"""The floor: a bare aiohttp pass-through, bytes forwarded unchanged (no parsing, no rewriting).

    python -m bench.passthrough PORT UPSTREAM_URL

POST /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/messages, each to the same
path upstream.
"""

from __future__ import annotations

import sys

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages")


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    upstream = await request.app[SESSION].post(
        request.app["upstream"] + request.path, data=body, headers={"Content-Type": "application/json"})
    try:
        ctype = upstream.headers.get("Content-Type", "application/json")
        if not ctype.startswith("text/event-stream"):
            return web.Response(body=await upstream.read(), status=upstream.status,
                                headers={"Content-Type": ctype})
        response = web.StreamResponse(status=upstream.status, headers={"Content-Type": ctype})
        await response.prepare(request)
        read = upstream.content.readany
        while data := await read():
            await response.write(data)
        await response.write_eof()
        return response
    finally:
        upstream.release()


async def session_ctx(app: web.Application):
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        app[SESSION] = session
        yield


def main() -> None:
    port, upstream = int(sys.argv[1]), sys.argv[2].rstrip("/")
    app = web.Application()
    app["upstream"] = upstream
    app.cleanup_ctx.append(session_ctx)
    for path in PATHS:
        app.router.add_post(path, forward)
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = None
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, loop=loop)


if __name__ == "__main__":
    main()
