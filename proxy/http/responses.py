"""POST /v1/responses after its phases, and every turn that runs as it (a WebSocket
`response.create`, the summary turn of /v1/responses/compact): the one Translation is
forwarded (proxy.http.forwarder). A request whose translation made it a compaction's (its
input ended with a `compaction_trigger` item) is its unit's declared variant instead, answered
by proxy.http.compaction_trigger (proxy.http.routes.VARIANT_HANDLERS)."""

from __future__ import annotations

from aiohttp import web

from proxy.http.forwarder import forward
from proxy.state import CONTEXT


async def responses_handler(request: web.Request) -> web.StreamResponse:
    return await forward(request, request[CONTEXT])
