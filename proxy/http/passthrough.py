"""The forwarding of a body as sent: /v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/messages and /v1/messages/count_tokens (proxy.http.units: CHAT .. MESSAGES_COUNT).

The translate phase (proxy.http.request) calls `passthrough_translate`: the endpoint must be on
(config `endpoints`), the body is read for what billing needs (proxy.protocol.passthrough) and the
image guard runs on chat content (and on Anthropic image URLs). The balance then holds the prompt
bound + the output cap, as for Responses. `passthrough_handler` picks a worker (affinity,
failover before the first byte, the context check on the first: as vLLM does on these APIs, an
output cap the prompt leaves no room for is lowered, not refused), posts the body to the same
path on it, and passes the answer through: a JSON answer as its bytes, an event stream event by
event as it arrives (proxy.protocol.chat_usage reads the usage on the way), settled before the
last bytes go out. A worker that answers 404 with no error of its own (FastAPI's "Not Found")
does not serve that path: another may; else 404 `endpoint_not_served` naming the worker.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.http.event_stream import SSE_HEADERS, EventStreamResponse
from proxy.http.forwarder import _check_stream_start, _let_go, _ReadWatchdog, _record_usage, _settle_now
from proxy.http.upstream_open import _Retryable, _upstream_message, open_upstream
from proxy.policy.netguard import ImagePolicy, check_images
from proxy.protocol.chat_usage import SSEScanner, json_usage
from proxy.protocol.passthrough import ANTHROPIC, Passthrough, build
from proxy.runtime.logs import log
from proxy.upstream.affinity import request_key
from proxy.upstream.client import BadResponse, Disconnected
from proxy.upstream.routing import check_context_window, choose
from proxy.upstream.workers import Worker

# config `endpoints` key of each family (messages_count follows messages)
SWITCHES = {"chat": "chat_completions", "completions": "completions", "embeddings": "embeddings",
            "messages": "messages", "messages_count": "messages"}


def policy_for(app: web.Application) -> ImagePolicy:
    """The app's image-URL policy (built once by build_app; built here from config otherwise)."""
    policy = app.get(state.IMAGE_POLICY)
    if policy is None:
        policy = ImagePolicy(app[state.CONFIG].images)
    return policy


async def passthrough_translate(app: web.Application, ctx: state.RequestContext, body: dict) -> Passthrough:
    family = ctx.unit.family
    switch = SWITCHES[family]
    if not getattr(app[state.CONFIG].endpoints, switch):
        raise APIError(404, f"{ctx.path} is turned off on this proxy (endpoints.{switch}).", code="endpoint_disabled")
    pool = app.get(state.POOL)
    t = build(family, body, pool.serves if pool is not None else None)
    if family == "chat":
        await check_images(policy_for(app), t.body)  # the model server fetches image_url parts
    elif family in ANTHROPIC and t.media:
        await check_images(policy_for(app), t.chat)  # URL image sources, as image_url parts in the view
    return t


def _dialect_error(family: str, message: str, status: int) -> bytes:
    if family in ANTHROPIC:
        kind = "api_error" if status >= 500 else "invalid_request_error"
        return b"event: error\ndata: " + orjson.dumps({"type": "error", "error": {"type": kind, "message": message}}) \
            + b"\n\n"
    return b"data: " + orjson.dumps({"error": {"message": message, "type": "server_error", "code": status}}) \
        + b"\n\ndata: [DONE]\n\n"


def _not_served(worker: Worker, t: Passthrough, status: int, body: bytes) -> _Retryable | None:
    """A 404/405 without an error message of the server's own: the worker has no such path."""
    if status not in (404, 405) or _upstream_message(body)[0] is not None:
        return None
    final = APIError(404, f"The model server '{worker.name}' does not serve {t.path}.", code="endpoint_not_served")
    return _Retryable(worker, f"no {t.path}", final)


async def passthrough_handler(request: web.Request) -> web.StreamResponse:
    ctx = request[state.CONTEXT]
    t: Passthrough = ctx.translation
    app = request.app
    pool = app[state.POOL]
    routing = app[state.CONFIG].routing
    affinity = request_key(t, routing.affinity)
    out = ctx.started_outcome()
    attempts = routing.max_attempts
    tried: list[Worker] = []
    last: _Retryable | None = None
    sent = t
    for _ in range(max(attempts, 1)):
        try:
            worker = choose(pool, t.upstream_model, exclude=tried, affinity=affinity)
        except APIError:
            if last is not None:
                raise last.final from None
            raise
        if last is not None:
            pool.note_failover(last.worker, str(last))
            log.info("failover", worker=last.worker.name, to=worker.name, reason=str(last), request_id=ctx.request_id)
        worker.in_flight += 1
        try:
            if not tried and routing.context_check and "max_tokens" in t.chat:
                # The cap as vLLM takes it on these APIs: lowered to the room the prompt leaves, not
                # refused (Claude Code asks 32,000 whatever the model's window); a prompt that
                # does not fit at all is still refused.
                _, sent = await check_context_window(app[state.SESSION], worker, t, None,
                                                     bytes_per_token_floor=routing.bytes_per_token_floor)
            return await _forward(request, ctx, worker, sent, out)
        except _Retryable as exc:
            tried.append(worker)
            last = exc
        finally:
            worker.in_flight -= 1
    assert last is not None
    raise last.final


async def _forward(request: web.Request, ctx: state.RequestContext, worker: Worker, t: Passthrough,
                   out: state.Outcome) -> web.StreamResponse:
    pool = request.app[state.POOL]
    timeouts = worker.timeouts
    out.upstream = worker.name
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    deadline = loop.time() + timeouts.total
    upstream = None
    try:
        upstream, first = await open_upstream(request.app, worker, worker.endpoint(t.path), orjson.dumps(t.body),
                                              stream=t.stream,
                                              refine=lambda status, body: _not_served(worker, t, status, body))
        out.ttfb_ms = (time.perf_counter() - started) * 1000
        if not t.stream:
            pool.record_success(worker, out.ttfb_ms / 1000)
            return _json_answer(worker, t, first, out)
        _check_stream_start(pool, worker, upstream, first)
        pool.record_success(worker, out.ttfb_ms / 1000)
        return await _stream(request, ctx, upstream, worker, t, first, out, deadline)
    finally:
        if upstream is not None:
            _let_go(upstream, t, out)


def _json_answer(worker: Worker, t: Passthrough, body: bytes, out: state.Outcome) -> web.Response:
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _Retryable(worker, "garbage body", APIError(502, "The model server sent an unreadable answer.",
                                                          code="upstream_error")) from None
    if not isinstance(answer, dict) or ("error" in answer and answer.get("type") != "message"):
        message, _ = _upstream_message(body)
        raise APIError(502, message or "The model server failed.", code="upstream_error")
    out.status = "completed"
    usage = json_usage(t.family, answer)
    _record_usage(out, usage, 0, t.output_cap)
    return web.Response(body=body, content_type="application/json")  # the bytes as they came


async def _stream(request: web.Request, ctx: state.RequestContext, upstream: Any, worker: Worker, t: Passthrough,
                  first: bytes, out: state.Outcome, deadline: float) -> web.StreamResponse:
    scanner = SSEScanner(t.family, t.usage_added)
    response = EventStreamResponse(status=200, headers=SSE_HEADERS)
    dog = _ReadWatchdog(worker.timeouts.idle, deadline, scanner)  # type: ignore[arg-type]  # it reads .done alone
    cap = t.output_cap
    failure: tuple[str, str] | None = None
    recorded = False
    try:
        await response.prepare(request)
        try:
            pending = scanner.feed(first)
        except ValueError:
            pending, failure = b"", ("The model server sent an event larger than the proxy accepts.", "upstream_error")
        read, write = upstream.read, response.write
        while failure is None and not scanner.done:
            if cap is not None and scanner.counted > cap:
                out.output_capped = True
                failure = ("The model server sent more output than max_tokens allows.", "upstream_error")
                break
            if pending:
                await write(pending)
                pending = b""
            dog.start_read()
            try:
                data = await read()
            except asyncio.CancelledError:
                if not dog.caused():
                    raise
                failure = (dog.message(worker.timeouts.total), "upstream_timeout")
                dog.since = None
                break
            except (Disconnected, BadResponse):
                dog.since = None
                request.app[state.POOL].record_failure(worker, "disconnected mid-stream")
                failure = ("The connection to the model server was lost mid-stream.", "upstream_disconnected")
                break
            dog.since = None
            if not data:
                pending += scanner.flush()
                if not scanner.done and not scanner.finished:
                    failure = ("The model server ended the stream before it was complete.", "upstream_error")
                break
            try:
                pending += scanner.feed(data)
            except ValueError:
                failure = ("The model server sent an event larger than the proxy accepts.", "upstream_error")
        out.status = "completed" if failure is None else "failed"
        if failure is not None:
            out.error = failure[1]
        _record_usage(out, scanner.usage, min(scanner.counted, cap) if cap else scanner.counted, cap,
                      out.output_capped)
        recorded = True
        await _settle_now(ctx)  # billed before the client can read the end of its answer
        if failure is not None:
            pending += _dialect_error(t.family, failure[0], 502 if failure[1] != "upstream_timeout" else 504)
        await response.write_eof(pending)
    except ConnectionResetError:
        if not scanner.done:
            raise
    finally:
        dog.stop()
        if not recorded:
            out.status = "completed" if scanner.done else "cancelled"
            _record_usage(out, scanner.usage, min(scanner.counted, cap) if cap else scanner.counted, cap,
                          out.output_capped)
    return response
