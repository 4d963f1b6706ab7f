"""The small endpoints: model list, input-token count, the proxy's own liveness."""

from __future__ import annotations

import time

import aiohttp
import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.forwarder import POOL, SESSION
from proxy.request import translation

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
    """Count with the worker's own tokenizer (vLLM /tokenize, SGLang /v1/tokenize); bill nothing."""
    t = await translation(request)
    worker = request.app[POOL].choose(t.upstream_model)
    body = {"model": t.upstream_model, "messages": t.chat["messages"]}
    if t.chat.get("tools"):
        body["tools"] = t.chat["tools"]
    path = "/v1/tokenize" if worker.dialect == "sglang" else "/tokenize"
    timeout = aiohttp.ClientTimeout(total=worker.timeouts.first_byte, connect=worker.timeouts.connect)
    try:
        async with request.app[SESSION].post(worker.url.rstrip("/") + path, data=orjson.dumps(body),
                                             headers={"Content-Type": "application/json", **worker.auth_headers()},
                                             timeout=timeout) as upstream:
            raw = await upstream.read()
            if upstream.status != 200:
                raise APIError(502, f"The model server could not count tokens ({upstream.status}).",
                               code="upstream_error")
            data = orjson.loads(raw)
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        raise APIError(502, "The model server could not count tokens.", code="upstream_error") from None
    count = data.get("count") if isinstance(data, dict) else None
    if not isinstance(count, int):
        raise APIError(502, "The model server gave no token count.", code="upstream_error")
    return _json({"object": "response.input_tokens", "input_tokens": count})


async def healthz_handler(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    healthy = [w.name for w in pool.workers if w.healthy]
    status = 200 if healthy else 503
    return web.Response(status=status, body=orjson.dumps({"status": "ok" if healthy else "degraded",
                                                          "workers": {w.name: w.healthy for w in pool.workers}}),
                        content_type="application/json")


__all__ = ["models_handler", "input_tokens_handler", "healthz_handler", "state"]
