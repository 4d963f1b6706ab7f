"""A pipeline entry for tests: records what clients send to /v1/responses (headers and the
decoded JSON body) before any other middleware sees it.

    pipeline: ["tests.clients.capture:create", stateless, auth, limits, tools, balance, notices]
    ...
    app[CAPTURED] -> list of {"headers": {...}, "body": {...}, "status": int}
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from aiohttp import web

from proxy.errors import APIError
from proxy.request import read_json

CAPTURED = web.AppKey("captured_requests", list)
ENTRY = "tests.clients.capture:create"


def create(section: dict[str, Any], app: web.Application):
    app[CAPTURED] = []

    @web.middleware
    async def capture(request: web.Request, handler):
        if request.method != "POST" or request.path != "/v1/responses":
            return await handler(request)
        record: dict[str, Any] = {"headers": dict(request.headers), "body": None, "status": None}
        app[CAPTURED].append(record)
        try:
            record["body"] = copy.deepcopy(await read_json(request))
        except APIError as exc:
            record["status"] = exc.status
            raise
        try:
            response = await handler(request)
        except APIError as exc:
            record["status"] = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            # Codex closes the stream as soon as it has response.completed; aiohttp then
            # cancels the handler while it winds down. The answer was already out.
            record["status"] = "client_closed"
            raise
        record["status"] = response.status
        return response

    return capture
