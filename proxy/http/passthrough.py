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
from typing import Any

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.http.attempt import Attempt, let_go
from proxy.http.event_stream import SSE_HEADERS, EventStreamResponse
from proxy.http.failover import failover
from proxy.http.upstream_open import _Retryable, _upstream_message, open_upstream
from proxy.http.watchdog import ReadWatchdog
from proxy.policy.netguard import ImagePolicy, check_images
from proxy.protocol.chat_usage import SSEScanner, json_usage
from proxy.protocol.passthrough import ANTHROPIC, Passthrough, build
from proxy.upstream.client import BadResponse, Disconnected
from proxy.upstream.routing import check_context_window
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
    t: Passthrough = ctx.to_answer()
    app = request.app
    floor = app[state.CONFIG].routing.bytes_per_token_floor

    def fit(worker: Worker, sent: Passthrough) -> Any:
        # The cap as vLLM takes it on these APIs: lowered to the room the prompt leaves, not
        # refused (Claude Code asks 32,000 whatever the model's window); a prompt that does
        # not fit at all is still refused.
        return check_context_window(app[state.SESSION], worker, sent, None, bytes_per_token_floor=floor)

    def attempt(one: Attempt, sent: Passthrough) -> Any:
        return _attempt(request, ctx, one, sent)

    return await failover(request, ctx, t, attempt, check=fit if "max_tokens" in t.chat else None)


async def _attempt(request: web.Request, ctx: state.RequestContext, attempt: Attempt,
                   t: Passthrough) -> web.StreamResponse:
    worker = attempt.worker
    deadline = asyncio.get_running_loop().time() + worker.timeouts.total
    upstream = None
    attempt.sent()
    try:
        upstream, first = await open_upstream(request.app, worker, worker.endpoint(t.path), orjson.dumps(t.body),
                                              stream=t.stream,
                                              refine=lambda status, body: _not_served(worker, t, status, body))
        attempt.opened(request.app[state.POOL], upstream, first, t.stream)
        if not t.stream:
            return _json_answer(attempt, t, first)
        return await _stream(request, ctx, attempt, upstream, t, first, deadline)
    finally:
        if upstream is not None:
            let_go(upstream, t.stream, attempt.report)


def _json_answer(attempt: Attempt, t: Passthrough, body: bytes) -> web.Response:
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _Retryable(attempt.worker, "garbage body", APIError(502, "The model server sent an unreadable answer.",
                                                                  code="upstream_error")) from None
    if not isinstance(answer, dict) or ("error" in answer and answer.get("type") != "message"):
        message, _ = _upstream_message(body)
        raise APIError(502, message or "The model server failed.", code="upstream_error")
    attempt.end("completed", json_usage(t.family, answer), 0, t.output_cap)
    return web.Response(body=body, content_type="application/json")  # the bytes as they came


async def _stream(request: web.Request, ctx: state.RequestContext, attempt: Attempt, upstream: Any, t: Passthrough,
                  first: bytes, deadline: float) -> web.StreamResponse:
    """Everything but the stream's end written (it is ctx.tail: the envelope writes it once the
    answer is billed); the attempt's report made."""
    worker = attempt.worker
    scanner = SSEScanner(t.family, t.usage_added)
    response = EventStreamResponse(status=200, headers=SSE_HEADERS)
    dog = ReadWatchdog(worker.timeouts.idle, deadline, scanner)
    cap = t.output_cap
    failure: tuple[str, str] | None = None
    capped = False
    try:
        await response.prepare(request)
        try:
            pending = scanner.feed(first)
        except ValueError:
            pending, failure = b"", ("The model server sent an event larger than the proxy accepts.", "upstream_error")
        read, write = upstream.read, response.write
        while failure is None and not scanner.done:
            if cap is not None and scanner.counted > cap:
                capped = True
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
    except BaseException:  # raised or cancelled (the client left): the answer as it stands
        attempt.end("completed" if scanner.done else "cancelled", scanner.usage, _counted(scanner, cap), cap,
                    capped=capped)
        raise
    finally:
        dog.stop()
    attempt.end("completed" if failure is None else "failed", scanner.usage, _counted(scanner, cap), cap,
                capped=capped, error=failure[1] if failure is not None else None)
    if failure is not None:  # the dialect's own error event: it shows no bill, so it is known now
        pending += _dialect_error(t.family, failure[0], 502 if failure[1] != "upstream_timeout" else 504)
    ctx.tail = state.Tail(response, pending, scanner.done)
    return response


def _counted(scanner: SSEScanner, cap: int | None) -> int:
    return min(scanner.counted, cap) if cap else scanner.counted
