"""The forwarding handler: the only place that talks to the upstream.

It takes the one Translation the prepare phase made (proxy.http.request), picks a worker,
sends the chat request over the app's pooled upstream client (proxy.upstream.client), and
feeds the upstream bytes through the sans-I/O StreamRewriter, writing each Responses event as
soon as its chunk arrives.
Failover happens only before the first byte reaches the client; after that, every
problem becomes a response.failed event with retry hints.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.http.event_stream import (
    SSE_HEADERS as _SSE_HEADERS,
    EventStreamResponse as _EventStream,  # noqa: F401 (proxy.http.passthrough)
    open_event_stream,
)
from proxy.http.units import RESPONSES
from proxy.http.upstream_open import _Retryable, _upstream_message, open_upstream
from proxy.protocol.dialects import chat_for
from proxy.protocol.response import ResponseContext, client_usage, map_usage
from proxy.protocol.rewriter import StreamRewriter, completion_response
from proxy.protocol.seal import binding
from proxy.protocol.translate import Translation
from proxy.runtime.logs import log
from proxy.state import POOL, RESPONSE_SETTINGS, SEALER, SESSION, RequestContext
from proxy.upstream.affinity import request_key
from proxy.upstream.client import BadResponse, Disconnected, UpstreamResponse
from proxy.upstream.routing import (
    TokenCountError,
    check_context_window,
    choose,
    count_tokens,
    parse_provider,
    request_parameters,
    tokenize,
)
from proxy.upstream.workers import Worker

STREAM_END_GRACE_S = 1.0  # after [DONE], how long the last chunk of a stream may take to keep its connection




def _response_context(app: web.Application, ctx: RequestContext, t: Translation) -> ResponseContext:
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


def _record_usage(out: state.Outcome, usage: dict | None, counted: int, cap: int | None,
                  capped: bool = False, shown: dict | None = None) -> None:
    """The usage as reported (checked by the balance middleware before billing, which then
    puts the billed figures here) and the output deltas counted; the figures kept here for
    the access line and the metrics when nothing is billed are the same checks, short."""
    out.counted_output = counted
    out.output_capped = capped
    if usage:
        out.usage_reported = True
        out.reported_usage = usage
        if shown is None:  # the caller may pass what its Response shows: the same figures
            shown = client_usage(usage, cap)
        out.input_tokens = shown["input_tokens"]
        out.cached_tokens = shown["input_tokens_details"]["cached_tokens"]
        out.output_tokens = max(shown["output_tokens"], counted)
        out.reasoning_tokens = shown["output_tokens_details"]["reasoning_tokens"]
    else:
        out.output_tokens = counted


def _billed_usage(out: state.Outcome) -> dict:
    """The outcome's figures (what the balance billed, else what was recorded) as a chat usage,
    for the response.failed the proxy writes itself."""
    return {"prompt_tokens": out.input_tokens, "completion_tokens": out.output_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": out.reasoning_tokens}}


async def _settle_now(ctx: RequestContext) -> None:
    """The balance phase's settlement, before the last bytes go out (ctx.settle)."""
    settle = ctx.settle
    if settle is not None:
        await settle()
    release = ctx.release  # the limits' slot (a shared backend), given back as early
    if release is not None:
        await release()


async def forward(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    t = ctx.translation
    assert t is not None  # the translate phase ran: this handler's unit has it
    body = ctx.body or {}
    prefs = parse_provider(body.get("provider"))
    params = request_parameters(t.chat)
    app = request.app
    pool = app[POOL]
    routing = app[state.CONFIG].routing
    affinity = request_key(t, routing.affinity)  # prompt-cache affinity (proxy.upstream.affinity)
    out = ctx.started_outcome()
    rctx = _response_context(app, ctx, t)
    attempts = 1 if prefs is not None and prefs.single_attempt else routing.max_attempts
    tried: list[Worker] = []
    last: _Retryable | None = None
    sent = t  # what goes upstream: the context check may lower its max_tokens (a new Translation)
    for _ in range(max(attempts, 1)):
        try:
            worker = choose(pool, t.upstream_model, exclude=tried, prefs=prefs, params=params, affinity=affinity)
        except APIError:
            if last is not None:  # every eligible worker failed before the first byte
                raise last.final from None
            raise
        if last is not None:  # logged here, once there is a worker to fail over to
            pool.note_failover(last.worker, str(last))
            log.info("failover", worker=last.worker.name, to=worker.name, reason=str(last),
                     request_id=ctx.request_id)
        worker.in_flight += 1  # taken before any await: capacity is never over-committed
        try:
            if not tried and routing.context_check:
                _, sent = await check_context_window(app[SESSION], worker, t, body.get("max_output_tokens"),
                                                     bytes_per_token_floor=routing.bytes_per_token_floor)
            return await _forward(request, ctx, worker, sent, rctx, out)
        except _Retryable as exc:
            tried.append(worker)
            last = exc
        finally:
            worker.in_flight -= 1
    assert last is not None
    raise last.final


async def _forward(request: web.Request, request_ctx: RequestContext, worker: Worker, t: Translation,
                   ctx: ResponseContext, out: state.Outcome) -> web.StreamResponse:
    pool = request.app[POOL]
    timeouts = worker.timeouts
    out.upstream = worker.name
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    deadline = loop.time() + timeouts.total
    payload = orjson.dumps(chat_for(t.chat, worker.dialect, worker.thinking_switch))
    upstream: UpstreamResponse | None = None
    try:
        upstream, first = await open_upstream(request.app, worker, worker.chat_url, payload, stream=t.stream)
        out.ttfb_ms = (time.perf_counter() - started) * 1000
        if not t.stream:
            pool.record_success(worker, out.ttfb_ms / 1000)
            answer = _json_answer(worker, ctx, first, out)
            if not out.usage_reported:
                await _count_usage(request.app[SESSION], worker, t, ctx, answer, out)
            return web.Response(body=orjson.dumps(answer), content_type="application/json")
        _check_stream_start(pool, worker, upstream, first)
        pool.record_success(worker, out.ttfb_ms / 1000)
        return await _stream_answer(request, request_ctx, upstream, ctx, first, out, worker=worker,
                                    deadline=deadline)
    finally:
        if upstream is not None:
            _let_go(upstream, t, out)


def _check_stream_start(pool: Any, worker: Worker, upstream: UpstreamResponse, first: bytes) -> None:
    """Raise _Retryable when the first read of a stream is not the start of an event stream."""
    if not first:
        pool.record_failure(worker, "closed before the first byte")
        raise _Retryable(worker, "empty_stream",
                         APIError(502, "The model server closed the stream before answering.",
                                  code="upstream_error"))
    if not is_event_stream(upstream.content_type, first):
        # An HTML page or JSON where events belong (a proxy's error page, a misrouted
        # request): nothing reached the client yet, so another worker may take it.
        pool.record_failure(worker, "not an event stream")
        raise _Retryable(worker, "not_event_stream",
                         APIError(502, "The model server answered the stream with something other than "
                                       "an event stream.", code="upstream_error"))


def _let_go(upstream: UpstreamResponse, t: Any, out: state.Outcome) -> None:
    """Release the upstream connection for reuse, or close it.

    An unfinished generation is aborted upstream by closing its connection (vLLM frees the
    GPU when the connection drops), never left running for a pooled reuse."""
    if out.output_capped:
        upstream.close()  # it ignored max_tokens: whatever it is still sending is not wanted
    elif upstream.at_eof():
        upstream.release()
    elif t.stream and out.status in ("completed", "incomplete"):
        upstream.release_when_complete(STREAM_END_GRACE_S)  # only the stream's framing is left
    else:
        upstream.close()


_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")


def is_event_stream(content_type: bytes | None, first: bytes) -> bool:
    """Whether an answer can be an event stream: its Content-Type (when it says one) is
    text/event-stream and its first line starts like an SSE field (a short first read may
    hold only the start of one)."""
    if content_type is not None and not content_type.strip().lower().startswith(b"text/event-stream"):
        return False
    head = first.lstrip(b"\r\n")[:6]
    return not head or any(head.startswith(f) or f.startswith(head) for f in _SSE_FIELDS)


def _json_answer(worker: Worker, ctx: ResponseContext, body: bytes, out: state.Outcome) -> dict:
    try:
        completion = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _Retryable(worker, "garbage body", APIError(502, "The model server sent an unreadable answer.",
                                                          code="upstream_error")) from None
    if not isinstance(completion, dict) or "error" in completion or completion.get("object") == "error":
        message, _ = _upstream_message(body)
        raise APIError(502, message or "The model server failed.", code="upstream_error")
    response, reported = completion_response(ctx, completion)
    out.status = response["status"]
    usage = completion.get("usage")
    # Without a usage report, what the client is shown was counted (one per item with text).
    _record_usage(out, reported if usage else None, 0 if usage else int(response["usage"]["output_tokens"]),
                  ctx.output_cap, shown=response["usage"])
    return response


def _output_text(response: dict) -> str:
    """Everything the model wrote in a Response: its text, reasoning and call arguments."""
    parts: list[str] = []
    for item in response.get("output") or ():
        kind = item.get("type")
        if kind == "message":
            parts.extend(c.get("text") or "" for c in item.get("content") or ())
        elif kind == "reasoning":
            parts.extend(c.get("text") or "" for c in item.get("summary") or ())
        elif kind == "function_call":
            parts.append(item.get("arguments") or "")
        elif kind == "custom_tool_call":
            parts.append(item.get("input") or "")
    return "".join(parts)


async def _count_usage(session: aiohttp.ClientSession, worker: Worker, t: Translation, ctx: ResponseContext,
                       response: dict, out: state.Outcome) -> None:
    """A non-stream answer without a usage report: the worker's tokenizer counts the prompt and
    the output, so the client, the access line, the metrics and the bill show what it really
    processed. Left as counted when the worker cannot say."""
    try:
        prompt = await count_tokens(session, worker, t.upstream_model, t.chat.get("messages") or [],
                                    t.chat.get("tools"))
    except TokenCountError:
        out.extra["no_token_count"] = True  # the balance does not ask again
        return
    text = _output_text(response)
    output = await _count_text(session, worker, t.upstream_model, text) if text else 0
    if output is None:
        out.extra["no_token_count"] = True
        return
    usage = map_usage({"prompt_tokens": prompt, "completion_tokens": output})
    response["usage"] = client_usage(usage, ctx.output_cap)
    _record_usage(out, usage, out.counted_output, ctx.output_cap)


async def _count_text(session: aiohttp.ClientSession, worker: Worker, model: str, text: str) -> int | None:
    """The tokens of a plain text as the worker's tokenizer counts them (no template, no special
    tokens); None when it cannot say."""
    try:
        count = await tokenize(session, worker, {"model": model, "prompt": text, "add_special_tokens": False})
    except TokenCountError:
        return None
    return count if count >= 0 else None


# A first read this big holds many events (a server that coalesces its chunks, or a client
# that connected late): its first two events (vLLM: the role, then the first text) are
# rewritten and written on their own, so the first delta does not wait for all the others.
EARLY_WRITE_BYTES = 2048


def _early_cut(first: bytes) -> int:
    """Where to split a big first read: after its second event; 0: do not split."""
    if len(first) < EARLY_WRITE_BYTES:
        return 0
    end = first.find(b"\n\n", first.find(b"\n\n") + 2)
    return end + 2 if 0 < end < len(first) - 2 else 0


class _ReadWatchdog:
    """The idle and total timeouts of each upstream read, as one lazy timer: an asyncio.timeout
    per read costs more than rewriting the chunk. A read only stamps its start (`since`); the
    timer, when due, re-arms itself at the stamp of the read in progress (if any) and cancels
    the task only once a read has lasted `idle` or runs past `deadline`. Same semantics as
    timeout_at(min(start + idle, deadline)) around each read; writes to the client are not timed."""

    __slots__ = ("loop", "task", "cancelling", "idle", "deadline", "rewriter", "since", "fired", "timer")

    def __init__(self, idle: float, deadline: float, rewriter: StreamRewriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.loop = asyncio.get_running_loop()
        self.task = task
        self.cancelling = task.cancelling()
        self.idle = idle
        self.deadline = deadline
        self.rewriter = rewriter
        self.since: float | None = None  # start of the read in progress, None between reads
        self.fired = False
        self.timer: asyncio.TimerHandle | None = None

    def start_read(self) -> None:
        self.since = now = self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_at(min(now + self.idle, self.deadline), self._due)

    def _due(self) -> None:
        self.timer = None
        if self.since is None or self.rewriter.done:
            return  # not reading: the next read re-arms
        due = min(self.since + self.idle, self.deadline)
        if self.loop.time() >= due:
            self.fired = True
            self.task.cancel()
        else:
            self.timer = self.loop.call_at(due, self._due)

    def caused(self) -> bool:
        """Whether the CancelledError a read raised is this timer's (then it is consumed)."""
        if not self.fired or self.task.uncancel() > self.cancelling:
            return False  # not (only) ours: a real cancellation
        self.fired = False
        return True

    def message(self, total: float) -> str:
        if self.since is not None and self.since + self.idle < self.deadline:
            return f"The model server sent nothing for {self.idle:g}s (idle timeout)."
        return f"The model server did not finish within {total:g}s (total timeout)."

    def stop(self) -> None:
        # The timer re-arms itself through this object: cancelling it breaks the cycle that
        # would keep the stream's task, rewriter and response alive until the cyclic GC.
        self.since = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


async def _start_stream(request: web.Request, response: web.StreamResponse, rewriter: StreamRewriter,
                        first: bytes) -> bytes:
    """Send the headers (with the first events when the first read is big); -> what the next write sends."""
    await response.prepare(request)
    pending = rewriter.start()
    cut = _early_cut(first)
    if cut:
        # The first two events rewritten on their own (the rest is then rewritten in bulk,
        # a TextRun, proxy.protocol.deltas) and, unless this read holds the whole answer,
        # written on their own: the first delta does not wait for the rest of a big read.
        pending += rewriter.feed(first[:cut])
        first = first[cut:]
        if not first.endswith(b"data: [DONE]\n\n"):
            await response.write(pending)
            pending = b""
    return pending + rewriter.feed(first)


async def _stream_answer(request: web.Request, request_ctx: RequestContext, upstream: UpstreamResponse,
                         ctx: ResponseContext, first: bytes, out: state.Outcome, *, worker: Worker,
                         deadline: float) -> web.StreamResponse:
    response, encoder = open_event_stream(request)  # an SSE response, or a transport's turn
    rewriter = request_ctx.event_stream = StreamRewriter(ctx, encoder=encoder)
    recorded = False
    dog = _ReadWatchdog(worker.timeouts.idle, deadline, rewriter)
    failure: tuple[str, str, bool] | None = None  # (message, code, the proxy's own error code)
    try:
        pending = await _start_stream(request, response, rewriter, first)
        read = upstream.read
        write = response.write
        feed = rewriter.feed
        while not rewriter.done:
            if pending:  # one write per upstream read, none for a read that completed no event
                await write(pending)
                pending = b""
            dog.start_read()
            try:
                data = await read()
            except asyncio.CancelledError:
                if not dog.caused():
                    raise
                failure = (dog.message(worker.timeouts.total), "upstream_timeout", True)  # reads dog.since
                dog.since = None
                break
            except (Disconnected, BadResponse):
                dog.since = None
                request.app[POOL].record_failure(worker, "disconnected mid-stream")
                failure = ("The connection to the model server was lost mid-stream.", "upstream_disconnected", True)
                break
            dog.since = None
            if data:
                pending = feed(data)
                continue
            pending = rewriter.drain()
            if rewriter.done or rewriter.finish_reason is not None:
                pending += rewriter.finish()
            else:  # the worker ended the stream mid-way
                failure = ("upstream stream ended without a finish_reason", "server_error", False)
        out.status = rewriter.status if failure is None else "failed"
        if failure is not None and failure[2]:
            out.error = failure[1]
        _record_usage(out, rewriter.usage, rewriter.output_tokens_seen, ctx.output_cap, rewriter.capped)
        recorded = True
        await _settle_now(request_ctx)  # billed before the client can read the end of its answer
        if failure is not None:
            # The proxy ends the stream, billed first: its response.failed shows the bill (the
            # prompt and the output the worker reported so far, else as counted).
            pending += rewriter.fail(failure[0], code=failure[1], usage=_billed_usage(out))
        await response.write_eof(pending)  # the last events and the end of the body: one send
    except ConnectionResetError:
        # Clients such as Codex hang up as soon as they read the terminal event: an answer
        # that was whole is a success, not a disconnect.
        if not rewriter.done:
            raise
    finally:
        dog.stop()
        if not recorded:  # else the balance may have put the billed figures there since
            out.status = rewriter.status if rewriter.done else "cancelled"
            _record_usage(out, rewriter.usage, rewriter.output_tokens_seen, ctx.output_cap, rewriter.capped)
    return response


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
    if exc.code not in _STREAMED_REFUSALS or ctx.unit is not RESPONSES or not _event_stream_only(request, ctx):
        return None
    t = ctx.translation
    if t is None:
        return None
    rewriter = StreamRewriter(_response_context(request.app, ctx, t))
    body = rewriter.fail(exc.message, code=exc.code, retry_after_ms=None, should_retry=False, verbatim_code=True)
    response = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **exc.headers, "x-should-retry": "false"})
    await response.prepare(request)
    await response.write(body)
    await response.write_eof()
    ctx.started_outcome().status = "error"
    return response
