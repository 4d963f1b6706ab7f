"""OpenTelemetry traces: off by default, on with `tracing.endpoint` (an OTLP/HTTP collector).

On, each request is a SERVER span (named by its route) whose parent is the client's W3C
`traceparent` when it sent one; its phases are child spans (auth, limits, prepare, balance...:
nested as the chain runs, so each one's own time is its span less its child's), and each
upstream attempt a CLIENT span under the phase that made it (failover attempts are siblings),
with a `first_byte` event, whose context goes to the worker as `traceparent` (vLLM reads it with
`--otlp-traces-endpoint`). The request's span carries the GenAI semantic conventions
(`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.response.model`,
`gen_ai.usage.input_tokens` / `output_tokens`, `gen_ai.response.finish_reasons`), the key id
(never its secret), the status and the outcome; prompt text only with `tracing.record_prompts`.
Spans are batched and exported off the request path (the SDK's BatchSpanProcessor thread),
flushed at shutdown.

Off, nothing of this runs: no middleware, no wrapped phase, and one `ACTIVE is None` test per
upstream attempt (proxy/upstream/exchange.py). The provider is this module's, not the global
one, so a library's own tracing is neither captured nor changed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.logs import log
from proxy.state import CONTEXT, RequestContext

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Tracing

# The one tracer while tracing is on (set by tracing_context, cleared at shutdown); None: off.
ACTIVE: Traces | None = None

# The Responses API is a chat; the pass-through families say theirs (proxy.protocol.passthrough).
_OPERATION = {"": "chat", "chat": "chat", "completions": "text_completion", "embeddings": "embeddings",
              "messages": "chat"}
_FINISH = {"completed": "stop", "incomplete": "length", "failed": "error", "cancelled": "cancelled",
           "error": "error"}
_PROMPT_BYTES = 4096


class Traces:
    """The provider, its tracer and the W3C propagator of one process."""

    def __init__(self, section: Tracing) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": section.service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(section.sample_ratio)))
        exporter = OTLPSpanExporter(endpoint=section.endpoint, headers=dict(section.headers) or None, timeout=10)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=section.export_delay_ms))
        self.tracer = self.provider.get_tracer("responses-proxy")
        self.propagator = TraceContextTextMapPropagator()
        self.record_prompts = section.record_prompts
        self.server, self.client, self.internal = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL

    def shutdown(self) -> None:
        self.provider.shutdown()  # the last batch sent


def tracing_context(section: Tracing) -> Callable[[web.Application], AsyncIterator[None]]:
    """The cleanup context: the provider for the app's life, every span flushed at its end."""

    async def ctx(_app: web.Application) -> AsyncIterator[None]:
        global ACTIVE
        ACTIVE = Traces(section)
        log.info("tracing on", endpoint=section.endpoint, sample_ratio=section.sample_ratio)
        try:
            yield
        finally:
            traces, ACTIVE = ACTIVE, None
            traces.shutdown()

    return ctx


@web.middleware
async def request_span(request: web.Request, handler: Any) -> web.StreamResponse:
    """The request's SERVER span, outside the envelope (its access line and a stream's tail
    inside it); the client's traceparent, when valid, is its parent."""
    traces = ACTIVE
    if traces is None:
        return await handler(request)
    parent = traces.propagator.extract(request.headers)
    route = request.match_info.route.resource
    name = f"{request.method} {route.canonical if route is not None else 'unmatched'}"
    with traces.tracer.start_as_current_span(name, context=parent, kind=traces.server) as span:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            span.set_attribute("http.request.method", request.method)
            span.set_attribute("http.response.status_code", status)
            ctx = request.get(CONTEXT)
            if ctx is not None:
                _describe(span, ctx, traces)


def _describe(span: Any, ctx: RequestContext, traces: Traces) -> None:
    """The GenAI attributes and the key id of a request's span (never a secret)."""
    span.set_attribute("responses_proxy.request_id", ctx.request_id)
    if ctx.key is not None:
        span.set_attribute("responses_proxy.key_id", ctx.key.key_id)
    t = ctx.translation
    if t is None:
        return
    span.set_attribute("gen_ai.operation.name", _OPERATION.get(ctx.unit.family if ctx.unit else "", "chat"))
    span.set_attribute("gen_ai.request.model", str(t.model))
    upstream_model = getattr(t, "upstream_model", None)
    report = ctx.report
    if report is not None:
        if upstream_model:
            span.set_attribute("gen_ai.response.model", str(upstream_model))
        span.set_attribute("gen_ai.response.finish_reasons", [_FINISH.get(report.status, report.status)])
        if report.upstream:
            span.set_attribute("responses_proxy.worker", report.upstream)
    tokens = ctx.tokens()
    if tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", tokens.input)
        span.set_attribute("gen_ai.usage.output_tokens", tokens.output)
    if traces.record_prompts and ctx.body is not None:
        given = ctx.body.get("input", ctx.body.get("messages", ctx.body.get("prompt")))
        span.set_attribute("gen_ai.input.messages", orjson.dumps(given, default=str)[:_PROMPT_BYTES].decode(
            errors="ignore"))


def turn_span(envelope: Any) -> Any:
    """The envelope as a turn runs it (a WebSocket message, a compaction's summary:
    proxy.http.turn): each turn an INTERNAL span under its socket's (the handshake request's)
    span, with the GenAI attributes of its answer (built only when tracing is on)."""

    async def traced(request: web.Request, handler: Any) -> web.StreamResponse:
        traces = ACTIVE
        if traces is None:
            return await envelope(request, handler)
        with traces.tracer.start_as_current_span("turn", kind=traces.internal) as span:
            response = await envelope(request, handler)
            span.set_attribute("http.response.status_code", response.status)
            ctx = request.get(CONTEXT)
            if ctx is not None:
                span.set_attribute("responses_proxy.transport", ctx.transport)
                _describe(span, ctx, traces)
            return response

    return traced


def traced_phase(name: str, step: Any) -> Any:
    """A phase of the chain in a span of its own (built only when tracing is on)."""

    async def phase(request: web.Request, ctx: RequestContext, call_next: Any) -> web.StreamResponse:
        traces = ACTIVE
        if traces is None:
            return await step(request, ctx, call_next=call_next)
        with traces.tracer.start_as_current_span(name):
            return await step(request, ctx, call_next=call_next)

    phase.__name__ = getattr(step, "__name__", name)
    return phase


def traced_next(name: str, run: Any) -> Any:
    """A chain's remainder (the body phase and what follows) in a span of its own."""

    async def step(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        traces = ACTIVE
        if traces is None:
            return await run(request, ctx)
        with traces.tracer.start_as_current_span(name):
            return await run(request, ctx)

    return step


async def traced_attempt(traces: Traces, attempt: Any, url: str, send: Callable[[CIMultiDict], Any]) -> Any:
    """One upstream attempt in a CLIENT span (a failover's attempts are siblings under the same
    phase): `send(headers)` makes it with the worker's headers and this span's `traceparent`.
    Its time to first byte and its end go on the span."""
    from opentelemetry import trace

    worker = attempt.worker
    span = traces.tracer.start_span("upstream attempt", kind=traces.client, attributes={
        "responses_proxy.worker": worker.name, "url.full": url})
    with trace.use_span(span, end_on_exit=True, record_exception=False):
        headers = CIMultiDict(worker.chat_headers)
        traces.propagator.inject(headers)  # the current context: this span
        try:
            return await send(headers)
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__name__)
            raise
        finally:
            if attempt.ttfb_ms is not None:
                span.set_attribute("responses_proxy.ttfb_ms", round(attempt.ttfb_ms, 2))
                span.add_event("first_byte", {"ttfb_ms": round(attempt.ttfb_ms, 2)})
