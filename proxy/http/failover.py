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
from proxy.http.upstream_open import AnswerLost, Retryable
from proxy.logs import log
from proxy.protocol.chat_usage import usage_in_tail
from proxy.protocol.upstream_request import UpstreamRequest
from proxy.state import CONFIG, POOL, AnswerReport, RequestContext
from proxy.upstream.affinity import request_key
from proxy.upstream.routing import choose
from proxy.upstream.workers import Worker


def output_budget(t: UpstreamRequest) -> int | None:
    """The most output of all a request's answers: the cap per answer x the answers (a
    Translation's one, a pass-through's n, best_of or batch)."""
    cap = t.output_cap
    return cap * t.choices if cap is not None else None


# (the attempt, what to send) -> the answer; raises Retryable when another worker may take it
RunAttempt = Callable[[Attempt, Any], Awaitable[web.StreamResponse]]
# (the worker, the translation) -> (what was decided, what to send it: a copy with a lower cap, or
# the same), proxy.upstream.routing.check_context_window's; raises APIError for a prompt that cannot fit
ContextCheck = Callable[[Worker, Any], Awaitable[tuple[str, Any]]]


async def failover(request: web.Request, ctx: RequestContext, t: UpstreamRequest, run: RunAttempt, *,
                   check: ContextCheck | None = None, prefs: Any = None,
                   params: frozenset[str] = frozenset()) -> web.StreamResponse:
    """The answer of the first worker that gives one; ctx.report says how it ended."""
    app = request.app
    pool = app[POOL]
    routing = app[CONFIG].routing
    affinity = request_key(t, routing.affinity)  # prompt-cache affinity (proxy.upstream.affinity)
    attempts = 1 if prefs is not None and prefs.single_attempt else routing.max_attempts
    tried: list[Worker] = []
    attempt: Attempt | None = None
    last: Retryable | None = None
    ended = "error"  # how the answer ended when no attempt says (it raised)
    try:
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
            sent = None
            try:
                sent = (await check(worker, t))[1] if check is not None and not tried and routing.context_check else t
                tried.append(worker)
                attempt = Attempt(worker)
                return await run(attempt, sent)
            except Retryable as exc:
                last = exc
            except AnswerLost as lost:
                # The worker did the work: billed as far as it can be counted (an answer too
                # large to read ran to its cap, within the hold), never asked of another worker.
                if attempt is not None and attempt.report is None and sent is not None:
                    budget = output_budget(sent)
                    # Its usage when its end could be read (vLLM writes it last), else its cap.
                    usage = usage_in_tail(lost.tail) if lost.tail else None
                    ran = (budget or 0) if lost.whole and usage is None else 0
                    attempt.end("failed", usage, ran, budget, error=lost.code)
                raise
            finally:
                worker.in_flight -= 1
        assert last is not None
        raise last.final
    except asyncio.CancelledError:
        ended = "cancelled"
        raise
    finally:
        # Written once, from the last attempt: its own report, else how it ended.
        ctx.report = AnswerReport(ended) if attempt is None else attempt.ended(ended)
