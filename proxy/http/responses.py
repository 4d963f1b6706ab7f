"""POST /v1/responses after its phases, and every turn that runs as it (a WebSocket
`response.create`, the summary turn of /v1/responses/compact): the one Translation is
forwarded (proxy.http.forwarder), or, when the translation made the request a compaction's
(its input ended with a `compaction_trigger` item), answered with the sealed summary
(proxy.http.compaction_trigger)."""

from __future__ import annotations

from aiohttp import web

from proxy.http.compaction_trigger import answer_trigger
from proxy.http.forwarder import forward
from proxy.state import CONTEXT


async def responses_handler(request: web.Request) -> web.StreamResponse:
    ctx = request[CONTEXT]
    if ctx.translation.compaction is not None:
        return await answer_trigger(request, ctx)
    return await forward(request, ctx)
