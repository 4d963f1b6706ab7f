"""The small endpoints: model list, input-token count, the probes (liveness, readiness)."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.http.forwarder import POOL, SESSION
from proxy.state import READINESS
from proxy.upstream.routing import choose, parse_provider, request_parameters
from proxy.upstream.tokens import TokenCountError, count_tokens
from proxy.upstream.workers import Worker

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
    ctx = request[state.CONTEXT]  # the prepare phase read and translated the body
    t = ctx.translation
    assert t is not None  # INPUT_TOKENS declares the translate phase
    body = ctx.body or {}
    prefs = parse_provider(body.get("provider"))
    pool = request.app[POOL]
    tried: list[Worker] = []
    last: TokenCountError | None = None
    for _ in range(request.app[state.CONFIG].routing.max_attempts):
        try:
            worker = choose(pool, t.upstream_model, exclude=tried, prefs=prefs,
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


_NO_STORE = {"Cache-Control": "no-store"}
_LIVE = orjson.dumps({"status": "ok"})


async def livez_handler(request: web.Request) -> web.Response:
    """Liveness (also /healthz): the process answers. No dependency, so a model server or
    ledger outage never gets the proxy restarted, and nothing about the workers is told."""
    return web.Response(body=_LIVE, content_type="application/json", headers=_NO_STORE)


async def readyz_handler(request: web.Request) -> web.Response:
    """Readiness: 200 {"status": "ready"} while some worker takes traffic and the ledger
    answers; else 503 {"status": "not_ready", "reason": "no_worker" | "ledger"} (with the ledger's
"cause": "unreachable", "auth_failed", "schema_missing", ...). No worker
    names, addresses or errors: those are the operator's (/metrics, the log)."""
    ready, reason, cause = await request.app[READINESS].verdict(request.app)
    body = {"status": "ready"} if ready else {"status": "not_ready", "reason": reason}
    if cause is not None:
        body["cause"] = cause  # a word ("auth_failed", "schema_missing"), never the database's message
    return web.Response(status=200 if ready else 503, body=orjson.dumps(body), content_type="application/json",
                        headers=_NO_STORE)


healthz_handler = livez_handler


__all__ = ["models_handler", "input_tokens_handler", "livez_handler", "healthz_handler", "readyz_handler"]
