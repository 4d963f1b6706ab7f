"""The protocol cores, sans-I/O: dicts or bytes in, dicts or bytes out, no sockets.

`translate` (Responses request -> chat request), `rewriter` (chat chunks -> Responses events: a
facade over `sse` (bytes -> SSE payloads), `deltas` (payloads -> typed delta events),
`assembler` (the output items' state machine) and `encoder` (sequence numbers and bytes)),
`response` (the Response object, usage), `dialects` (what vLLM and SGLang each expect), `seal`
(reasoning carried encrypted across turns), `ids`."""
