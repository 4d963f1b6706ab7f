"""Chat-completions stream -> Responses stream, as a sans-I/O pipeline.

    rw = StreamRewriter(ctx)
    send(rw.start())                       # response.created + response.in_progress
    async for chunk in upstream: send(rw.feed(chunk))   # any byte split
    send(rw.finish())                      # upstream EOF (b"" if [DONE] already ended it)
    # or, on a timeout / reset after the headers went out:
    send(rw.fail("upstream timed out", code="upstream_timeout"))

Every call returns the Responses SSE bytes it produced (possibly b""); once `done` is set
every call returns b"". Inside, four stages, each its own module:

    bytes -> SSEDecoder (sse) -> payloads -> ChunkParser (deltas) -> typed delta events
          -> Assembler (assembler: items, content parts, the output cap, the terminal response)
          -> SSEEncoder (encoder: sequence numbers and bytes)

`response_from_completion` is the non-stream answer: the completion's message as one delta,
through the same assembler, with an encoder that writes nothing; the Response object is the
one the equivalent stream ends with. Another transport passes its own encoder (an
encoder.Encoder: the methods of SSEEncoder, handed proxy.protocol.events objects) and keeps
the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from proxy.protocol.assembler import Assembler
from proxy.protocol.deltas import ChunkParser, completion_events
from proxy.protocol.encoder import Discard, Encoder, SSEEncoder
from proxy.protocol.plain_answer import plain_response
from proxy.protocol.response import ResponseContext, client_usage, map_usage, public_message
from proxy.protocol.sse import MAX_LINE, SSEDecoder

__all__ = ["ResponseContext", "StreamRewriter", "response_from_completion", "completion_response", "map_usage",
           "client_usage", "public_message"]


# A first read this big holds many events: its first two are written on their own (`opening`).
EARLY_WRITE_BYTES = 2048


def early_cut(first: bytes) -> int:
    """Where to split a big first read: after its second event; 0: do not split."""
    if len(first) < EARLY_WRITE_BYTES:
        return 0
    end = first.find(b"\n\n", first.find(b"\n\n") + 2)
    return end + 2 if 0 < end < len(first) - 2 else 0


class StreamRewriter:
    """Upstream chat-completions SSE bytes in, Responses SSE bytes out. Pure; no I/O.

    `runs=False` parses every upstream chunk (no TextRun shortcut: the reference the
    differential tests compare it with)."""

    __slots__ = ("ctx", "_decoder", "_parser", "_encoder", "_asm", "_started")

    def __init__(self, ctx: ResponseContext, *, max_line: int = MAX_LINE, runs: bool = True,
                 encoder: Encoder | None = None) -> None:
        self.ctx = ctx
        self._decoder = SSEDecoder(max_line)
        self._parser = ChunkParser(runs=runs)
        self._encoder: Encoder = encoder if encoder is not None else SSEEncoder()
        self._asm = Assembler(ctx, self._encoder)
        self._started = False

    # What the handler reads back: the answer's state and what it cost.
    done = property(lambda self: self._asm.done)
    status = property(lambda self: self._asm.status)  # in_progress | completed | incomplete | failed
    usage = property(lambda self: self._asm.usage)  # Responses-shaped, only when the upstream reported usage
    output_tokens_seen = property(lambda self: self._asm.output_tokens_seen)
    reasoning_deltas_seen = property(lambda self: self._asm.reasoning_deltas_seen)
    finish_reason = property(lambda self: self._asm.finish_reason)
    capped = property(lambda self: self._asm.capped)  # cut off at the output cap: the connection is not reusable
    response = property(lambda self: self._asm.response)  # the terminal Response once done

    def start(self) -> bytes:
        if self._started or self._asm.done:
            return b""
        self._started = True
        self._asm.start()
        return self._encoder.take()

    def feed(self, data: bytes) -> bytes:
        asm = self._asm
        if asm.done:
            return b""
        if not self._started:
            return self.start() + self.feed(data)
        dec = self._decoder
        payloads = dec.feed(data)
        if payloads:
            asm.feed(self._parser.events(payloads))
        if dec.overflow and not asm.done:
            asm.fail(f"upstream sent a line longer than {dec.max_line} bytes", "server_error", 1000, True)
        return self._encoder.take()

    def opening(self, first: bytes) -> Iterator[tuple[bytes, bool]]:
        """The stream's first events for the upstream's first read, as (bytes, last) writes: the
        last one goes with the next write. A big first read (a server that coalesces its chunks,
        or a client that connected late) has its first two events (vLLM: the role, then the first
        text) rewritten and yielded on their own, so the first delta does not wait for the rest
        to be rewritten; unless that read holds the whole answer (then it is one write)."""
        pending = self.start()
        cut = early_cut(first)
        if cut:
            # The rest is then rewritten in bulk (a TextRun, proxy.protocol.deltas).
            pending += self.feed(first[:cut])
            first = first[cut:]
            if not first.endswith(b"data: [DONE]\n\n"):
                yield pending, False
                pending = b""
        yield pending + self.feed(first), True

    def drain(self) -> bytes:
        """Upstream EOF, before finish(): the events of what the decoder still holds, so the
        caller can tell from `finish_reason` whether the stream was whole."""
        asm = self._asm
        if asm.done or not self._started:
            return b""
        asm.feed(self._parser.events(self._decoder.flush()))
        return self._encoder.take()

    def finish(self) -> bytes:
        asm = self._asm
        if asm.done:
            return b""
        head = b"" if self._started else self.start()
        asm.feed(self._parser.events(self._decoder.flush()))
        asm.end_of_input()
        return head + self._encoder.take()

    def fail(self, message: str, *, code: str = "upstream_error", retry_after_ms: int | None = 1000,
             should_retry: bool = True, verbatim_code: bool = False, usage: dict | None = None) -> bytes:
        """End the stream as response.failed. `verbatim_code` keeps a code outside the SDK's
        closed set (insufficient_quota: what Codex reads as "stop, do not retry"). `usage`: a
        chat-shaped usage the failed response shows (the handler passes what it billed)."""
        if self._asm.done:
            return b""
        head = b"" if self._started else self.start()
        self._asm.fail(message, code, retry_after_ms, should_retry, verbatim_code, usage)
        return head + self._encoder.take()


def response_from_completion(ctx: ResponseContext, completion: Any) -> dict:
    """A non-stream chat.completion -> the Response object the equivalent stream ends with."""
    return completion_response(ctx, completion)[0]


def completion_response(ctx: ResponseContext, completion: Any) -> tuple[dict, dict | None]:
    """response_from_completion, and the completion's usage as reported (map_usage; None
    when it sent none), which the billing reads."""
    plain = plain_response(ctx, completion)
    if plain is not None:
        return plain
    asm = Assembler(ctx, Discard())
    asm.feed(completion_events(completion))
    return asm.response, asm.usage
