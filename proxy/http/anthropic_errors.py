"""Anthropic's error envelope on the /v1/messages routes: {"type": "error", "error": {"type", "message"}}.

Every refusal is made once, as an APIError in the OpenAI envelope (proxy.http.errors); on a unit
of the Anthropic family (proxy.units: MESSAGES, MESSAGES_COUNT) the envelope
(proxy.app) dresses the answer in Anthropic's instead, with the same status and headers,
so the anthropic SDK raises its own typed errors (AuthenticationError, RateLimitError, ...).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from proxy.http.errors import ERROR_CODE

# status -> Anthropic's error type (docs.anthropic.com, "Errors")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
          403: "permission_error", 404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
          429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error",
          504: "timeout_error", 529: "overloaded_error"}


NO_RETRY = frozenset({400, 401, 402, 403, 404, 405, 413})  # refusals a retry cannot fix


def anthropic_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def dress(response: web.StreamResponse) -> web.StreamResponse:
    """An OpenAI-envelope error response as Anthropic's (others are returned as they are)."""
    if response.get(ERROR_CODE) is None or not isinstance(response, web.Response) or response.prepared:
        return response
    try:
        error = orjson.loads(response.body)["error"]  # type: ignore[arg-type]  # bytes, or not ours: left alone below
        message = str(error.get("message") or "")
    except Exception:  # not our envelope: left alone
        return response
    body = {"type": "error", "error": {"type": anthropic_type(response.status), "message": message}}
    dressed = web.Response(status=response.status, body=orjson.dumps(body), content_type="application/json",
                           headers={k: v for k, v in response.headers.items()
                                    if k.lower() not in ("content-type", "content-length")})
    dressed[ERROR_CODE] = response[ERROR_CODE]
    if response.keep_alive is False:
        dressed.force_close()  # a refusal before the body was read: its Connection: close stays
    if response.status in NO_RETRY:
        # The anthropic SDK (and Claude Code) retry a 401 and others unless told not to: a
        # revoked key would be asked for 11 times over 176 s before the user hears of it.
        dressed.headers["x-should-retry"] = "false"
    return dressed
