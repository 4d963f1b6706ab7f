"""The dashboard: its page and static files (everything it loads is served here, no CDN),
login / logout / session, and /api/overview, the one read the page draws from.

/api/overview?range=24h|7d|30d answers, for that window (hourly buckets for 24h, daily
otherwise), straight from the ledger and the worker pool:
  * totals: requests, tokens, cost over the window;
  * series: spend and tokens per bucket per key and per served model (what the workers serve,
    not the client's string: 4,000 aliases of one model are one series);
  * workers: health, in flight, capacity, time to first byte (EWMA), and the cached-token
    share of the input each one served in the window;
  * top_keys: the ten keys with the most spend in the window; recent_errors: the last
    twenty usage rows that ended failed or in error;
  * errors: what the Errors view lists, newest first (at most ERROR_ROWS): the refusals of
    the window (every request answered 4xx but 499, or 5xx, from the access records:
    proxy.runtime.refusals, which says where they are kept) merged with those usage rows (a
    request in both is one row: its status and code from the refusal, worker and cost from
    the ledger); error_counts: the refusals of the window by status; errors_scope: whose
    refusals they are ("this process", or every process of a `serve --workers N`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy import state
from proxy.admin.auth import ADMIN, ADMIN_SESSION, is_client_key
from proxy.admin.routes import body_of, guarded, json_response, ledger_of, scope_of, service
from proxy.errors import APIError
from proxy.ledger.service import iso, totals_dict, usage_dict
from proxy.runtime.refusals import REFUSALS

STATIC = Path(__file__).resolve().parent / "static"
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".png": "image/png"}
# The page loads only what this proxy serves; no inline script, no framing.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
_RANGES = {"24h": (86400, "hour"), "7d": (7 * 86400, "day"), "30d": (30 * 86400, "day")}
_ERROR_STATUSES = ("failed", "error")
ERROR_ROWS = 100


def _error_rows(refusals: list[dict], failed: list[dict]) -> list[dict]:
    """The Errors view's rows: refusals (access records) and failed answers (usage rows),
    newest first, one row per request."""
    rows: dict[str, dict] = {}
    for r in refusals:
        rows[r.get("request_id") or f"refusal-{len(rows)}"] = {
            "time": r["time"], "created": iso(r["time"]), "request_id": r.get("request_id"), "status": r.get("status"),
            "error_code": r.get("error_code"), "key_id": r.get("key_id"), "model": r.get("model"),
            "path": r.get("path"), "transport": r.get("transport"), "worker": None, "cost_micros": None}
    for u in failed:
        row = rows.get(u["request_id"])
        ledger = {"worker": u.get("worker"), "cost_micros": u.get("cost_micros"), "key_id": u.get("key_id"),
                  "model": u.get("model")}
        if row is not None:
            row.update({k: v for k, v in ledger.items() if v is not None})
            continue
        rows[u["request_id"]] = {"time": u["created_at"], "created": u["created"], "request_id": u["request_id"],
                                 "status": u["status"], "error_code": None, "path": "/v1/responses",
                                 "transport": None, **ledger}
    return sorted(rows.values(), key=lambda r: r["time"], reverse=True)[:ERROR_ROWS]


def _counts(refusals: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in refusals:
        key = str(r.get("status"))
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _static_files() -> dict[str, Path]:
    return {p.name: p for p in STATIC.iterdir() if p.is_file() and p.suffix in _TYPES}


async def page(request: web.Request) -> web.StreamResponse:
    if not request.path.endswith("/"):  # the page's relative links need the slash
        raise web.HTTPFound(request.path + "/")
    return web.FileResponse(STATIC / "index.html", headers={
        "Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": _CSP, "Cache-Control": "no-store",
        "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"})


def _static_handler(files: dict[str, Path]):
    async def static(request: web.Request) -> web.StreamResponse:
        found = files.get(request.match_info["name"])
        if found is None:
            raise APIError(404, "No such file.", code="not_found")
        return web.FileResponse(found, headers={"Content-Type": _TYPES[found.suffix],
                                                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})
    return static


def _login_handler(prefix: str):
    async def login(request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            raise APIError(415, "Log in with a JSON body {\"key\": \"<admin key>\"}.", code="unsupported_media_type")
        data = await body_of(request)
        key = data.get("key")
        if not isinstance(key, str) or not key or len(key) > 512:
            raise APIError(400, "The body must be {\"key\": \"<admin key>\"}.", code="invalid_value", param="key")
        auth = request.app[ADMIN]
        name = auth.authenticate(key, request.remote)
        if name is None:
            if await is_client_key(request, key):
                raise APIError(403, "Client API keys cannot log in to the dashboard.", code="client_key_not_allowed")
            raise APIError(401, "Invalid admin key.", code="invalid_admin_key")
        token, session = auth.issue(name)
        response = json_response({"name": name, "role": auth.role(name), "csrf_token": auth.csrf_token(session),
                                  "expires_at": session.expires_at})
        auth.set_cookie(response, token, prefix)
        return response
    return login


async def session_info(request: web.Request) -> web.Response:
    session = request.get(ADMIN_SESSION)
    auth = request.app[ADMIN]
    name = request[state.ADMIN_ACTOR].partition(":")[2]
    role = auth.role_of(session) if session is not None else auth.role(name)
    teams = sorted(auth.scope_of(name, role, session).teams or ())
    return json_response({"name": name, "role": role, "teams": teams,
                          "via": session.via if session is not None else "key",
                          "csrf_token": auth.csrf_token(session) if session is not None else None,
                          "expires_at": session.expires_at if session is not None else None})


def _logout_handler(prefix: str):
    async def logout(request: web.Request) -> web.Response:
        response = json_response({"logged_out": True})
        auth = request.app[ADMIN]
        session = request.get(ADMIN_SESSION)
        if session is not None:
            auth.log_out(session)
        auth.clear_cookie(response, prefix)
        return response
    return logout


def _workers(request: web.Request, by_worker: dict[str, dict]) -> list[dict]:
    pool = request.config_dict.get(state.POOL)
    out = []
    for w in (pool.workers if pool is not None else []):
        sums = by_worker.get(w.name, {})
        inputs = sums.get("input_tokens", 0)
        out.append({
            "name": w.name, "healthy": bool(w.healthy), "available": bool(w.available), "ejected": bool(w.ejected),
            "in_flight": w.in_flight, "capacity": w.capacity,
            "ttfb_ms": round(w.ewma_ttfb * 1000, 1) if w.ewma_ttfb is not None else None,
            "last_check_error": w.last_check_error, "requests": sums.get("requests", 0),
            "input_tokens": inputs, "cached_tokens": sums.get("cached_tokens", 0),
            "cached_share": round(sums.get("cached_tokens", 0) / inputs, 4) if inputs else 0.0,
        })
    return out


async def overview(request: web.Request) -> web.Response:
    chosen = request.query.get("range", "24h")
    if chosen not in _RANGES:
        raise APIError(400, f"range must be one of {', '.join(_RANGES)}", code="invalid_value", param="range")
    span, bucket = _RANGES[chosen]
    ledger = ledger_of(request)
    until = time.time()
    since = until - span
    window: dict[str, Any] = {"since": since}
    scope = scope_of(request)
    if not scope.everything:  # a team admin's figures are their team's (proxy/ledger/scope.py)
        teams = sorted(scope.teams or ())
        team = request.query.get("team_id") or (teams[0] if teams else "team_")
        if team not in teams:
            raise APIError(404, f"No team with id {team[:64]!r}.", code="team_not_found", param="team_id")
        window["key_id"] = team  # the ledger's filters take a level where a key goes
    by_key_time = await guarded(ledger.usage_totals((bucket, "key"), **window))
    by_model_time = await guarded(ledger.usage_totals((bucket, "model"), **window))
    by_key = await guarded(ledger.usage_totals(("key",), **window))
    by_worker = await guarded(ledger.usage_totals(("worker",), **window))
    by_endpoint = await guarded(ledger.usage_totals(("endpoint",), **window))
    total = await guarded(ledger.usage_totals((), **window))
    errors = await guarded(ledger.usage_rows(statuses=_ERROR_STATUSES, limit=20, **window))
    refusal_log = request.config_dict.get(REFUSALS)
    refused = await refusal_log.recent(since) if refusal_log is not None else []
    names = {k.key_id: k.name for k in await guarded(service(request).list())}
    if not scope.everything:
        refused = [r for r in refused if r.get("key_id") in names]
    top = sorted((totals_dict(t) for t in by_key), key=lambda r: (-r["cost_micros"], r["key"]))[:10]
    for row in top:
        row["name"] = names.get(row["key"], "")
    step = 3600 if bucket == "hour" else 86400
    failed = [{"seq": seq, **usage_dict(r)} for seq, r in errors]
    return json_response({
        "range": chosen, "bucket": bucket, "since": iso(since), "until": iso(until),
        "buckets": [iso(t) for t in range(int(since // step * step), int(until) + 1, step)],
        "totals": totals_dict(total[0]) if total else {},
        "series": {"by_key": [totals_dict(t) for t in by_key_time],
                   "by_model": [totals_dict(t) for t in by_model_time]},
        "key_names": names,
        "workers": _workers(request, {str(t.group["worker"]): totals_dict(t) for t in by_worker}),
        "endpoints": [totals_dict(t) for t in by_endpoint],
        "top_keys": top,
        "recent_errors": failed,
        "errors": _error_rows(refused, failed),
        "error_counts": _counts(refused),
        "errors_scope": refusal_log.scope if refusal_log is not None else None,
    })


def add_routes(app: web.Application, prefix: str) -> None:
    r = app.router
    r.add_get("/", page)
    r.add_get("/static/{name}", _static_handler(_static_files()))
    r.add_post("/login", _login_handler(prefix))
    r.add_post("/api/logout", _logout_handler(prefix))
    r.add_get("/api/session", session_info)
    r.add_get("/api/overview", overview)

