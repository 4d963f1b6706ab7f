"""The small endpoints: model list, input-token count, the proxy's own liveness."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.forwarder import POOL, SESSION
from proxy.request import translation
from proxy.routing import TokenCountError, count_tokens, parse_provider, request_parameters

_STARTED = int(time.time())


def _json(data) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


async def models_handler(request: web.Request) -> web.Response:
    data = []
    for model, window in sorted(request.app[POOL].models().items()):
        entry = {"id": model, "object": "model", "created": _STARTED, "owned_by": "responses-proxy"}
        if window:
            entry["context_window"] = window
            entry["max_model_len"] = window
        data.append(entry)
    return _json({"object": "list", "data": data})


async def input_tokens_handler(request: web.Request) -> web.Response:
    """Count with the worker's own tokenizer (vLLM /tokenize, SGLang /v1/tokenize); bill nothing.

    The worker is chosen like a generation's (provider requirements, health), except that a
    worker at capacity may still count; a worker that cannot be reached is swapped for the next.
    """
    t = await translation(request)
    body = request.get(state.BODY) or {}
    prefs = parse_provider(body.get("provider"))
    pool = request.app[POOL]
    tried = []
    last: TokenCountError | None = None
    for _ in range(int(request.app[state.CONFIG].section("routing").get("max_attempts", 3))):
        try:
            worker = pool.choose(t.upstream_model, exclude=tried, prefs=prefs,
                                 params=request_parameters(t.chat), need_capacity=False)
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


async def healthz_handler(request: web.Request) -> web.Response:
    """Ready (200) while at least one worker takes requests; 503 when none does."""
    pool = request.app[POOL]
    workers = {
        w.name: {"healthy": w.healthy, "ejected": w.ejected, "available": w.available, "in_flight": w.in_flight,
                 "capacity": w.capacity, "dialect": w.dialect, "models": list(w.models),
                 "last_check_error": w.last_check_error}
        for w in pool.workers
    }
    ready = any(w.available for w in pool.workers)
    return web.Response(status=200 if ready else 503,
                        body=orjson.dumps({"status": "ok" if ready else "unavailable", "workers": workers}),
                        content_type="application/json")


__all__ = ["models_handler", "input_tokens_handler", "healthz_handler"]
