"""The one exception type every refusal raises, and the OpenAI error envelope it carries.

Every refusal anywhere in the proxy raises `APIError`; a single middleware turns it into
`{"error": {"message", "type", "param", "code"}}` with the right status (proxy.http.errors
builds that response), so no code path can answer with a bare 500 or an HTML page. This
module imports no HTTP server: the translation and the policy rules raise it too.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_type_for(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


# The code of a refusal raised without one of its own. Every error carries a string code, on
# HTTP as over the WebSocket (whose error event requires one): the same refusal reads the same
# on both transports.
_CODES = {400: "invalid_request", 401: "invalid_api_key", 402: "insufficient_quota", 403: "forbidden",
          404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 409: "conflict",
          413: "request_too_large", 415: "unsupported_media_type", 429: "rate_limit_exceeded"}


def default_code(status: int) -> str:
    return _CODES.get(status, "server_error" if status >= 500 else "invalid_request")


class APIError(Exception):
    """An answer in the OpenAI error envelope. `headers` lets 429 carry Retry-After; a refusal
    without a `code` of its own gets its status's (`default_code`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code if code is not None else default_code(status)
        self.param = param
        self.type = type or error_type_for(status)
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
