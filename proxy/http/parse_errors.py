"""Errors raised by aiohttp's HTTP parser, before any middleware runs (a header line past
`max_field_size`, a malformed request line), answered in the OpenAI envelope too.

aiohttp builds those answers in `RequestHandler.handle_error` as text/plain and quotes the
offending bytes; `EnvelopeRequestHandler` answers JSON, never echoes the client's bytes, and
says 431 for oversized headers. `ProxyRunner` (a web.AppRunner) gives the proxy's own
connections that handler, and only them: any other aiohttp server in the process (the embedded
simulator, a test's upstream) keeps aiohttp's answers.

No public hook exists for this: parser errors never reach the app, its middlewares or its
on_response_prepare signal, and web.Server, web.AppRunner and web.run_app take no
request-handler class or protocol factory. So `ProxyRunner` implements BaseRunner's
`_make_server` (the method aiohttp's own runners implement) by letting AppRunner make the
app's web.Server as usual and making its connections `EnvelopeRequestHandler`s: the subclass
adds no state (`__slots__ = ()`) and only replaces the public `handle_error`. Pinned by
tests/test_hostile.py::test_a_malformed_request_line_is_a_400_envelope_that_echoes_nothing,
::test_limits_answer_clear_4xx (431) and
::test_only_the_proxys_own_connections_answer_parser_errors_in_the_envelope.
"""

from __future__ import annotations

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from proxy.http.errors import APIError


class EnvelopeRequestHandler(web_protocol.RequestHandler):
    __slots__ = ()  # the layout of aiohttp's RequestHandler: see _EnvelopeServer

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


class _EnvelopeServer(web.Server):
    """The app's web.Server whose connections are EnvelopeRequestHandlers. web.Server builds
    each connection's handler itself (its __call__ is the protocol factory the sites listen
    with); the handler it builds, with every handler_args, becomes the subclass, which has the
    same slots and so the same layout."""

    def __call__(self) -> web_protocol.RequestHandler:
        handler = super().__call__()
        handler.__class__ = EnvelopeRequestHandler
        return handler


class ProxyRunner(web.AppRunner):
    """web.AppRunner for the proxy's app: the same lifecycle (startup, cleanup contexts,
    shutdown), and parser errors answered in the envelope (module docstring: why this way)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _EnvelopeServer  # adds no state: only its protocol factory differs
        return server


__all__ = ["EnvelopeRequestHandler", "ProxyRunner"]
