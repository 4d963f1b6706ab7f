"""The HTTP side: the app and its routes, the envelope, the prepare phase (the body), the handler.

Data path: `app`'s envelope -> the phases (middlewares/) -> `responses.responses_handler` ->
proxy.protocol (translate the request, rewrite the stream) over proxy.upstream -> the client."""
