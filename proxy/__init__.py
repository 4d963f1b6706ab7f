"""responses-proxy: a stateless OpenAI Responses API in front of chat-completions servers.

Data path: request -> the fixed phases (middlewares/: auth, limits, prepare, balance) ->
proxy.http.responses_handler (handler, the upstream I/O) -> proxy.protocol.rewriter (sans-I/O) -> client.
docs/DESIGN.md draws the map.
"""

__version__ = "0.1.0"
