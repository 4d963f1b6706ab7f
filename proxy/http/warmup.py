"""A WebSocket `response.create` with `generate: false` (Codex sends one when a session
starts): the request is checked and remembered as a response with no output, without calling
a model, so the first real turn can continue it with only its new items. Nothing is generated,
so nothing is held or billed; the key was checked at the handshake.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from proxy import state
from proxy.http.forwarder import ResponseSettings
from proxy.protocol.ids import random_bits
from proxy.protocol.rewriter import ResponseContext, StreamRewriter
from proxy.protocol.translate import TranslateOptions, translate_request

# The end of a chat stream that produced nothing: the rewriter's own path to a completed,
# empty response (the same events and Response object as any other turn).
_NOTHING = (b'data: {"id":"warmup","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},'
            b'"finish_reason":"stop"}],"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}}\n\n'
            b"data: [DONE]\n\n")


def warmup_stream(request: web.Request, body: dict[str, Any]) -> bytes:
    """The event stream (SSE bytes) of a response that generated nothing; APIError(400) for a
    request the HTTP path would refuse in translation."""
    pool = request.app.get(state.POOL)
    t = translate_request(dict(body), TranslateOptions(served=pool.serves if pool is not None else None,
                                                       sampling_defaults=request.app.get(state.SAMPLING_DEFAULTS)))
    settings = request.app.get(state.RESPONSE_SETTINGS) or ResponseSettings()
    ctx = ResponseContext(response_id=f"resp_{random_bits(96):024x}", model=t.model, created_at=int(time.time()),
                          echo=t.echo, tools=t.tools, ai_markers=settings.ai_markers, ai_notice=settings.ai_notice,
                          reasoning_items=settings.reasoning_items, allowed_tools=t.allowed_tools)
    rewriter = StreamRewriter(ctx)
    stream = rewriter.start() + rewriter.feed(_NOTHING)
    return stream if rewriter.done else stream + rewriter.finish()
