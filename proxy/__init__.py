"""responses-proxy: a stateless OpenAI Responses API in front of chat-completions servers.

Data path: request -> middlewares/ (the chain in config.yaml) -> proxy.http.forwarder
(handler, the only I/O) -> proxy.protocol.rewriter (sans-I/O SSE state machine) -> client.
"""

__version__ = "0.1.0"
