"""The OpenAPI 3.1 description of the admin API, served at <prefix>/openapi.json (like the
public one at /openapi.json). Paths are relative to the admin prefix (servers: [{url: prefix}]).
tests/admin/test_api.py checks that every route of the admin sub-app is described and that
the live answers match it (schemathesis, against a real proxy with an admin key)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from proxy.admin.auth import ADMIN
from proxy.ledger.base import USAGE_GROUPS
from proxy.ledger.service import CREATE_FIELDS, LIMIT_FIELDS, TOTAL_FIELDS, UPDATE_FIELDS, USAGE_FIELDS

_ERR = {"$ref": "#/components/schemas/ErrorEnvelope"}
_MEANINGS = {
    400: "Invalid input (a field of the wrong type or out of range, unknown fields, bad JSON).",
    401: "No admin key or dashboard session, or an invalid one.",
    403: "A client API key was presented (admin keys only), a session write without X-CSRF-Token, or a "
         "write by a viewer's key (insufficient_role).",
    404: "No such key.",
    409: "The ledger refused the change (e.g. rotating a revoked key).",
    413: "The body is larger than 64 KiB.",
    415: "The login body is not JSON.",
    429: "Too many failed admin keys from this address (admin.login_failures_per_min): every key is "
         "refused until Retry-After.",
    503: "No ledger (ledger.backend is none).",
}


def _errors(*statuses: int) -> dict[str, Any]:
    if 401 in statuses:  # where a key is checked, failed ones are throttled (proxy/admin/auth.py)
        statuses += (429,)
    return {str(s): {"description": _MEANINGS[s], "content": {"application/json": {"schema": _ERR}}}
            for s in statuses}


def _ok(description: str, schema: dict | None = None, csv: bool = False, status: int = 200) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": schema or {"type": "object"}}}
    if csv:
        content["text/csv"] = {"schema": {"type": "string"}}
    return {str(status): {"description": description, "content": content}}


def _query(name: str, schema: dict, description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_KEY_ID = {"name": "key_id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 64}}
_TIME = {"type": "string", "maxLength": 40}
_RANGE = [
    _query("since", _TIME, "Unix seconds or ISO 8601 (UTC unless a zone is given); inclusive"),
    _query("until", _TIME, "Unix seconds or ISO 8601; exclusive"),
    _query("key_id", {"type": "string", "maxLength": 64}, "one key"),
    _query("team_id", {"type": "string", "maxLength": 64}, "the keys of one team (or user_id, org_id)"),
]
_PAGE = [
    _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "rows per page (default 100)"),
    _query("cursor", {"type": "integer", "minimum": 1}, "next_cursor of the previous page"),
]
_FORMAT = _query("format", {"type": "string", "enum": ["json", "csv"]}, "json (default) or csv")
_INT_OR_NULL = {"type": ["integer", "null"], "minimum": 1, "maximum": 2**63 - 1}
_LIMITS: dict[str, Any] = {
    "allowed_models": {"type": ["array", "null"], "items": {"type": "string", "minLength": 1, "maxLength": 256},
                       "minItems": 1, "description": "null: every model"},
    "concurrency": _INT_OR_NULL, "rate_per_min": _INT_OR_NULL, "tokens_per_min": _INT_OR_NULL,
    "daily_budget_micros": _INT_OR_NULL, "monthly_budget_micros": _INT_OR_NULL,
    "expires_at": {"type": ["number", "string", "null"],
                   "description": "Unix seconds, ISO 8601, or from now (30d, 12h, 2w); null: never"},
    "blocked": {"type": "boolean", "description": "refused (403) until unblocked"},
    "tags": {"type": ["array", "null"], "items": {"type": "string", "minLength": 1, "maxLength": 64},
             "maxItems": 32},
    "metadata": {"type": ["object", "null"], "description": "the operator's own, at most 4 KiB of JSON"},
}
assert set(_LIMITS) == set(LIMIT_FIELDS)
_USD = {"type": ["string", "number"], "description": "dollars, e.g. \"1.50\" (instead of the micros field)"}
_USD_OR_NULL = {"type": ["string", "number", "null"], "description": "dollars, e.g. \"25\"; null clears"}
_UPDATE: dict[str, Any] = {**_LIMITS, "daily_budget_usd": _USD_OR_NULL, "monthly_budget_usd": _USD_OR_NULL}
assert set(_UPDATE) == set(UPDATE_FIELDS)
_CREATE: dict[str, Any] = {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 200},
    "balance_micros": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}, "balance_usd": _USD,
    "team_id": {"type": "string", "description": "the team it sits under (fixed); no balance: the team's purse"},
    "user_id": {"type": "string", "description": "the user it sits under (their team follows; fixed)"},
    **_UPDATE}}
assert set(_CREATE["properties"]) == set(CREATE_FIELDS)
_KEY = {"type": "object", "required": ["key_id", "name", "prefix", "balance_micros", "revoked"]}
_SECRET = {"type": "object", "required": ["secret", "key"], "properties": {
    "secret": {"type": "string", "description": "shown once; never stored"}, "key": _KEY}}
_LIST = {"type": "object", "required": ["object", "data"]}


def _paths() -> dict[str, Any]:
    return {**_key_paths(), **_key_lifecycle_paths(), **_level_paths(), **_console_paths()}


def _key_lifecycle_paths() -> dict[str, Any]:
    """Block, unblock (delete is the key's DELETE)."""
    key_write = _errors(400, 401, 403, 404, 409, 413)
    return {
        "/api/keys/{key_id}/block": {"parameters": [_KEY_ID], "post": {
            "operationId": "blockKey", "summary": "Refuse the key (403 key_blocked) until it is unblocked",
            "responses": {**_ok("The key"), **key_write}}},
        "/api/keys/{key_id}/unblock": {"parameters": [_KEY_ID], "post": {
            "operationId": "unblockKey", "summary": "Take a blocked key back", "responses": {
                **_ok("The key"), **key_write}}},
    }


_LEVEL_ID = {"name": "level_id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 64}}
_LEVEL_FIELDS: dict[str, Any] = {
    "name": {"type": "string", "minLength": 1, "maxLength": 200},
    "budget_micros": _INT_OR_NULL, "budget_usd": _USD_OR_NULL,
    "budget_period": {"type": ["string", "null"], "description": "daily, weekly, monthly, or a length: 12h, 14d"},
    "budget_reset": {"type": "string", "description": "the clock periods follow: a UTC offset, +00:00"},
    "allowed_models": {"type": ["array", "null"], "items": {"type": "string"},
                       "description": "null: every model; a name ending in * matches a prefix"},
    "concurrency": _INT_OR_NULL, "rate_per_min": _INT_OR_NULL, "tokens_per_min": _INT_OR_NULL,
    "blocked": {"type": "boolean"}, "tags": _LIMITS["tags"], "metadata": _LIMITS["metadata"]}


def _level_paths() -> dict[str, Any]:
    """Organisations, teams and users: shaped like keys (list, create, show, change, top up)."""
    write = _errors(400, 401, 403, 404, 409, 413)
    out: dict[str, Any] = {}
    for kind, noun in (("org", "organisation"), ("team", "team"), ("user", "user")):
        create = {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
            **_LEVEL_FIELDS, "parent_id": {"type": ["string", "null"], "description": "a team's org, a user's team"},
            "level_id": {"type": "string", "pattern": f"^{kind}_[a-z0-9_-]{{1,48}}$",
                         "description": "its id (none: one is made), e.g. for admin.keys[].teams"},
            "balance_micros": {"type": ["integer", "null"], "minimum": 0}, "balance_usd": _USD_OR_NULL}}
        out[f"/api/{kind}s"] = {
            "get": {"operationId": f"list{kind.title()}s", "summary": f"Every {noun} (parent_id: under one)",
                    "parameters": [_query("parent_id", {"type": "string"}, "only those under it")],
                    "responses": {**_ok(f"The {noun}s", _LIST), **_errors(401, 403, 503)}},
            "post": {"operationId": f"create{kind.title()}", "summary": f"Create a {noun}",
                     "requestBody": {"required": True, "content": {"application/json": {"schema": create}}},
                     "responses": {**_ok(f"The {noun}", status=201), **write}}}
        out[f"/api/{kind}s/{{level_id}}"] = {
            "parameters": [_LEVEL_ID],
            "get": {"operationId": f"show{kind.title()}", "summary": f"A {noun}, what it holds and may still hold",
                    "responses": {**_ok(f"The {noun}"), **_errors(401, 403, 404, 503)}},
            "patch": {"operationId": f"update{kind.title()}", "summary": "Change its budget, limits, models",
                      "requestBody": {"required": True, "content": {"application/json": {"schema": {
                          "type": "object", "additionalProperties": False, "minProperties": 1,
                          "properties": _LEVEL_FIELDS}}}},
                      "responses": {**_ok(f"The {noun}"), **write}}}
        out[f"/api/{kind}s/{{level_id}}/topup"] = {"parameters": [_LEVEL_ID], "post": {
            "operationId": f"topUp{kind.title()}", "summary": "Add to its balance (negative corrects)",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "minProperties": 1, "maxProperties": 1,
                "properties": {"micros": {"type": "integer"}, "usd": _USD}}}}},
            "responses": {**_ok("The new balance"), **write}}}
    return out


def _key_paths() -> dict[str, Any]:
    """The keys' routes: list, create, show, change, top up, revoke, rotate."""
    key_write = _errors(400, 401, 403, 404, 409, 413)
    return {
        "/api/keys": {
            "get": {"operationId": "listKeys", "summary": "Every key (never a secret)",
                    "responses": {**_ok("The keys", _LIST), **_errors(401, 403, 503)}},
            "post": {"operationId": "createKey", "summary": "Create a key (the secret is in this answer only)",
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _CREATE}}},
                     "responses": {**_ok("The new key and its secret", _SECRET, status=201),
                                   **_errors(400, 401, 403, 413, 503)}}},
        "/api/keys/{key_id}": {
            "parameters": [_KEY_ID],
            "get": {"operationId": "showKey", "summary": "A key, its balance, spend today and this month",
                    "responses": {**_ok("The key"), **_errors(401, 403, 404, 503)}},
            "delete": {"operationId": "deleteKey", "summary": "Revoke for good and leave out of the list "
                                                              "(its usage and audit stay)",
                       "responses": {**_ok("Deleted"), **_errors(401, 403, 404, 409)}},
            "patch": {"operationId": "updateKey", "summary": "Change limits, models, budgets, expiry (null clears)",
                      "requestBody": {"required": True, "content": {"application/json": {"schema": {
                          "type": "object", "additionalProperties": False, "minProperties": 1,
                          "properties": _UPDATE}}}},
                      "responses": {**_ok("The key"), **key_write}}},
        "/api/keys/{key_id}/topup": {"parameters": [_KEY_ID], "post": {
            "operationId": "topUpKey", "summary": "Add to the balance (negative corrects; never below 0)",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "minProperties": 1, "maxProperties": 1,
                "properties": {"micros": {"type": "integer"}, "usd": _USD}}}}},
            "responses": {**_ok("The new balance"), **key_write}}},
        "/api/keys/{key_id}/revoke": {"parameters": [_KEY_ID], "post": {
            "operationId": "revokeKey", "summary": "Revoke a key (effective at once in this process)",
            "responses": {**_ok("Revoked"), **key_write}}},
        "/api/keys/{key_id}/rotate": {"parameters": [_KEY_ID], "post": {
            "operationId": "rotateKey", "summary": "A new secret for the same key and balance; the old one "
                                                   "works for `grace` more (none: stops at once)",
            "requestBody": {"required": False, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "properties": {"grace": {
                    "type": ["string", "number"], "description": "seconds or 30m, 12h, 7d (at most 90 days)"}}}}}},
            "responses": {**_ok("The key and its new secret", _SECRET), **key_write}}},
    }


def _console_paths() -> dict[str, Any]:
    """The reads of usage, audit and the dashboard, the session and the sign-ons."""
    return {
        "/api/usage": {"get": {
            "operationId": "usageRows", "summary": "Usage rows, newest first, paginated",
            "parameters": [*_RANGE, _query("model", {"type": "string"}, "one served model (rows from before"
                                           " served_model was kept: their model)"), *_PAGE, _FORMAT],
            "responses": {**_ok(f"Rows with {', '.join(USAGE_FIELDS)}", _LIST, csv=True),
                          **_errors(400, 401, 403, 503)}}},
        "/api/usage/totals": {"get": {
            "operationId": "usageTotals", "summary": "Usage sums over a range, grouped",
            "parameters": [*_RANGE, _query("model", {"type": "string"}, "one served model"),
                           _query("group_by", {"type": "string"}, f"comma-separated: {', '.join(USAGE_GROUPS)}"),
                           _FORMAT],
            "responses": {**_ok(f"Groups with {', '.join(TOTAL_FIELDS)}", _LIST, csv=True),
                          **_errors(400, 401, 403, 503)}}},
        "/api/audit": {"get": {
            "operationId": "auditLog", "summary": "Key changes: who, what, when (newest first)",
            "parameters": [*_RANGE, *_PAGE],
            "responses": {**_ok("Audit entries", _LIST), **_errors(400, 401, 403, 503)}}},
        "/api/overview": {"get": {
            "operationId": "overview", "summary": "The dashboard's figures for a window",
            "parameters": [_query("range", {"type": "string", "enum": ["24h", "7d", "30d"]}, "default 24h")],
            "responses": {**_ok("Totals, series, workers, top keys, recent errors; errors: refusals (from the "
                                "access records) and failed answers, error_counts, errors_scope"),
                          **_errors(400, 401, 403, 503)}}},
        "/api/reload": {"post": {
            "operationId": "reloadConfig", "summary": "Read config.yaml again and serve it (every process of "
                                                      "serve --workers N); what cannot change live refuses it",
            "responses": {**_ok("The configuration served now: hash, loaded_at, live_sections, reloads"),
                          **_errors(400, 401, 403, 409)}}},
        "/api/config": {"get": {
            "operationId": "configServed", "summary": "The configuration this process serves (its hash)",
            "responses": {**_ok("hash, loaded_at, live_sections, reloads, last_error"), **_errors(401, 403)}}},
        "/api/alerts": {"get": {
            "operationId": "alerts", "summary": "Alerts: the conditions active now, the last notices, deliveries",
            "responses": {**_ok("Active, recent, sent, failed, dropped, queued"), **_errors(401, 403)}}},
        "/api/requests": {"get": {
            "operationId": "requests", "summary": "One row per request, newest first, from the ledger (paginated)",
            "parameters": [*_RANGE, _query("model", {"type": "string"}, "one served model"),
                           _query("endpoint", {"type": "string"}, "one API path, e.g. /v1/chat/completions"),
                           _query("status", {"type": "string"}, "completed, incomplete, failed, cancelled, error; "
                                                                "several comma-separated"), *_PAGE],
            "responses": {**_ok("Rows: time, request, key, model, endpoint, worker, tokens, cost, status; "
                                "next_cursor", _LIST), **_errors(400, 401, 403, 503)}}},
        "/api/session": {"get": {
            "operationId": "session", "summary": "Who is logged in, and the CSRF token of the session",
            "responses": {**_ok("The session"), **_errors(401, 403)}}},
        "/api/logout": {"post": {
            "operationId": "logout", "summary": "Drop the session cookie",
            "responses": {**_ok("Logged out"), **_errors(401, 403)}}},
        "/login": {"post": {
            "operationId": "login", "summary": "Dashboard login with an admin key: sets the session cookie",
            "security": [],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["key"], "properties": {"key": {"type": "string"}}}}}},
            "responses": {**_ok("Logged in: the CSRF token"), **_errors(400, 401, 403, 413, 415)}}},
        "/login-options": {"get": {
            "operationId": "loginOptions", "summary": "What the login page offers: single sign-on's label, or null",
            "security": [], "responses": {**_ok("The options")}}},
        "/oidc/login": {"get": {
            "operationId": "oidcLogin", "summary": "Single sign-on: a redirect to the provider (PKCE, state, nonce)",
            "security": [], "responses": {"302": {"description": "To the provider, or back to the login page "
                                                                  "with ?sso_error= saying why not"}}}},
        "/oidc/callback": {"get": {
            "operationId": "oidcCallback", "summary": "The provider's return: the code exchanged, the ID token "
                                                      "checked, the session cookie set",
            "security": [], "responses": {"302": {"description": "Into the console, or back to the login page "
                                                                  "with ?sso_error= saying why not"}}}},
    }


def openapi_document(prefix: str = "/admin") -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "responses-proxy admin API", "version": "1",
                 "description": "Keys, usage and audit of the operator's console. Admin keys only."},
        "servers": [{"url": prefix}],
        "security": [{"adminKey": []}, {"session": []}],
        "paths": _paths(),
        "components": {
            "securitySchemes": {
                "adminKey": {"type": "http", "scheme": "bearer", "description": "an admin key from admin.keys"},
                "session": {"type": "apiKey", "in": "cookie", "name": "rp_admin_session",
                            "description": "dashboard login; writes also need the X-CSRF-Token header"},
            },
            "schemas": {"ErrorEnvelope": {
                "type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                        "message": {"type": "string"}, "type": {"type": "string"},
                        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}},
        },
    }


async def handler(request: web.Request) -> web.Response:

    return web.Response(body=orjson.dumps(openapi_document(request.app[ADMIN].prefix)),
                        content_type="application/json")
