"""Refuse what needs stored state: this proxy stores nothing (004 doc, "Stateless").

`previous_response_id` is refused by default; `previous_response_id: ignore` follows the
000 doc instead and drops it. `store: true` is accepted and nothing is stored.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from proxy.config.load import ConfigError
from proxy.http.request import read_json
from proxy.policy.rules import check_stateless

_GUARDED_PATHS = ("/v1/responses", "/v1/responses/input_tokens")


def create(section: dict[str, Any], app: web.Application):
    mode = section.get("previous_response_id", "refuse")
    if mode not in ("refuse", "ignore"):
        raise ConfigError(f"stateless.previous_response_id must be 'refuse' or 'ignore', not {mode!r}")

    @web.middleware
    async def stateless(request: web.Request, handler):
        if request.method != "POST" or request.path not in _GUARDED_PATHS:
            return await handler(request)
        check_stateless(await read_json(request), mode)
        return await handler(request)

    return stateless
