"""The event stream of POST /v1/responses (stream: true, and every turn): the worker's chat
chunks through the sans-I/O StreamRewriter, one write per upstream read, as each arrives.

The stream's end (its last events, and a response.failed when the proxy ends it) is not
written here: it is the request's Tail (proxy.state), written by the envelope once the phases
returned, so the answer is billed and its limits' slot given back before a client can read it.
"""

from __future__ import annotations

from functools import partial

from aiohttp import web

from proxy.http.event_stream import open_event_stream
from proxy.http.read_loop import DISCONNECTED, EOF, TIMEOUT, TOO_LARGE, relay
from proxy.http.watchdog import ReadWatchdog
from proxy.protocol.answer_report import Tokens
from proxy.protocol.response import ResponseContext
from proxy.protocol.rewriter import StreamRewriter
from proxy.state import POOL, RequestContext, Tail
from proxy.upstream.client import UpstreamResponse
from proxy.upstream.exchange import Attempt


def _failed(rewriter: StreamRewriter, message: str, code: str, tokens: Tokens) -> bytes:
    # The proxy's response.failed shows the bill (the prompt and the output the worker
    # reported so far, else as counted).
    return rewriter.fail(message, code=code, usage=tokens.as_chat_usage())


async def stream_answer(request: web.Request, ctx: RequestContext, attempt: Attempt, upstream: UpstreamResponse,
                        rctx: ResponseContext, first: bytes, deadline: float) -> web.StreamResponse:
    """Everything but the stream's end written; the attempt's report made, the end left as ctx.tail."""
    worker = attempt.worker
    response, encoder = open_event_stream(request)  # an SSE response, or a transport's turn
    rewriter = ctx.event_stream = StreamRewriter(rctx, encoder=encoder)
    dog = ReadWatchdog(worker.timeouts.idle, deadline, rewriter)
    failure: tuple[str, str, bool] | None = None  # (message, code, the proxy's own error code)
    try:
        await response.prepare(request)
        for pending, last in rewriter.opening(first):
            if not last:  # a big first read's first events, ahead of the rest
                await response.write(pending)
        pending, ended = await relay(upstream.read, response.write, rewriter.feed, rewriter, dog, pending,
                                     partial(request.app[POOL].record_failure, worker, "disconnected mid-stream"))
        if ended == TIMEOUT:
            failure = (dog.message(worker.timeouts.total), "upstream_timeout", True)  # reads dog.since
            dog.since = None
        elif ended == DISCONNECTED:
            failure = ("The connection to the model server was lost mid-stream.", "upstream_disconnected", True)
        elif ended == EOF:
            pending += rewriter.drain()
            if rewriter.done or rewriter.finish_reason is not None:
                pending += rewriter.finish()
            else:  # the worker ended the stream mid-way
                failure = ("upstream stream ended without a finish_reason", "server_error", False)
        elif ended == TOO_LARGE:
            failure = ("The model server sent an event larger than the proxy accepts.", "upstream_error", True)
    except BaseException:  # raised or cancelled (the client left): the answer as it stands
        attempt.end(rewriter.status if rewriter.done else "cancelled", rewriter.usage, rewriter.output_tokens_seen,
                    rctx.output_cap, capped=rewriter.capped)
        raise
    finally:
        dog.stop()
    own_error = failure[1] if failure is not None and failure[2] else None
    attempt.end(rewriter.status if failure is None else "failed", rewriter.usage, rewriter.output_tokens_seen,
                rctx.output_cap, capped=rewriter.capped, error=own_error)
    ctx.tail = Tail(response, pending, True,
                    partial(_failed, rewriter, failure[0], failure[1]) if failure is not None else None)
    return response
