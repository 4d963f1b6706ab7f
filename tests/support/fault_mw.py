"""A test-only middleware that fails after the answer started (tests/http/test_stream_integrity.py).

    middlewares:
      before_handler: [{"tests.support.fault_mw:create": {mode: raise_after}}]

modes:
  raise_after      the handler's answer is whole, then a RuntimeError
  api_error_after  the same with an APIError (a middleware refusing too late)
  own_stream       the middleware prepares an event stream of its own, writes part of an
                   event, then a RuntimeError (no rewriter knows this stream)
  hook_raises      an on_response_prepare hook fails for event streams (before their headers)
  reset_after      the handler's answer is whole, then what a write to a client that hung up
                   raises (aiohttp's ClientConnectionResetError)
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError

from proxy.errors import APIError

MODES = ("raise_after", "api_error_after", "own_stream", "hook_raises", "reset_after")


def create(section: dict[str, Any], app: web.Application):
    mode = section.get("mode")
    if mode not in MODES:
        raise ValueError(f"fault_mw.mode must be one of {MODES}")

    if mode == "hook_raises":
        async def hook(request: web.Request, response: web.StreamResponse) -> None:
            if response.headers.get("Content-Type", "").startswith("text/event-stream"):
                raise RuntimeError("a prepare hook failed")

        app.on_response_prepare.append(hook)

    @web.middleware
    async def fault(request: web.Request, handler):
        if request.method != "POST" or request.path != "/v1/responses":  # a WebSocket handshake passes
            return await handler(request)
        if mode == "hook_raises":
            return await handler(request)
        if mode == "own_stream":
            response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'event: response.created\ndata: {"type": "response.cre')
            raise RuntimeError("failed in the middle of its own stream")
        await handler(request)
        if mode == "reset_after":
            raise ClientConnectionResetError("Cannot write to closing transport")
        if mode == "api_error_after":
            raise APIError(403, "refused too late", code="too_late")
        raise RuntimeError("failed after the handler returned")

    return fault
