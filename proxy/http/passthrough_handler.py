"""The forwarding of a body as sent: /v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/messages and /v1/messages/count_tokens (proxy.units: CHAT .. MESSAGES_COUNT).

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

from functools import partial
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.http.anthropic_errors import anthropic_type
from proxy.http.event_stream import SSE_HEADERS, EventStreamResponse
from proxy.http.failover import failover, output_budget
from proxy.http.read_loop import DISCONNECTED, EOF, TIMEOUT, TOO_LARGE, relay
from proxy.http.watchdog import ReadWatchdog
from proxy.ledger.usage import as_count
from proxy.policy.netguard import ImagePolicy, check_images
from proxy.protocol.chat_usage import SSEScanner, json_output, json_usage
from proxy.protocol.passthrough import ANTHROPIC, Limits, Passthrough, build
from proxy.protocol.response import map_usage
from proxy.runtime import tracing
from proxy.upstream.client import UpstreamResponse
from proxy.upstream.exchange import Attempt, Retryable, attempt_once, upstream_message
from proxy.upstream.tokens import TokenCounter
from proxy.upstream.workers import Worker

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Endpoints

# config `endpoints` key of each family (messages_count follows messages)
SWITCHES = {"chat": "chat_completions", "completions": "completions", "embeddings": "embeddings",
            "messages": "messages", "messages_count": "messages"}


def policy_for(app: web.Application) -> ImagePolicy:
    """The app's image-URL policy (built once by build_app; built here from config otherwise)."""
    policy = app.get(state.IMAGE_POLICY)
    if policy is None:
        policy = ImagePolicy(app[state.CONFIG].images)
    return policy


def limits_of(section: Endpoints) -> Limits:
    """config.endpoints' bounds of a pass-through request (build_app keeps them on the app)."""
    return Limits(section.max_choices, section.max_batch_inputs, section.max_top_logprobs,
                  frozenset(section.allowed_extensions))


def limits_for(app: web.Application) -> Limits:
    limits = app.get(state.PASSTHROUGH_LIMITS)
    return limits if limits is not None else limits_of(app[state.CONFIG].endpoints)


async def passthrough_translate(app: web.Application, ctx: state.RequestContext, body: dict) -> Passthrough:
    family = ctx.unit.family  # a switched-off endpoint never gets here (middlewares.Phases answers its 404)
    pool = app.get(state.POOL)
    t = build(family, body, pool.serves if pool is not None else None, limits_for(app))
    if t.notices:
        ctx.notices.extend(t.notices)
    if family == "chat":
        await check_images(policy_for(app), t.body)  # the model server fetches image_url parts
    elif family in ANTHROPIC and t.media:
        await check_images(policy_for(app), t.chat)  # URL image sources, as image_url parts in the view
    return t


def _dialect_error(family: str, message: str, status: int) -> bytes:
    """A failure after the headers, as an event in the endpoint's own error shape."""
    if family in ANTHROPIC:
        kind = anthropic_type(status)
        error = orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
        return b"event: error\ndata: " + error + b"\n\n"
    code = "upstream_timeout" if status == 504 else "upstream_error"
    return b"data: " + orjson.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                              "code": code}}) + b"\n\ndata: [DONE]\n\n"


def _not_served(worker: Worker, t: Passthrough, status: int, body: bytes) -> Retryable | None:
    """A 404/405 without an error message of the server's own: the worker has no such path."""
    if status not in (404, 405) or upstream_message(body)[0] is not None:
        return None
    final = APIError(404, f"The model server '{worker.name}' does not serve {t.path}.", code="endpoint_not_served")
    return Retryable(worker, f"no {t.path}", final)


async def passthrough_handler(request: web.Request) -> web.StreamResponse:
    ctx = request[state.CONTEXT]
    t = ctx.to_answer()
    assert isinstance(t, Passthrough)  # the translate phase ran: a pass-through unit's is a Passthrough

    def attempt(one: Attempt, sent: Passthrough) -> Any:
        # `sent`: the cap as vLLM takes it on these APIs, lowered to the room the prompt leaves, not
        # refused (Claude Code asks 32,000 whatever the model's window); a prompt that does not fit
        # at all is still refused.
        return _attempt(request, ctx, one, sent)

    # A batch's prompts each have the window to themselves (the bound is of all of them): vLLM
    # judges each one.
    return await failover(request, ctx, t, attempt, check="max_tokens" in t.chat and t.prompts == 1)


async def _attempt(request: web.Request, ctx: state.RequestContext, attempt: Attempt,
                   t: Passthrough) -> web.StreamResponse:
    worker = attempt.worker
    app = request.app

    async def as_json(body: bytes) -> web.StreamResponse:
        return await _json_answer(app, attempt, t, body)

    async def as_stream(upstream: UpstreamResponse, first: bytes, deadline: float) -> web.StreamResponse:
        return await _stream(request, ctx, attempt, upstream, t, first, deadline)

    def send(headers: Any = None) -> Any:
        return attempt_once(app[state.UPSTREAMS], app[state.POOL], attempt, worker.endpoint(t.path),
                            orjson.dumps(t.body), stream=t.stream, answer_json=as_json, answer_stream=as_stream,
                            refine=lambda status, body: _not_served(worker, t, status, body), headers=headers)

    traces = tracing.ACTIVE
    if traces is not None:  # its span, its traceparent to the worker (off: nothing but this test)
        return await tracing.traced_attempt(traces, attempt, worker.endpoint(t.path), send)
    return await send()


async def _json_answer(app: web.Application, attempt: Attempt, t: Passthrough, body: bytes) -> web.Response:
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise Retryable(attempt.worker, "garbage body", APIError(502, "The model server sent an unreadable answer.",
                                                                  code="upstream_error")) from None
    if not isinstance(answer, dict) or ("error" in answer and answer.get("type") != "message"):
        message, _ = upstream_message(body)
        raise APIError(502, message or "The model server failed.", code="upstream_error")
    usage = json_usage(t.family, answer)
    budget = output_budget(t)
    if t.family == "embeddings" or _readable(usage):
        attempt.end("completed", usage, 0, budget)
    else:  # as /v1/responses counts an answer whose usage it cannot read: the worker's tokenizer
        await _count_usage(app, attempt, t, answer, budget)
    return web.Response(body=body, content_type="application/json")  # the bytes as they came


def _readable(usage: dict | None) -> bool:
    return usage is not None and as_count(usage.get("input_tokens")) is not None \
        and as_count(usage.get("output_tokens")) is not None


async def _count_usage(app: web.Application, attempt: Attempt, t: Passthrough, answer: dict,
                       budget: int | None) -> None:
    """The prompt and what the answers wrote, counted by the worker that served them; as
    counted (one token per answer that wrote any) when it cannot say."""
    text, written = json_output(t.family, answer)
    counter = TokenCounter(app[state.SESSION])
    prompt = await counter.prompt(t, attempt.worker)
    output = await counter.text(attempt.worker, t.upstream_model, text) if text and prompt is not None else 0
    if prompt is None or output is None:
        attempt.end("completed", None, written, budget, count_failed=prompt is None)
        return
    attempt.end("completed", map_usage({"prompt_tokens": prompt, "completion_tokens": output}), written, budget)


async def _stream(request: web.Request, ctx: state.RequestContext, attempt: Attempt, upstream: Any, t: Passthrough,
                  first: bytes, deadline: float) -> web.StreamResponse:
    """Everything but the stream's end written (it is ctx.tail: the envelope writes it once the
    answer is billed); the attempt's report made."""
    worker = attempt.worker
    cap = t.output_cap
    scanner = SSEScanner(t.family, t.usage_added, cap)
    response = EventStreamResponse(status=200, headers=SSE_HEADERS)
    dog = ReadWatchdog(worker.timeouts.idle, deadline, scanner)
    failure: tuple[str, str] | None = None
    ended: str | None
    try:
        await response.prepare(request)
        try:
            pending = scanner.feed(first)
        except ValueError:
            pending, ended = b"", TOO_LARGE
        else:
            pending, ended = await relay(upstream.read, response.write, scanner.feed, scanner, dog, pending,
                                         partial(request.app[state.POOL].record_failure, worker,
                                                 "disconnected mid-stream"))
        if ended == EOF:
            pending += scanner.flush()
        if scanner.capped:
            failure = ("The model server sent more output than max_tokens allows.", "upstream_error")
        elif ended == TIMEOUT:
            failure = (dog.message(worker.timeouts.total), "upstream_timeout")
            dog.since = None
        elif ended == DISCONNECTED:
            failure = ("The connection to the model server was lost mid-stream.", "upstream_disconnected")
        elif ended == TOO_LARGE:
            failure = ("The model server sent an event larger than the proxy accepts.", "upstream_error")
        elif not scanner.completed and not scanner.finished:
            failure = ("The model server ended the stream before it was complete.", "upstream_error")
    except BaseException:  # raised or cancelled (the client left): the answer as it stands
        attempt.end("completed" if scanner.completed else "cancelled", scanner.usage, scanner.counted, output_budget(t),
                    capped=scanner.capped)
        raise
    finally:
        dog.stop()
    attempt.end("completed" if failure is None else "failed", scanner.usage, scanner.counted, output_budget(t),
                capped=scanner.capped, error=failure[1] if failure is not None else None)
    if failure is not None:  # the dialect's own error event: it shows no bill, so it is known now
        pending += _dialect_error(t.family, failure[0], 502 if failure[1] != "upstream_timeout" else 504)
    ctx.tail = state.Tail(response, pending, scanner.completed)
    return response
