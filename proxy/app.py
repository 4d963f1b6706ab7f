"""The application: the envelope and the phases (middlewares/), the routes, and the resources
(client session, embedded simulator, ledger) as cleanup contexts."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from middlewares import PHASES, Phases, build_phases
from proxy import state
from proxy.config.cross_checks import sealer_from_config
from proxy.config.load import Config, ConfigError
from proxy.errors import APIError
from proxy.http.anthropic_errors import dress
from proxy.http.compact import CompactSettings
from proxy.http.errors import ERROR_CODE, close_if_unread, error_response, ledger_unavailable
from proxy.http.parse_errors import HEAD_LIMITS, HeadLimits
from proxy.http.passthrough_handler import limits_of
from proxy.http.responses_handler import refusal_as_event
from proxy.http.routes import VARIANT_HANDLERS, add_routes, unit_for
from proxy.http.turn import TURN, refuse_other_answers
from proxy.http.websocket import SOCKETS, SocketAdmission
from proxy.ledger.base import LedgerUnavailable
from proxy.logs import access, log
from proxy.policy.netguard import ImagePolicy
from proxy.protocol.answer_report import NO_TOKENS
from proxy.protocol.ids import random_bits
from proxy.protocol.models import sampling_defaults
from proxy.protocol.passthrough import ANTHROPIC
from proxy.runtime import metrics
from proxy.runtime.alerts import alerts_context
from proxy.runtime.refusals import REFUSALS, Refusals, is_refusal
from proxy.runtime.reload import RELOADERS, ReloadCollector, Reloader, Reloaders, ReloadRefused
from proxy.runtime.tracing import request_span, tracing_context, turn_span
from proxy.state import (
    CONFIG,
    CONTEXT,
    IMAGE_POLICY,
    POOL,
    RESPONSE_SETTINGS,
    SAMPLING_DEFAULTS,
    SESSION,
    UPSTREAMS,
    RequestContext,
    Tail,
)
from proxy.upstream.client import UpstreamPool
from proxy.upstream.health import READINESS, Readiness, health_context
from proxy.upstream.workers import WorkerPool, parse_workers

LEDGER = state.LEDGER

# Request ids (and the response ids made from them, and the ledger's hold ids) need to be
# unique, not secret (proxy.protocol.ids). Time first (as in UUIDv7): the ledger's UNIQUE(request_id)
# index then grows at its right edge instead of dirtying a random leaf page per usage row,
# which the ledger's writer thread pays for on every settle (bench/results.md, "Design measurements").
def new_request_id() -> str:
    """"req_" + 24 hex digits: 12 of Unix milliseconds, 12 random."""
    return f"req_{time.time_ns() // 1_000_000:012x}{random_bits(48):012x}"


def _refusal(request: web.Request, ctx: RequestContext, response: web.StreamResponse) -> web.StreamResponse:
    """A refusal as its route's clients read one: Anthropic's envelope on its routes, and
    Connection: close when the body was not read (proxy.http.errors.close_if_unread)."""
    if ctx.unit.family in ANTHROPIC:
        response = dress(response)
    return close_if_unread(request, response)


def envelope(phases: Phases):
    """The outermost layer (the app's one aiohttp middleware): gives every request an id and its
    context, runs the phases, turns every failure into the OpenAI envelope (never a traceback
    or an HTML page), and writes one access-log line."""

    @web.middleware
    async def envelope_and_access_log(request: web.Request, handler) -> web.StreamResponse:
        started = time.perf_counter()
        turn = request.get(TURN)
        ctx = request[CONTEXT] = RequestContext(
            new_request_id(), request.method, request.path, endpoint=handler, started_at=started,
            transport=turn.transport if turn is not None else _carrier(request))
        ctx.unit = unit_for(request.method, request.path) if turn is None else turn.unit
        status = 500
        error_code: str | None = None
        ended: str | None = None  # how the answer ended, when the envelope decided it (else ctx.report's)
        try:
            response, ended = await _within_started(phases.chain(ctx.unit), request, ctx)
            error_code = response.get(ERROR_CODE)
            if error_code is not None:
                response = _refusal(request, ctx, response)
            status = response.status
            return response
        except (APIError, LedgerUnavailable) as caught:
            # A ledger that cannot be reached on the way (a hold, GET /v1/key, the admin API)
            # is its 503 with Retry-After, answered like any refusal.
            exc = caught if isinstance(caught, APIError) else ledger_unavailable(caught)
            status, error_code = exc.status, exc.code
            streamed = await refusal_as_event(request, ctx, exc)  # Codex reads a spent balance only as an event
            if streamed is not None:
                ended = "error"
                return streamed
            return _refusal(request, ctx, error_response(exc))
        except web.HTTPException as exc:  # aiohttp's own 404/405/413 for unknown routes and methods
            status = exc.status
            if exc.status < 400:
                raise
            message = {404: "Unknown endpoint.",
                       405: "Method not allowed on this endpoint."}.get(exc.status, exc.reason)
            if exc.status == 404:
                from proxy.admin import console_off_hint

                message += console_off_hint(request)
            refusal = APIError(exc.status, f"{message} ({request.method} {request.path})")
            error_code = refusal.code
            return _refusal(request, ctx, error_response(refusal))
        except (asyncio.CancelledError, ConnectionResetError) as gone:
            report = ctx.report
            # 499: the client went away before its answer was whole (after it, the answer stands).
            status = 200 if report is not None and report.status in ("completed", "incomplete", "failed") else 499
            if isinstance(gone, ConnectionResetError) and turn is None:
                # A write to a client that hung up. Raised on, aiohttp would log it as a 500
                # "Error handling request" with a traceback; an answer handed back is one it
                # finishes quietly (its write to the closed connection is ignored).
                return ctx.started if ctx.started is not None else web.Response(status=499)
            raise
        except Exception:
            log.exception("unhandled error", request_id=ctx.request_id)
            error_code = "internal_error"
            return error_response(APIError(500, "The proxy failed to handle this request.", code="internal_error"))
        finally:
            elapsed = time.perf_counter() - started
            settling = ctx.settling
            if settling is not None and not settling.done():
                # The client went away while the request was being billed: the settlement goes
                # on in a task of its own; the access line and the metrics wait for it, so they
                # carry the figures the ledger row has.
                settling.add_done_callback(lambda _: _log_access(request, ctx, status, error_code, elapsed, ended))
            else:
                _log_access(request, ctx, status, error_code, elapsed, ended)

    return envelope_and_access_log


def outcome_of(status: int) -> str:
    """The outcome of a request no answer reported on: refused or failed before any answer
    (4xx, 5xx) is "error", anything else answered is "completed" (README "Logs")."""
    return "error" if status >= 400 else "completed"


def _carrier(request: web.Request) -> str:
    """What carried a request that is no socket's turn (a turn says its own): "websocket" for a
    socket's handshake, "http" for the rest (a compaction's summary turn included: its request
    came over HTTP)."""
    return "websocket" if request.headers.get("Upgrade", "").lower() == "websocket" else "http"


def _log_access(request: web.Request, ctx: RequestContext, status: int, error_code: str | None,
                elapsed_s: float, ended: str | None) -> None:
    ctx.settling = None
    report = ctx.report
    if ended is None and report is not None:
        ended = report.status
    outcome = ended if ended is not None else outcome_of(status)
    metrics.observe(request, ctx, status, elapsed_s, outcome)
    translation = ctx.translation
    model = translation.model if translation is not None else None
    latency_ms = round(elapsed_s * 1000, 2)
    key_id = ctx.key.key_id if ctx.key is not None else None
    if error_code is None and report is not None:
        error_code = report.error
    carrier = ctx.transport  # the envelope's: the turn's, else _carrier
    if is_refusal(status):
        refusals = request.config_dict.get(REFUSALS)
        if refusals is not None:
            refusals.record(request.path, request_id=ctx.request_id, method=request.method, transport=carrier,
                            status=status, error_code=error_code, key_id=key_id, model=model, client=request.remote)
    if ended is None:
        access(request_id=ctx.request_id, method=request.method, path=request.path, client=request.remote,
               transport=carrier, key_id=key_id, model=model, status=status, error_code=error_code,
               latency_ms=latency_ms, outcome=outcome)
        return
    tokens = ctx.tokens() or NO_TOKENS
    bill = ctx.bill
    ttfb = report.ttfb_ms if report is not None else None
    access(request_id=ctx.request_id, method=request.method, path=request.path, client=request.remote,
           transport=carrier, key_id=key_id, model=model, status=status, error_code=error_code,
           latency_ms=latency_ms, upstream=report.upstream if report is not None else None, outcome=ended,
           input_tokens=tokens.input, cached_tokens=tokens.cached, output_tokens=tokens.output,
           cost_micros=bill.cost_micros if bill is not None else None,
           ttfb_ms=round(ttfb, 2) if ttfb is not None else None)


async def _within_started(run, request: web.Request, ctx: RequestContext) -> tuple[web.StreamResponse, str | None]:
    """The phases, then the end of a streamed answer (ctx.tail: billed and its slot given back by
    now) -> (the response, "failed" when the envelope ended it); an exception after the answer
    started is ended by _after_start."""
    try:
        response = await run(request, ctx)
    except ConnectionResetError:
        raise
    except Exception as exc:
        started = ctx.started
        if started is None:
            writer = request.writer
            if writer is not None and writer.output_size == 0:
                # A prepare() that failed in a hook left its framing (chunked) on the writer:
                # the error envelope that follows brings its own Content-Length.
                writer.chunked = False  # type: ignore[attr-defined]  # aiohttp's StreamWriter has it
                writer.length = None
            raise
        return await _after_start(request, ctx, started, exc, ctx.tail)
    tail = ctx.tail
    if tail is not None:
        try:
            await tail.send(ctx.tokens() or NO_TOKENS)
        except ConnectionResetError:
            raise
        except Exception as exc:
            return await _after_start(request, ctx, response, exc, None)
    return response, None


async def _after_start(request: web.Request, ctx: RequestContext, response: web.StreamResponse,
                       exc: Exception, tail: Tail | None) -> tuple[web.StreamResponse, str | None]:
    """An error after the status line and headers went out. A second response written now
    would land inside the body (or behind it, as the next answer on a keep-alive connection),
    so the only honest endings are: the answer as it stands when it was whole, a terminal
    response.failed event when the event stream can still take one, else a cut connection
    (no terminating chunk: the client sees a truncated body, never a valid-looking end)."""
    log.error("error after the answer started", request_id=ctx.request_id,
              error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    # aiohttp has no public "the body was ended" flag (prepared stays True after write_eof): the
    # attribute its StreamResponse sets is read, as TurnStream sets it (tests/http/test_stream_integrity.py
    # raise_after pins that a whole answer stands).
    if getattr(response, "_eof_sent", False):
        return response, None  # whole before the error: it stands
    if tail is not None:  # the handler finished its answer before the error: its end is written, it stands
        try:
            await tail.send(ctx.tokens() or NO_TOKENS)
        except Exception:
            pass  # the transport is cut below
        else:
            return response, None
    rewriter = ctx.event_stream
    if rewriter is not None and not rewriter.done:
        try:
            await response.write_eof(rewriter.fail("The proxy failed while streaming this response.",
                                                   code="internal_error"))
        except Exception:
            pass  # the transport is cut below
        else:
            return response, "failed"
    transport = request.transport
    if transport is not None:
        transport.abort()
    return response, None


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    ctx = request.get(CONTEXT)
    if ctx is not None:
        response.headers["x-request-id"] = ctx.request_id
        ctx.started = response  # the last hook: the headers go out next


def _client_session(app: web.Application):
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        # One pooled session, keep-alive to every worker; per-request timeouts are the workers' own.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=300)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            app[SESSION] = session
            app[UPSTREAMS] = upstreams = UpstreamPool()  # the chat POSTs: proxy.upstream.client says why
            try:
                yield
            finally:
                await upstreams.close()
    return ctx


def _embed(worker: Any, embedded: tuple[str, tuple[str, ...], int]) -> None:
    url, models, max_len = embedded
    worker.url = url
    worker.models = tuple(worker.models or models)
    worker.max_model_len = dict.fromkeys(worker.models, max_len)


def _workers_reloader(pool: WorkerPool) -> Reloader:
    """A reload's `workers` (proxy/runtime/reload.py): the new list built, then swapped in."""

    def prepare(new: Config) -> Callable[[], None]:
        fresh = parse_workers(new.workers)
        for worker in fresh:
            if worker.url == "embedded":
                if pool.embedded is None:
                    raise ReloadRefused("workers[].url: embedded starts with the process: restart for it",
                                        "workers")
                _embed(worker, pool.embedded)

        def commit() -> None:
            added, removed = pool.reconfigure(fresh)
            if added or removed:
                log.warning("workers reloaded", added=added or None, removed=removed or None)
        return commit

    return prepare


async def _embedded_simulator(app: web.Application) -> AsyncIterator[None]:
    """Workers whose url is `embedded` are served by the built-in simulator, in-process."""
    pool = app[POOL]
    embedded = [w for w in pool.workers if w.url == "embedded"]
    if not embedded:
        yield
        return
    from proxy.simulator.server import Simulator

    sim_cfg = app[state.CONFIG].simulator
    models = sorted({m for w in embedded for m in w.models} or {sim_cfg.model})
    simulator = Simulator(dialect=sim_cfg.dialect, models=tuple(models), max_model_len=sim_cfg.max_model_len,
                          host=sim_cfg.host, port=sim_cfg.port)
    await simulator.start()
    pool.embedded = (simulator.url, tuple(models), sim_cfg.max_model_len)  # what a reload's `embedded` means
    for worker in embedded:
        _embed(worker, pool.embedded)
    log.info("embedded simulator", url=simulator.url, models=models)
    try:
        yield
    finally:
        await simulator.stop()


async def _ledger(app: web.Application) -> AsyncIterator[None]:
    section = app[state.CONFIG].ledger
    if section.backend == "none":
        yield
        return
    from proxy.ledger import LedgerError, LedgerUnavailable, open_ledger
    from proxy.ledger.lease_journal import recover

    base = path.parent if (path := app[state.CONFIG].path) else Path.cwd()
    ledger = open_ledger(section, base_dir=base)
    await ledger.start()
    app[LEDGER] = ledger

    async def recover_journals() -> None:
        # Leased usage rows a process that died left on disk, committed before serving (a
        # sibling worker that dies later: at the next sweep).
        try:
            await recover(ledger.lease_journal_path, ledger)
        except (LedgerError, OSError) as exc:
            log.warning("lease journals not recovered yet (the next sweep retries)", error=str(exc))

    await recover_journals()
    try:
        await ledger.expire_holds()
    except LedgerUnavailable:  # a database that is down at start: 503s until it is back
        pass
    interval = section.expire_interval_s

    async def expire_forever() -> None:
        while True:
            await asyncio.sleep(interval)
            await recover_journals()
            try:
                await ledger.expire_holds()
            except LedgerUnavailable:
                continue  # logged by the ledger once per outage; the next round retries
            except Exception:  # keep the sweeper alive; the next round retries
                log.exception("hold expiry failed")

    sweeper = asyncio.create_task(expire_forever())
    try:
        yield
    finally:
        sweeper.cancel()
        await ledger.close()


def build_app(config: Config) -> web.Application:
    """Build the whole app; raises ConfigError for anything that cannot run."""
    server = config.server
    # handler_args reach every runner (cli, tests): the header limits (aiohttp refuses an
    # oversize request line or header line with a 400 before any middleware runs).
    app = web.Application(client_max_size=server.max_body_bytes + 1, handler_args={
        "max_line_size": server.max_line_size,
        "max_field_size": server.max_field_size,
        "max_headers": server.max_headers,
        # Request bodies are decoded by proxy/http/request.py alone (gzip, deflate, zstd, bounded by
        # max_body_bytes): aiohttp's own decoding would run first, so a gzip body was decoded
        # twice (400) and a zstd body refused outright without backports.zstd.
        "auto_decompress": False,
    })
    app[state.CONFIG] = config
    # The bounds on a whole head (bytes, time): applied by ProxyRunner's connections (parse_errors).
    app[HEAD_LIMITS] = HeadLimits(server.max_header_bytes, server.header_read_timeout_s)
    app[IMAGE_POLICY] = ImagePolicy(config.images)
    app[state.PASSTHROUGH_LIMITS] = limits_of(config.endpoints)
    app[POOL] = WorkerPool(parse_workers(config.workers), outlier=config.health.outlier)
    app[RESPONSE_SETTINGS] = config.responses
    app[SAMPLING_DEFAULTS] = sampling_defaults(config.responses.sampling_defaults)
    # Resources first: middleware factories may add their own contexts that need these.
    app.cleanup_ctx.append(_client_session(app))
    app.cleanup_ctx.append(_embedded_simulator)
    app.cleanup_ctx.append(health_context(SESSION, POOL, CONFIG))  # discovery + active checks, once urls are final
    app.cleanup_ctx.append(_ledger)
    # No webhook, nobody to tell: no task looking (and none in a benchmark's counts). Under --workers N
    # the first process alone looks, so a notice goes out once per replica, not once per process.
    if config.tracing.endpoint:  # off: no context, no middleware, no wrapped phase (proxy/runtime/tracing.py)
        app.cleanup_ctx.append(tracing_context(config.tracing))
    if config.alerts.webhooks and os.environ.get("RESPONSES_PROXY_WORKER", "0") == "0":
        app.cleanup_ctx.append(alerts_context(config.alerts, SESSION))  # after the ledger: it reads it
    sealer = sealer_from_config(config.reasoning_seal)
    if sealer is not None:
        app[state.SEALER] = sealer
    reloaders = app[RELOADERS] = Reloaders(config, check=build_app)  # what can change live: each part says
    reloaders.on("workers", _workers_reloader(app[POOL]))
    reloaders.on("model_groups", lambda new: lambda: None)  # read from the configuration at each check
    phases = app[PHASES] = build_phases(config, app, VARIANT_HANDLERS)
    app[state.ENVELOPE] = entry = envelope(phases)
    if config.tracing.endpoint:
        app.middlewares.append(request_span)  # outside the envelope: its access line and a stream's end inside
        app[state.ENVELOPE] = turn_span(entry)  # what a turn runs (proxy.http.turn): a span each
    app.middlewares.append(entry)
    # Before _add_request_id: a turn's foreign answer is refused while it is not started yet.
    app.on_response_prepare.append(refuse_other_answers)
    app.on_response_prepare.append(_add_request_id)
    app[SOCKETS] = SocketAdmission(config.websocket)
    app[state.COMPACT_SETTINGS] = CompactSettings.of(config)
    app[READINESS] = Readiness(app[POOL], LEDGER)
    add_routes(app)  # every API route, its handler and its unit of work: proxy.http.routes
    refusals = app[REFUSALS] = Refusals(metrics.multiprocess_dir())

    async def close_refusals(_app: web.Application) -> None:
        refusals.close()

    app.on_cleanup.append(close_refusals)
    from proxy.admin import install as install_admin

    install_admin(app, config.admin)
    metrics.install(app, app[POOL], config.metrics)
    if app.get(metrics.METRICS) is not None:
        app[metrics.METRICS].registry.register(ReloadCollector(reloaders))
    app.on_startup.append(_freeze_heap)
    return app


async def _freeze_heap(_app: web.Application) -> None:
    """Everything built to start (modules, config, the app, its resources) lives as long as
    the process: moved out of the cyclic GC's generations, so that a full collection walks
    what requests left behind, not the whole heap (the GC's own advice for forking servers)."""
    gc.collect()
    gc.freeze()


__all__ = ["build_app", "LEDGER", "ConfigError"]
