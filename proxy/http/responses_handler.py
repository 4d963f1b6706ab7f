"""The handler of POST /v1/responses: the only place that sends a generation upstream for it.

It takes the one Translation the prepare phase made (proxy.http.request) and hands it to the
failover (proxy.http.failover: which worker, the context check, another worker on a failure
before the first byte). Each attempt posts the chat request over the app's pooled upstream
client and answers as the request asked: one Response (proxy.http.json_answer) or an event
stream rewritten chunk by chunk as it arrives (proxy.http.stream_answer). After the first
byte, every problem becomes a response.failed event with retry hints.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from proxy.errors import APIError
from proxy.http.event_stream import SSE_HEADERS
from proxy.http.failover import failover
from proxy.http.json_answer import count_usage, json_answer
from proxy.http.stream_answer import stream_answer
from proxy.protocol.dialects import chat_for
from proxy.protocol.response import ResponseContext
from proxy.protocol.rewriter import StreamRewriter
from proxy.protocol.seal import binding
from proxy.protocol.translate import Translation
from proxy.runtime import tracing
from proxy.state import CONTEXT, POOL, RESPONSE_SETTINGS, SEALER, SESSION, UPSTREAMS, RequestContext
from proxy.upstream.client import UpstreamResponse
from proxy.upstream.exchange import Attempt, attempt_once


def response_context(app: web.Application, ctx: RequestContext, t: Translation) -> ResponseContext:
    settings = app[RESPONSE_SETTINGS]  # config.responses
    sealer = app.get(SEALER)
    return ResponseContext(
        response_id="resp_" + ctx.request_id.removeprefix("req_"),
        model=t.model,
        created_at=int(time.time()),
        echo=t.echo,
        tools=t.tools,
        ai_markers=settings.ai_markers, ai_notice=settings.ai_notice,
        reasoning_items=settings.reasoning_items, reasoning_in_clear=settings.reasoning_in_clear,
        seal=sealer.bound(binding(ctx.key))[0] if sealer is not None and t.include_encrypted_reasoning else None,
        output_cap=t.output_cap,
        allowed_tools=t.allowed_tools,
    )


async def forward(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    """The answer to the request's Translation, from the first worker that gives one."""
    t = ctx.to_answer()
    assert isinstance(t, Translation)  # the translate phase ran: a Responses unit's is a Translation
    body = ctx.body or {}
    rctx = response_context(request.app, ctx, t)

    def attempt(one: Attempt, sent: Translation) -> Any:
        # `sent` is `t`, or a copy whose cap the context check lowered to the room the window leaves
        return _attempt(request, ctx, one, sent, rctx)

    return await failover(request, ctx, t, attempt, provider=body.get("provider"),
                          client_max=body.get("max_output_tokens"))


async def _attempt(request: web.Request, ctx: RequestContext, attempt: Attempt, t: Translation,
                   rctx: ResponseContext) -> web.StreamResponse:
    """One worker's answer; raises _Retryable when nothing reached the client and another may answer."""
    worker = attempt.worker
    app = request.app

    async def as_json(body: bytes) -> web.StreamResponse:
        answer = json_answer(attempt, rctx, body)
        if attempt.report is not None and attempt.report.usage is None:
            await count_usage(app[SESSION], attempt, t, rctx, answer)
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def as_stream(upstream: UpstreamResponse, first: bytes, deadline: float) -> web.StreamResponse:
        return await stream_answer(request, ctx, attempt, upstream, rctx, first, deadline)

    payload = orjson.dumps(chat_for(t.chat, worker.dialect, worker.thinking_switch))
    traces = tracing.ACTIVE
    if traces is not None:  # its span, its traceparent to the worker (off: nothing but this test)
        return await tracing.traced_attempt(traces, attempt, worker.chat_url, lambda headers: attempt_once(
            app[UPSTREAMS], app[POOL], attempt, worker.chat_url, payload, stream=t.stream, answer_json=as_json,
            answer_stream=as_stream, headers=headers))
    return await attempt_once(app[UPSTREAMS], app[POOL], attempt, worker.chat_url, payload, stream=t.stream,
                              answer_json=as_json, answer_stream=as_stream)


# Refusals an event-stream-only client must read as an event. Codex sends
# `Accept: text/event-stream` and reads a spent balance only from a response.failed event
# with error.code "insufficient_quota" (then it stops: "Quota exceeded"); an HTTP 402 it
# treats as a transient status and retries five times. The openai SDKs accept JSON and
# keep getting the HTTP 402 envelope.
_STREAMED_REFUSALS = frozenset({"insufficient_quota"})


def _event_stream_only(request: web.Request, ctx: RequestContext) -> bool:
    accept = request.headers.get("Accept", "").lower()
    if "text/event-stream" not in accept or "application/json" in accept or "*/*" in accept:
        return False
    body = ctx.body
    return isinstance(body, dict) and body.get("stream") is True


async def refusal_as_event(request: web.Request, ctx: RequestContext, exc: APIError) -> web.StreamResponse | None:
    """The refusal as response.created + response.failed (HTTP 200) for an event-stream-only
    client, when Accept leaves no other way to tell it; None: answer with the JSON envelope."""
    if exc.code not in _STREAMED_REFUSALS or not ctx.unit.refusal_as_event or not _event_stream_only(request, ctx):
        return None
    t = ctx.to_answer()
    if not isinstance(t, Translation):  # not translated yet (a refusal before the body)
        return None
    rewriter = StreamRewriter(response_context(request.app, ctx, t))
    body = rewriter.fail(exc.message, code=exc.code, retry_after_ms=None, should_retry=False, verbatim_code=True)
    response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **exc.headers, "x-should-retry": "false"})
    await response.prepare(request)
    await response.write(body)
    await response.write_eof()
    return response


async def responses_handler(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses after its phases, and every turn that runs as it (a WebSocket
    `response.create`, the summary turn of /v1/responses/compact): the one Translation is
    forwarded. A request whose translation made it a compaction's (its input ended with a
    `compaction_trigger` item) is its unit's declared variant instead, answered by
    proxy.http.compaction_trigger (proxy.http.routes.VARIANT_HANDLERS)."""
    return await forward(request, request[CONTEXT])
