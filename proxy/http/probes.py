"""The probes: GET /livez and /healthz (liveness: the process answers) and GET /readyz
(readiness: a worker takes traffic and the ledger answers; proxy.upstream.health decides)."""

from __future__ import annotations

import orjson
from aiohttp import web

from proxy.runtime.reload import RELOADERS
from proxy.upstream.health import READINESS

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
    reloaders = request.app.get(RELOADERS)
    headers = _NO_STORE
    if reloaders is not None:  # which configuration this process serves (proxy/runtime/reload.py)
        headers = {**_NO_STORE, "X-Config-Hash": reloaders.hash}
    return web.Response(status=200 if ready else 503, body=orjson.dumps(body), content_type="application/json",
                        headers=headers)


healthz_handler = livez_handler


__all__ = ["livez_handler", "healthz_handler", "readyz_handler"]
