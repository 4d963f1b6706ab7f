"""The error envelope as an aiohttp response, and the answer while the ledger cannot serve.

The exception itself (`APIError`, `bad_request`) lives in proxy.errors, below every layer
that raises it; this module is the HTTP side: `error_response` is the one place a refusal
becomes a `web.Response`.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from aiohttp import web

from proxy.errors import APIError
from proxy.ledger.base import FAULT_EXPLAINED

ERROR_CODE = web.ResponseKey("error_code", object)  # the envelope's code, for the access line


def error_response(error: APIError) -> web.Response:
    response = web.Response(
        status=error.status,
        body=orjson.dumps(error.envelope()),
        content_type="application/json",
        headers=error.headers,
    )
    # For the access line: a middleware may answer with this response instead of raising.
    response[ERROR_CODE] = error.code
    return response


def close_if_unread(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """A refusal answered before the request's body was read whole: `Connection: close`, and the
    connection marked closing (`RequestHandler.close()`), so aiohttp drops what the client still
    sends as it arrives, unparsed, instead of draining it through its parser, and closes once
    the client is done or its lingering time is over. Closing at once would cut off a client
    still sending before it reads its refusal (the OpenAI SDK then reports a connection error,
    and retries); keeping the connection would leave a keep-alive client's next request behind
    a body nobody reads. A transport's turn shares its socket's connection: left alone."""
    if not request.content.is_eof() and not response.prepared:
        response.force_close()
        request.protocol.close()
    return response


def ledger_unavailable(exc: Any) -> APIError:
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
