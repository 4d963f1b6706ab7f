"""The admin API's handlers (<prefix>/api/...): keys, usage, audit. Each one is a thin
shell over proxy/ledger/service.py (the keys CLI's rules, once), answering JSON (or CSV
for usage with format=csv) and refusing bad input with a 4xx in the OpenAI envelope.

    GET    /api/keys                      every key (never a secret)
    POST   /api/keys                      create; 201 {"secret": ..., "key": {...}} (the secret once)
    GET    /api/keys/{key_id}             a key, its balance, spend today / this month, budgets left
    PATCH  /api/keys/{key_id}             limits, allowed models, budgets, expiry (null clears)
    POST   /api/keys/{key_id}/topup       {"micros": N} (negative corrects)
    POST   /api/keys/{key_id}/revoke
    POST   /api/keys/{key_id}/rotate      {"grace": "1h"}: a new secret, same key; the old one works
                                          that long (none: stops at once) -> {"secret": ..., "key": {...}}
    POST   /api/keys/{key_id}/block       refused (403) until unblocked; /unblock
    DELETE /api/keys/{key_id}             revoked for good, left out of the list (its rows stay)
    GET    /api/teams  POST /api/teams    organisations, teams, users (also /api/orgs, /api/users):
    GET    /api/teams/{id}  PATCH ...     name, parent_id, balance, budget (+ period, reset clock),
    POST   /api/teams/{id}/topup          limits, allowed models, blocked, tags, metadata
    GET    /api/usage                     rows, newest first: since, until, key_id, model, limit, cursor, format
    GET    /api/usage/totals              sums grouped by group_by=key,model,worker,day|hour
                                          (model: the served model; also the filter's)
    GET    /api/audit                     the audit log: key_id, since, until, limit, cursor
"""

from __future__ import annotations

import os
import signal
from typing import Any

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.ledger import KeyRecord, Ledger, LedgerError, UnknownKey
from proxy.ledger.level_service import LevelService, level_dict
from proxy.ledger.levels import KINDS, kind_of
from proxy.ledger.scope import EVERYTHING, NotPermitted, Scope
from proxy.ledger.service import (
    USAGE_FIELDS,
    KeyService,
    UsageQuery,
    bounded_int,
    iso,
    key_dict,
    micros_of_usd,
    parse_time,
    to_csv,
    usage_dict,
)
from proxy.protocol.models import resolve_model
from proxy.runtime.alerts import ALERTS
from proxy.runtime.reload import RELOADERS, ReloadRefused, reload_app

MAX_BODY = 64 * 1024


def json_response(data: Any, status: int = 200) -> web.Response:
    # no-store: key data and usage are not for shared caches (nor the browser's back button)
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def ledger_of(request: web.Request) -> Ledger:
    ledger = request.config_dict.get(state.LEDGER)
    if ledger is None:
        raise APIError(503, "No ledger (ledger.backend is none): there are no keys to manage.", code="no_ledger")
    return ledger


def scope_of(request: web.Request) -> Scope:
    """What the calling admin may see and change (set by the guard; proxy/ledger/scope.py)."""
    return request.get(state.ADMIN_SCOPE) or EVERYTHING


def service(request: web.Request) -> KeyService:
    return KeyService(ledger_of(request), request[state.ADMIN_ACTOR], scope_of(request))


async def body_of(request: web.Request) -> dict[str, Any]:
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise APIError(413, f"The body is larger than {MAX_BODY} bytes.", code="body_too_large")
    raw = await request.content.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise APIError(413, f"The body is larger than {MAX_BODY} bytes.", code="body_too_large")
    if not raw.strip():
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise APIError(400, "The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The body must be a JSON object.", code="invalid_json")
    return data


async def guarded(coro: Any) -> Any:
    """The service's refusals as 4xx: unknown key 404, bad value 400, other ledger refusal 409."""
    try:
        return await coro
    except UnknownKey as exc:
        what = kind_of(exc.key_id) or "key"
        raise APIError(404, f"No {what} with id {exc.key_id[:64]!r}.", code=f"{what}_not_found") from None
    except NotPermitted as exc:
        raise APIError(403, str(exc)[:500], code="insufficient_role") from None
    except ValueError as exc:
        raise APIError(400, str(exc)[:500], code="invalid_value") from None
    except LedgerError as exc:
        raise APIError(409, str(exc)[:500], code="ledger_refused") from None


async def list_keys(request: web.Request) -> web.Response:
    records = await guarded(service(request).list())
    return json_response({"object": "list", "data": [key_dict(r) for r in records]})


def unserved_models(request: web.Request, record: KeyRecord) -> list[str]:
    """The warnings of a key whose allowed_models names a model no worker serves now (taken all
    the same: a worker may serve it later, but an operator who mistyped a name is told)."""
    pool = request.config_dict.get(state.POOL)
    if pool is None or record.allowed_models is None:
        return []
    groups = request.config_dict[state.CONFIG].model_groups
    return [f"allowed_models: no model group {model[6:]!r} in config.yaml's model_groups" if model.startswith("group:")
            else f"allowed_models: no worker serves {model!r} now" for model in record.allowed_models
            if (model[6:] not in groups if model.startswith("group:") else
                not model.endswith("*") and resolve_model(model, pool.serves) is None)]


def _with_warnings(answer: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    return {**answer, "warnings": warnings} if warnings else answer


async def create_key(request: web.Request) -> web.Response:
    data = await body_of(request)
    secret, record = await guarded(service(request).create(data))
    return json_response(_with_warnings({"secret": secret, "key": key_dict(record)}, unserved_models(request, record)),
                         status=201)


async def show_key(request: web.Request) -> web.Response:
    svc = service(request)
    record = await guarded(svc.get(request.match_info["key_id"]))
    summary = await guarded(svc.summary(record))
    return json_response({"key": key_dict(record), **summary})


async def update_key(request: web.Request) -> web.Response:
    data = await body_of(request)
    record = await guarded(service(request).update(request.match_info["key_id"], data))
    return json_response(_with_warnings({"key": key_dict(record)}, unserved_models(request, record)))


async def top_up(request: web.Request) -> web.Response:
    data = await body_of(request)
    if set(data) not in ({"micros"}, {"usd"}):
        raise APIError(400, "The body must be {\"micros\": N} or {\"usd\": \"1.50\"}.", code="invalid_value",
                       param="micros")
    key_id = request.match_info["key_id"]
    try:
        micros = data["micros"] if "micros" in data else micros_of_usd(data["usd"], "usd", signed=True)
    except ValueError as exc:
        raise APIError(400, str(exc)[:500], code="invalid_value", param="usd") from None
    balance = await guarded(service(request).top_up(key_id, micros))
    return json_response({"key_id": key_id, "balance_micros": balance})


async def revoke(request: web.Request) -> web.Response:
    key_id = request.match_info["key_id"]
    await guarded(service(request).revoke(key_id))
    return json_response({"key_id": key_id, "revoked": True})


async def rotate(request: web.Request) -> web.Response:
    """{"grace": "1h"} (or seconds): the old secret keeps working that long; none: stops now."""
    data = await body_of(request)
    if set(data) - {"grace"}:
        raise APIError(400, "The body may only hold {\"grace\": \"1h\"}.", code="invalid_value", param="grace")
    secret, record = await guarded(service(request).rotate(request.match_info["key_id"], data.get("grace")))
    return json_response({"secret": secret, "key": key_dict(record)})


async def block(request: web.Request) -> web.Response:
    record = await guarded(service(request).set_blocked(request.match_info["key_id"], True))
    return json_response({"key": key_dict(record)})


async def unblock(request: web.Request) -> web.Response:
    record = await guarded(service(request).set_blocked(request.match_info["key_id"], False))
    return json_response({"key": key_dict(record)})


async def delete_key(request: web.Request) -> web.Response:
    key_id = request.match_info["key_id"]
    await guarded(service(request).delete(key_id))
    return json_response({"key_id": key_id, "deleted": True})


def _query(request: web.Request) -> UsageQuery:
    try:
        query = UsageQuery(dict(request.query))
    except ValueError as exc:
        raise APIError(400, str(exc)[:500], code="invalid_value") from None
    scope = scope_of(request)
    if not scope.everything:  # a team admin reads their teams' rows only
        teams = sorted(scope.teams or ())
        if query.key_id is None and len(teams) == 1:
            query.key_id = teams[0]
        elif query.key_id is None or not (query.key_id in teams or query.key_id.startswith(("key_", "user_"))):
            raise APIError(400, f"Filter by one of your teams (team_id: {', '.join(teams)[:300]}), "
                           "or a key or a user of one.", code="invalid_value", param="team_id")
    return query


async def _scoped_query(request: web.Request) -> UsageQuery:
    """_query, its key or user filter checked against the admin's scope (404 outside it)."""
    query = _query(request)
    owner = query.key_id
    if not scope_of(request).everything and owner is not None and owner.startswith(("key_", "user_")):
        if owner.startswith("key_"):
            await guarded(service(request).get(owner))
        else:
            await guarded(levels(request).get(owner, "user"))
    return query


def _csv(text: str, name: str) -> web.Response:
    return web.Response(text=text, content_type="text/csv", charset="utf-8", headers={
        "Cache-Control": "no-store", "Content-Disposition": f'attachment; filename="{name}.csv"'})


async def usage_rows(request: web.Request) -> web.Response:
    query = await _scoped_query(request)
    page, cursor = await guarded(query.rows(ledger_of(request)))
    rows = [{"seq": seq, **usage_dict(r)} for seq, r in page]
    if query.format == "csv":
        response = _csv(to_csv(rows, ("seq", *USAGE_FIELDS)), "usage")
        if cursor is not None:
            response.headers["X-Next-Cursor"] = str(cursor)
        return response
    return json_response({"object": "list", "data": rows, "next_cursor": cursor, "has_more": cursor is not None})


async def usage_totals(request: web.Request) -> web.Response:
    query = await _scoped_query(request)
    rows = await guarded(query.total_rows(ledger_of(request)))
    if query.format == "csv":
        return _csv(to_csv(rows, query.total_columns), "usage-totals")
    return json_response({"object": "list", "group_by": list(query.group_by), "since": iso(query.since),
                          "until": iso(query.until), "data": rows})


async def audit(request: web.Request) -> web.Response:
    q = request.query
    try:
        since, until = parse_time(q.get("since"), "since"), parse_time(q.get("until"), "until")
        limit = bounded_int(q.get("limit"), "limit", 100, 1, 1000)
        cursor = bounded_int(q.get("cursor"), "cursor", None, 1, 2**63 - 1)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None
    scope = scope_of(request)
    key_id = q.get("key_id") or None
    if not scope.everything:  # a team admin reads the entries of what they can see
        if key_id is None:
            raise APIError(400, "Give key_id: a key, a user or a team of yours.", code="invalid_value",
                           param="key_id")
        if key_id.startswith("key_"):
            await guarded(service(request).get(key_id))
        else:
            await guarded(levels(request).get(key_id))
    entries = await guarded(ledger_of(request).list_audit(
        key_id=key_id, since=since, until=until, before_seq=cursor, limit=limit + 1))
    more = len(entries) > limit
    entries = entries[:limit]
    data = [{"seq": e.seq, "created_at": e.created_at, "created": iso(e.created_at), "actor": e.actor,
             "action": e.action, "key_id": e.key_id, "details": e.details} for e in entries]
    next_cursor = entries[-1].seq if more and entries else None
    return json_response({"object": "list", "data": data, "next_cursor": next_cursor, "has_more": more})


async def requests_browser(request: web.Request) -> web.Response:
    """One row per request, newest first, from the ledger's usage rows (not a copy): filters
    key_id, model (the served one), endpoint, status (one or several, comma-separated), since,
    until; a page of `limit`, the next from `cursor`."""
    query = await _scoped_query(request)
    page, cursor = await guarded(query.rows(ledger_of(request)))
    keys = {r.key_id: r for r in await guarded(service(request).list())} if page else {}
    data = []
    for _, record in page:
        key = keys.get(record.key_id)
        data.append({**usage_dict(record), "endpoint": record.endpoint or "/v1/responses",
                     "key_name": key.name if key else None, "team_id": key.team_id if key else None,
                     "user_id": key.user_id if key else None, "transport": record.transport,
                     "latency_ms": record.latency_ms})
    return json_response({"object": "list", "data": data, "next_cursor": cursor})


async def reload_config(request: web.Request) -> web.Response:
    """config.yaml read again and swapped in (proxy/runtime/reload.py); under `serve --workers N`
    the supervisor is asked to have every process reload too. A file that cannot be served is a
    400 naming the key (invalid_config), a change that needs a restart a 409 (restart_required)."""
    try:
        view = reload_app(request.config_dict)  # type: ignore[arg-type]  # read by key, as an app is
    except ReloadRefused as exc:
        restart = "cannot change while serving" in str(exc)
        raise APIError(409 if restart else 400, str(exc)[:1000], param=exc.key,
                       code="restart_required" if restart else "invalid_config") from None
    if os.environ.get("RESPONSES_PROXY_WORKER") is not None:  # a child of serve --workers N: every process
        os.kill(os.getppid(), signal.SIGHUP)
    return json_response({"object": "config", "pid": os.getpid(), **view})


async def config_served(request: web.Request) -> web.Response:
    """The configuration this process serves: its hash, when it was loaded, what can change live."""
    return json_response({"object": "config", "pid": os.getpid(), **request.config_dict[RELOADERS].view()})


async def alerts(request: web.Request) -> web.Response:
    """The active conditions, the last notices and the delivery counts (proxy/runtime/alerts.py)."""
    found = request.config_dict.get(ALERTS)
    return json_response(found.view() if found is not None else {"active": [], "recent": [], "sent": {},
                                                                 "failed": {}, "dropped": 0, "queued": 0})


# ----------------------------------------------------------------------------- organisations, teams, users


def levels(request: web.Request) -> LevelService:
    return LevelService(ledger_of(request), request[state.ADMIN_ACTOR], scope_of(request))


def _level_routes(kind: str) -> tuple[Any, ...]:
    """The handlers of one kind of level (/api/orgs, /api/teams, /api/users), shaped like keys'."""

    async def list_levels(request: web.Request) -> web.Response:
        found = await guarded(levels(request).list(kind, request.query.get("parent_id") or None))
        return json_response({"object": "list", "data": [level_dict(lv) for lv in found]})

    async def create_level(request: web.Request) -> web.Response:
        level = await guarded(levels(request).create(kind, await body_of(request)))
        return json_response({kind: level_dict(level)}, status=201)

    async def show_level(request: web.Request) -> web.Response:
        svc = levels(request)
        level = await guarded(svc.get(request.match_info["level_id"], kind))
        return json_response({kind: await guarded(svc.summary(level))})

    async def update_level(request: web.Request) -> web.Response:
        data = await body_of(request)
        level = await guarded(levels(request).update(request.match_info["level_id"], data, kind))
        return json_response({kind: level_dict(level)})

    async def top_up_level(request: web.Request) -> web.Response:
        data = await body_of(request)
        if set(data) not in ({"micros"}, {"usd"}):
            raise APIError(400, "The body must be {\"micros\": N} or {\"usd\": \"1.50\"}.", code="invalid_value",
                           param="micros")
        try:
            micros = data["micros"] if "micros" in data else micros_of_usd(data["usd"], "usd", signed=True)
        except ValueError as exc:
            raise APIError(400, str(exc)[:500], code="invalid_value", param="usd") from None
        level_id = request.match_info["level_id"]
        balance = await guarded(levels(request).top_up(level_id, micros, kind))
        return json_response({f"{kind}_id": level_id, "balance_micros": balance})

    return list_levels, create_level, show_level, update_level, top_up_level


def add_routes(app: web.Application) -> None:
    r = app.router
    for kind in KINDS:
        list_levels, create_level, show_level, update_level, top_up_level = _level_routes(kind)
        r.add_get(f"/api/{kind}s", list_levels)
        r.add_post(f"/api/{kind}s", create_level)
        r.add_get(f"/api/{kind}s/{{level_id}}", show_level)
        r.add_patch(f"/api/{kind}s/{{level_id}}", update_level)
        r.add_post(f"/api/{kind}s/{{level_id}}/topup", top_up_level)
    r.add_get("/api/keys", list_keys)
    r.add_post("/api/keys", create_key)
    r.add_get("/api/requests", requests_browser)
    r.add_get("/api/alerts", alerts)
    r.add_post("/api/reload", reload_config)
    r.add_get("/api/config", config_served)
    r.add_get("/api/keys/{key_id}", show_key)
    r.add_patch("/api/keys/{key_id}", update_key)
    r.add_post("/api/keys/{key_id}/topup", top_up)
    r.add_post("/api/keys/{key_id}/revoke", revoke)
    r.add_post("/api/keys/{key_id}/rotate", rotate)
    r.add_post("/api/keys/{key_id}/block", block)
    r.add_post("/api/keys/{key_id}/unblock", unblock)
    r.add_delete("/api/keys/{key_id}", delete_key)
    r.add_get("/api/usage", usage_rows)
    r.add_get("/api/usage/totals", usage_totals)
    r.add_get("/api/audit", audit)
