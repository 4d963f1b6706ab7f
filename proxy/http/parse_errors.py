"""Errors raised by aiohttp's HTTP parser, before any middleware runs (a header line past
`max_field_size`, a malformed request line), answered in the OpenAI envelope too.

aiohttp builds those answers in `RequestHandler.handle_error` as text/plain and quotes the
offending bytes; this subclass answers JSON, never echoes the client's bytes, and says 431
for oversized headers. It is installed for the servers this process starts.
"""

from __future__ import annotations

from aiohttp import web_protocol, web_server
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from proxy.http.errors import APIError


class EnvelopeRequestHandler(web_protocol.RequestHandler):
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None):
        if request.writer.output_size > 0:  # an answer is already on the wire
            return super().handle_error(request, status, exc, message)
        if isinstance(exc, LineTooLong):
            error = APIError(431, "A request header or the request line is too large.",
                             code="request_header_too_large")
        elif isinstance(exc, BadHttpMessage) or 400 <= status < 500:
            error = APIError(status if 400 <= status < 500 else 400, "The HTTP request is malformed.",
                             code="bad_http_request")
        else:
            return super().handle_error(request, status, exc, message)
        self.log_debug("refused a malformed request from %s: %r", request.remote, exc)
        response = error.to_response()
        response.force_close()  # the parser state is unknown after a broken message
        return response


def install() -> None:
    # aiohttp has no public hook for this: web.Server, web.AppRunner and web.run_app take no
    # request-handler class or protocol factory, and parser errors never reach middlewares or
    # the app. web.Server.__call__ instantiates the module-level name web_server.RequestHandler,
    # so the name is swapped (process-wide, idempotent; the subclass only changes the error
    # answers). tests/test_hostile.py::test_a_malformed_request_line_is_a_400_envelope_that_echoes_nothing
    # and ::test_limits_answer_clear_4xx (431) pin the behaviour.
    if web_server.RequestHandler is not EnvelopeRequestHandler:
        web_server.RequestHandler = EnvelopeRequestHandler


__all__ = ["EnvelopeRequestHandler", "install"]
