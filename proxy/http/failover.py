"""Failover, shared by both forwarding handlers: the request's route planned once, then a worker
taken (proxy.upstream.routing: its provider requirements, affinity, the context check on the
first), the answer tried, and on a failure before anything reached the
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
from proxy.logs import log
from proxy.protocol.answer_report import AnswerReport
from proxy.protocol.chat_usage import usage_in_tail
from proxy.protocol.upstream_request import UpstreamRequest
from proxy.state import CONFIG, POOL, SESSION, RequestContext
from proxy.upstream.exchange import AnswerLost, Attempt, Retryable
from proxy.upstream.routing import route_plan, take
from proxy.upstream.workers import Worker


def output_budget(t: UpstreamRequest) -> int | None:
    """The most output of all a request's answers: the cap per answer x the answers (a
    Translation's one, a pass-through's n, best_of or batch)."""
    cap = t.output_cap
    return cap * t.choices if cap is not None else None


# (the attempt, what to send) -> the answer; raises Retryable when another worker may take it
RunAttempt = Callable[[Attempt, Any], Awaitable[web.StreamResponse]]


async def failover(request: web.Request, ctx: RequestContext, t: UpstreamRequest, run: RunAttempt, *,
                   provider: Any = None, client_max: Any = None, check: bool = True) -> web.StreamResponse:
    """The answer of the first worker that gives one; ctx.report says how it ended. `provider` and
    `client_max` are the request's own (proxy.upstream.routing.route_plan); `check`: the context
    check may run on the first worker."""
    app = request.app
    pool = app[POOL]
    plan = route_plan(t, app[CONFIG].routing, provider=provider, client_max=client_max, check=check)
    tried: list[Worker] = []
    attempt: Attempt | None = None
    last: Retryable | None = None
    ended = "error"  # how the answer ended when no attempt says (it raised)
    try:
        for _ in range(plan.attempts):
            try:
                worker, sent = await take(app[SESSION], pool, t, plan, tried)
            except APIError:
                if last is not None:  # every eligible worker failed before the first byte
                    raise last.final from None
                raise
            if last is not None:  # logged here, once there is a worker to fail over to
                pool.note_failover(last.worker, str(last))
                log.info("failover", worker=last.worker.name, to=worker.name, reason=str(last),
                         request_id=ctx.request_id)
            try:
                tried.append(worker)
                attempt = Attempt(worker)
                return await run(attempt, sent)
            except Retryable as exc:
                last = exc
            except AnswerLost as lost:
                # The worker did the work: billed as far as it can be counted (an answer too
                # large to read ran to its cap, within the hold), never asked of another worker.
                if attempt is not None and attempt.report is None:
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
