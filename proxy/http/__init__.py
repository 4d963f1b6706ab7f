"""The HTTP side: the app and its routes, the request envelope and context, the body, the handler.

Data path: `app` builds the chain (middlewares/) -> `forwarder.handle_responses` -> proxy.protocol
(translate the request, rewrite the stream) over proxy.upstream -> the client."""
