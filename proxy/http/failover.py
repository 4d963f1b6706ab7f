"""Failover, shared by both forwarding handlers: pick a worker (routing, affinity), run the
context check on the first, try the answer, and on a failure before anything reached the
client try another, up to routing.max_attempts. After the first byte there is no failover:
the handler ends the answer itself.

Whatever way the answer ends (returned, raised, cancelled), the failover writes the request's
AnswerReport (ctx.report) once, from the last attempt: the phases above read it, nothing writes
it again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from proxy.errors import APIError
from proxy.http.attempt import Attempt
from proxy.http.upstream_open import _Retryable
from proxy.runtime.logs import log
from proxy.state import CONFIG, POOL, AnswerReport, RequestContext
from proxy.upstream.affinity import request_key
from proxy.upstream.routing import choose
from proxy.upstream.workers import Worker

# (the attempt, what to send) -> the answer; raises _Retryable when another worker may take it
RunAttempt = Callable[[Attempt, Any], Awaitable[web.StreamResponse]]
# (the worker, the translation) -> what to send it (a copy with a lower cap, or the same); raises
# APIError for a prompt that cannot fit
ContextCheck = Callable[[Worker, Any], Awaitable[Any]]


async def failover(request: web.Request, ctx: RequestContext, t: Any, run: RunAttempt, *,
                   check: ContextCheck | None = None, prefs: Any = None,
                   params: frozenset[str] = frozenset()) -> web.StreamResponse:
    """The answer of the first worker that gives one; ctx.report says how it ended."""
    tried: list[Attempt] = []
    try:
        response = await _try_workers(request, ctx, t, run, tried, check, prefs, params)
    except asyncio.CancelledError:
        ctx.report = _ended(tried, "cancelled")
        raise
    except BaseException:
        ctx.report = _ended(tried, "error")
        raise
    ctx.report = _ended(tried, "completed")  # the attempt that answered made its report
    return response


def _ended(tried: list[Attempt], status: str) -> AnswerReport:
    return tried[-1].ended(status) if tried else AnswerReport(status)


async def _try_workers(request: web.Request, ctx: RequestContext, t: Any, run: RunAttempt, tried: list[Attempt],
                       check: ContextCheck | None, prefs: Any, params: frozenset[str]) -> web.StreamResponse:
    app = request.app
    pool = app[POOL]
    routing = app[CONFIG].routing
    affinity = request_key(t, routing.affinity)  # prompt-cache affinity (proxy.upstream.affinity)
    attempts = 1 if prefs is not None and prefs.single_attempt else routing.max_attempts
    last: _Retryable | None = None
    for _ in range(max(attempts, 1)):
        try:
            worker = choose(pool, t.upstream_model, exclude=[a.worker for a in tried], prefs=prefs, params=params,
                            affinity=affinity)
        except APIError:
            if last is not None:  # every eligible worker failed before the first byte
                raise last.final from None
            raise
        if last is not None:  # logged here, once there is a worker to fail over to
            pool.note_failover(last.worker, str(last))
            log.info("failover", worker=last.worker.name, to=worker.name, reason=str(last),
                     request_id=ctx.request_id)
        attempt = Attempt(worker)
        worker.in_flight += 1  # taken before any await: capacity is never over-committed
        try:
            sent = await check(worker, t) if check is not None and not tried and routing.context_check else t
            tried.append(attempt)
            return await run(attempt, sent)
        except _Retryable as exc:
            last = exc
        finally:
            worker.in_flight -= 1
    assert last is not None
    raise last.final
