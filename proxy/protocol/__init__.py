"""The protocol cores, sans-I/O: dicts or bytes in, dicts or bytes out, no sockets.

`translate` (Responses request -> chat request), `sse` (bytes -> SSE events), `rewriter` (chat
chunks -> Responses events), `dialects` (what vLLM and SGLang each expect), `seal` (reasoning carried
encrypted across turns), `ids`."""
