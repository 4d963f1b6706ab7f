"""An operator's own middleware, loaded by dotted path (tests/middlewares/test_custom.py).

    middlewares:
      after_auth: [{"tests.support.custom_mw:create": {header: x-custom, refuse_model: banned-model}}]

It adds `<header>: <value>` to every response and refuses one model with 403; with
`notice` set it appends that text to the request's notices (for the header tests).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from proxy import state
from proxy.config.load import ConfigError
from proxy.errors import APIError
from proxy.http.request import read_json


def create(section: dict[str, Any], app: web.Application):
    header = section.get("header")
    if not isinstance(header, str) or not header:
        raise ConfigError("custom_mw.header must be a non-empty string")
    value = str(section.get("value", "yes"))
    refuse_model = section.get("refuse_model")
    if refuse_model is not None and not isinstance(refuse_model, str):
        raise ConfigError("custom_mw.refuse_model must be a model name")
    notice = section.get("notice")
    if section.get("explode"):
        raise RuntimeError("the factory blew up on purpose")

    async def add_header(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[header] = value

    app.on_response_prepare.append(add_header)

    @web.middleware
    async def custom(request: web.Request, handler):
        if request.method == "POST" and request.path == "/v1/responses":
            if notice:
                state.context(request).notices.append(str(notice))
            body = await read_json(request)
            if refuse_model is not None and body.get("model") == refuse_model:
                raise APIError(403, f"The model {refuse_model!r} is refused here.", code="model_refused",
                               param="model")
        return await handler(request)

    return custom


# What each named point promises (middlewares/__init__.py, POINTS), as seen by `probe`.
SEEN = web.AppKey("probe_seen", list)


def probe(section: dict[str, Any], app: web.Application):
    """Records, for each POST /v1/responses (every path: `every_path: true`), what the request
    context holds at its point."""
    seen = app[SEEN] if SEEN in app else []
    app[SEEN] = seen

    @web.middleware
    async def probe_mw(request: web.Request, handler):
        ctx = state.context(request)
        if request.path == "/v1/responses" or section.get("every_path"):
            t = ctx.to_answer()
            seen.append({"point": section.get("point"), "key": ctx.key.name if ctx.key is not None else None,
                         "body_read": ctx.body is not None, "translated": t is not None,
                         "held": ctx.hold is not None, "reserved_output": t.reserved_output if t else None})
        return await handler(request)

    return probe_mw


def not_a_factory(section: dict[str, Any], app: web.Application):
    return None


NOT_CALLABLE = 42
