"""A custom middleware for tests: records what clients send to /v1/responses (headers and the
decoded JSON body) right after auth, before any policy edits the body.

    middlewares:
      after_auth: ["tests.clients.capture:create"]
      # or other paths: after_auth: [{"tests.clients.capture:create": {"paths": ["/v1/messages"]}}]
    ...
    app[CAPTURED] -> list of {"headers": {...}, "body": {...}, "status": int, "end": bytes}

"end" holds the last bytes the proxy wrote for that request (a stream's close included).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from aiohttp import web

from proxy.errors import APIError
from proxy.http.request import read_json

CAPTURED = web.AppKey("captured_requests", list)
ENTRY = "tests.clients.capture:create"
_RECORD = web.RequestKey("captured_record", dict)


async def _record_writes(request: web.Request, response: web.StreamResponse) -> None:
    """From prepare on, keep the tail of what the response writes (write_eof's last bytes too)."""
    record = request.get(_RECORD)
    if record is None:
        return
    write, write_eof = response.write, response.write_eof

    async def recording_write(data: bytes) -> None:
        if data:
            record["end"] = (record["end"] + bytes(data))[-64:]
        await write(data)

    async def recording_write_eof(data: bytes = b"") -> None:
        if data:
            record["end"] = (record["end"] + bytes(data))[-64:]
        await write_eof(data)

    response.write = recording_write  # type: ignore[method-assign]
    response.write_eof = recording_write_eof  # type: ignore[method-assign]


def create(section: dict[str, Any], app: web.Application):
    app[CAPTURED] = []
    app.on_response_prepare.append(_record_writes)
    paths = frozenset(section.get("paths") or ["/v1/responses"])

    @web.middleware
    async def capture(request: web.Request, handler):
        if request.method != "POST" or request.path not in paths:
            return await handler(request)
        record: dict[str, Any] = {"path": request.path, "headers": dict(request.headers), "body": None,
                                  "status": None, "end": b""}
        app[CAPTURED].append(record)
        request[_RECORD] = record
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
