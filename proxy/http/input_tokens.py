"""POST /v1/responses/input_tokens after its phases: the translated request's prompt, counted by
the model server that would serve it (its tokenizer, its chat template)."""

from __future__ import annotations

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.state import POOL, SESSION
from proxy.upstream.routing import choose, route_plan
from proxy.upstream.tokens import TokenCountError, count_tokens
from proxy.upstream.workers import Worker


def _json(data) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


async def input_tokens_handler(request: web.Request) -> web.Response:
    """Count with the worker's own tokenizer (vLLM /tokenize, SGLang /v1/tokenize); bill nothing.

    The worker is chosen like a generation's (provider requirements, health), except that a
    worker at capacity may still count; a worker that cannot be reached is swapped for the next.
    """
    ctx = request[state.CONTEXT]  # the prepare phase read and translated the body
    t = ctx.translation
    assert t is not None  # INPUT_TOKENS declares the translate phase
    plan = route_plan(t, request.app[state.CONFIG].routing, provider=(ctx.body or {}).get("provider"), check=False)
    pool = request.app[POOL]
    tried: list[Worker] = []
    last: TokenCountError | None = None
    for _ in range(plan.attempts):
        try:
            worker = choose(pool, t.upstream_model, exclude=tried, prefs=plan.prefs, params=plan.params,
                            need_capacity=False)
        except APIError:
            if last is not None:
                break
            raise
        try:
            count = await count_tokens(request.app[SESSION], worker, t.upstream_model, t.chat["messages"],
                                       t.chat.get("tools"))
        except TokenCountError as exc:
            if not exc.connection:
                raise APIError(502, f"The model server could not count tokens: {exc}.",
                               code="upstream_error") from None
            pool.record_failure(worker, "tokenize unreachable")
            tried.append(worker)
            last = exc
            continue
        return _json({"object": "response.input_tokens", "input_tokens": count})
    raise APIError(502, f"The model server could not count tokens: {last}.", code="upstream_error")


__all__ = ["input_tokens_handler"]
