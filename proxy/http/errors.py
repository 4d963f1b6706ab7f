"""The OpenAI error envelope, and the one exception type that carries it.

Every refusal anywhere in the proxy raises `APIError`; a single middleware turns it
into `{"error": {"message", "type", "param", "code"}}` with the right status, so no
code path can answer with a bare 500 or an HTML page.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from aiohttp import web

from proxy.ledger.base import FAULT_EXPLAINED

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


ERROR_CODE = web.ResponseKey("error_code", object)  # the envelope's code, for the access line


def ledger_unavailable(exc: Any) -> "APIError":
    """The answer while the ledger cannot serve (proxy.ledger.LedgerUnavailable): 503 with
    Retry-After, never a 500; the client retries, nothing was held or billed. A LedgerFault
    (a wrong password, a missing table: the operator must act) is `ledger_fault`, its cause
    named in words (never the database's address or its own message)."""
    seconds = max(1, math.ceil(getattr(exc, "retry_after_s", 5.0)))
    headers = {"Retry-After": str(seconds)}
    cause = getattr(exc, "cause", None)
    if cause is not None:
        what = FAULT_EXPLAINED.get(cause, "the ledger database has a fault")
        return APIError(503, f"The billing ledger has a fault its operator must fix: {what}. Retry later.",
                        code="ledger_fault", headers=headers)
    return APIError(503, "The billing ledger is unreachable right now; retry after the Retry-After delay.",
                    code="ledger_unavailable", headers=headers)


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

    def to_response(self) -> web.Response:
        response = web.Response(
            status=self.status,
            body=orjson.dumps(self.envelope()),
            content_type="application/json",
            headers=self.headers,
        )
        # For the access line: a middleware may answer with this response instead of raising.
        response[ERROR_CODE] = self.code
        return response


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
