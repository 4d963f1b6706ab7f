"""A recording relay for tests: a real aiohttp server between a client (Codex) and the proxy
that passes HTTP requests and WebSocket messages through unchanged and records what the
client sent, byte for byte: the proof of which transport a client used, what each turn
carried, and the bytes per turn of each transport.

    async with Relay(proxy.url) as relay:
        ... point the client at relay.base_url ...
    relay.http_requests -> [{"path", "headers", "bytes", "body"}]   (body: the raw request body)
    relay.ws_connections -> [{"headers", "sent": [text...], "received": [text...]}]
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

_HOP = frozenset({"host", "connection", "upgrade", "content-length", "transfer-encoding", "keep-alive",
                  "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                  "sec-websocket-accept", "sec-websocket-protocol"})


class Relay:
    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.http_requests: list[dict[str, Any]] = []
        self.ws_connections: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def __aenter__(self) -> "Relay":
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession(auto_decompress=False)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _headers(self, request: web.Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in _HOP}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._websocket(request)
        body = await request.read()
        self.http_requests.append({"path": request.path, "headers": dict(request.headers),
                                   "bytes": len(body), "body": body})
        assert self._session is not None
        async with self._session.request(request.method, self.target + request.path_qs, data=body,
                                         headers=self._headers(request)) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        record: dict[str, Any] = {"headers": dict(request.headers), "sent": [], "received": []}
        self.ws_connections.append(record)
        try:
            upstream = await self._session.ws_connect(self.target + request.path_qs, headers=self._headers(request),
                                                      max_msg_size=0)
        except aiohttp.WSServerHandshakeError as exc:
            record["refused"] = exc.status
            return web.json_response({"error": {"message": exc.message, "code": None}}, status=exc.status)
        client = web.WebSocketResponse(max_msg_size=0)
        await client.prepare(request)

        async def pump(source: Any, sink: Any, log: list[str]) -> None:
            async for msg in source:
                if msg.type == WSMsgType.TEXT:
                    log.append(msg.data)
                    await sink.send_str(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    log.append(msg.data.decode(errors="replace"))
                    await sink.send_bytes(msg.data)
            await sink.close()

        async with upstream:
            await asyncio.gather(pump(client, upstream, record["sent"]), pump(upstream, client, record["received"]),
                                 return_exceptions=True)
        return client
