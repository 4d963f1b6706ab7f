"""The route table: every route of the proxy's API, its handler and its unit of work
(proxy.units: the phases it runs). build_app registers the routes from it and the envelope
reads each request's unit from it, so a route cannot be served without being declared here.

A guarded path answers any other method after auth (a 401 before its 405), as it always did:
whether a path exists is not told to a caller without a key. Paths not listed (the admin
console's sub-app, /metrics at its configured path, unknown paths) run no phase: the console
has its own guard (proxy.admin.auth), the rest are public or 404.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from proxy.http.compact import compact_handler
from proxy.http.compaction_trigger import answer_trigger
from proxy.http.input_tokens import input_tokens_handler
from proxy.http.keyed_reads import key_handler, models_handler
from proxy.http.openapi import openapi_handler
from proxy.http.passthrough_handler import passthrough_handler
from proxy.http.probes import healthz_handler, livez_handler, readyz_handler
from proxy.http.responses_handler import responses_handler
from proxy.http.websocket import websocket_handler
from proxy.protocol.passthrough import ANTHROPIC
from proxy.units import (
    AUTH,
    CHAT,
    COMPACT,
    COMPACT_SUMMARY,
    COMPLETIONS,
    EMBEDDINGS,
    INPUT_TOKENS,
    KEYED,
    KEYED_ANTHROPIC,
    MESSAGES,
    MESSAGES_COUNT,
    PUBLIC,
    RESPONSES,
    WS_HANDSHAKE,
    WS_TURN,
    Unit,
)


class Route(NamedTuple):
    method: str
    path: str
    handler: Any
    unit: Unit
    head: bool = True  # a GET answers HEAD too (a socket's GET does not: a HEAD there is a 405, never an upgrade)


ROUTES = (
    Route("POST", "/v1/responses", responses_handler, RESPONSES),
    Route("GET", "/v1/responses", websocket_handler, WS_HANDSHAKE, head=False),
    Route("POST", "/v1/responses/compact", compact_handler, COMPACT),
    Route("POST", "/v1/responses/input_tokens", input_tokens_handler, INPUT_TOKENS),
    # The model server's other APIs, passed through (proxy.http.passthrough_handler; config `endpoints`).
    Route("POST", "/v1/chat/completions", passthrough_handler, CHAT),
    Route("POST", "/v1/completions", passthrough_handler, COMPLETIONS),
    Route("POST", "/v1/embeddings", passthrough_handler, EMBEDDINGS),
    Route("POST", "/v1/messages", passthrough_handler, MESSAGES),
    Route("POST", "/v1/messages/count_tokens", passthrough_handler, MESSAGES_COUNT),
    Route("GET", "/v1/models", models_handler, KEYED),
    Route("GET", "/v1/key", key_handler, KEYED),
    Route("GET", "/livez", livez_handler, PUBLIC),
    Route("GET", "/healthz", healthz_handler, PUBLIC),
    Route("GET", "/readyz", readyz_handler, PUBLIC),
    Route("GET", "/openapi.json", openapi_handler, PUBLIC),
)

# The variants that have a handler of their own: a request its translation made a compaction's
# (proxy.units: Unit.with_compaction), whichever unit it came as.
VARIANT_HANDLERS = {variant.name: answer_trigger for unit in (RESPONSES, WS_TURN, COMPACT_SUMMARY)
                    if (variant := unit.compaction_variant()) is not None}

_BY_METHOD = {(r.method, r.path): r.unit for r in ROUTES}
_BY_METHOD.update({("HEAD", r.path): r.unit for r in ROUTES if r.method == "GET" and r.head})
# Any other method on a guarded path: auth first, then the router's 405.
_BY_PATH = {r.path: KEYED_ANTHROPIC if r.unit.family in ANTHROPIC else KEYED
            for r in ROUTES if r.unit.runs(AUTH)}


def unit_for(method: str, path: str) -> Unit:
    """The unit of an HTTP request (a transport's turn carries its own: proxy.http.turn.Turn)."""
    unit = _BY_METHOD.get((method, path))
    if unit is None:
        unit = _BY_PATH.get(path, PUBLIC)
    return unit


def add_routes(app: Any) -> None:
    for route in ROUTES:
        if route.method == "GET":
            app.router.add_get(route.path, route.handler, allow_head=route.head)
        else:
            app.router.add_route(route.method, route.path, route.handler)
