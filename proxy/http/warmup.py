"""A WebSocket `response.create` with `generate: false` (Codex sends one when a session
starts): the unit of work WS_WARMUP (proxy.units). It passes the phases as any turn does
(the key checked again, the limits, the body's sizes and policies, the key's models, the one
translation), then this handler answers it as a response with no output, without calling a
model, so the first real turn can continue it with only its new items. Nothing is generated,
so nothing is held or billed.
"""

from __future__ import annotations

from aiohttp import web

from proxy import state
from proxy.http.event_stream import open_event_stream
from proxy.http.responses_handler import response_context
from proxy.protocol.rewriter import StreamRewriter
from proxy.protocol.translate import Translation

# The end of a chat stream that produced nothing: the rewriter's own path to a completed,
# empty response (the same events and Response object as any other turn).
_NOTHING = (b'data: {"id":"warmup","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},'
            b'"finish_reason":"stop"}],"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}}\n\n'
            b"data: [DONE]\n\n")


async def warmup_handler(request: web.Request) -> web.StreamResponse:
    """After the phases: the turn's event stream of a response that generated nothing."""
    ctx = request[state.CONTEXT]
    answer, encoder = open_event_stream(request)
    await answer.prepare(request)  # before the first event: the transport's say in the headers
    t = ctx.translation
    assert isinstance(t, Translation)  # the translate phase ran: a warm-up declares it (proxy.units.WS_WARMUP)
    rewriter = StreamRewriter(response_context(request.app, ctx, t), encoder=encoder)
    stream = rewriter.start() + rewriter.feed(_NOTHING)
    if not rewriter.done:
        stream += rewriter.finish()
    await answer.write_eof(stream)
    return answer
