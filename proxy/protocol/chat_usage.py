"""The usage in a passed-through answer: read from the bytes, never re-encoded.

`SSEScanner.feed(data)` returns the bytes to pass on (whole events only: a partial event waits
for its end) and keeps what billing needs: the usage reported (OpenAI's usage chunk, or
Anthropic's message_start / message_delta), the output deltas counted (each carried at least
one token: a lower bound), and whether the stream ended (`data: [DONE]`, `message_stop`).
Only the events that mention usage are parsed, found by byte searches (never a split of the
whole read: a coalesced read holds a hundred events); the rest cost a few byte searches per read.
When the edge added `stream_options.include_usage`, the usage chunk (no choices) is not passed on:
its bytes are cut out, the others go on as they came.

`json_usage(family, body)` reads a whole JSON answer's usage. Both give Responses-shaped usage
(proxy.protocol.response.map_usage), unchecked: proxy.ledger.usage.clean_usage checks it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from proxy.protocol.response import map_usage

MAX_EVENT_BYTES = 4 * 1024 * 1024  # one event longer than this is an upstream fault (an endless line)
# Deltas that carry text (an empty one carried no token): (key, its empty form)
_OPENAI_TEXT = ((b'"content":"', b'"content":""'), (b'"reasoning_content":"', b'"reasoning_content":""'),
                (b'"reasoning":"', b'"reasoning":""'), (b'"arguments":"', b'"arguments":""'))
_COMPLETION_TEXT = ((b'"text":"', b'"text":""'),)


def anthropic_usage(u: Any) -> dict:
    """Anthropic usage -> Responses usage (input includes the cache reads and writes)."""
    if not isinstance(u, dict):
        return map_usage({})
    inp: Any = u.get("input_tokens")  # unchecked until the line below
    read, made = u.get("cache_read_input_tokens") or 0, u.get("cache_creation_input_tokens") or 0
    if all(type(v) is int and v >= 0 for v in (inp, read, made)):
        total = inp + read + made
    else:
        total, read = inp, 0  # not a count: the ledger replaces it
    return map_usage({"prompt_tokens": total, "completion_tokens": u.get("output_tokens"),
                      "prompt_tokens_details": {"cached_tokens": read}})


def json_usage(family: str, answer: Any) -> dict | None:
    if not isinstance(answer, dict) or not isinstance(answer.get("usage"), dict):
        return None
    if family in ("messages", "messages_count"):
        return anthropic_usage(answer["usage"])
    usage = dict(answer["usage"])
    if family == "embeddings":
        usage.setdefault("completion_tokens", 0)
    return map_usage(usage)


def _events_with(out: bytes, key: bytes) -> Iterator[tuple[int, int]]:
    """(start, end) of each whole event of `out` (whole events, as feed cuts them) that holds
    `key`; end is past the blank line that ends it (\n\n or \r\n\r\n)."""
    at = out.find(key)
    while at >= 0:
        lf, crlf = out.rfind(b"\n\n", 0, at), out.rfind(b"\r\n\r\n", 0, at)
        start = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        lf, crlf = out.find(b"\n\n", at), out.find(b"\r\n\r\n", at)
        if lf < 0 and crlf < 0:
            end = len(out)  # the last event of a stream that ended without its blank line
        else:
            end = min(lf + 2 if lf >= 0 else len(out), crlf + 4 if crlf >= 0 else len(out))
        yield start, end
        at = out.find(key, end)


class SSEScanner:
    __slots__ = ("anthropic", "drop_usage", "tail", "usage", "counted", "done", "finished", "_text", "_raw")

    def __init__(self, family: str, drop_usage: bool) -> None:
        self.anthropic = family == "messages"
        self.drop_usage = drop_usage
        self.tail = b""
        self.usage: dict | None = None  # Responses-shaped
        self.counted = 0
        self.done = False  # the terminal event was seen
        self.finished = False  # a finish_reason / stop_reason was seen
        self._text = _COMPLETION_TEXT if family == "completions" else _OPENAI_TEXT
        self._raw: dict = {}  # Anthropic: the usage fields seen so far, merged

    def feed(self, data: bytes) -> bytes:
        """The whole events of tail + data to pass on; the rest waits. ValueError: an endless event."""
        buf = self.tail + data if self.tail else data
        end = buf.rfind(b"\n\n")
        alt = buf.rfind(b"\r\n\r\n")
        end = max(end + 2 if end >= 0 else -1, alt + 4 if alt >= 0 else -1)
        if end < 0:
            if len(buf) > MAX_EVENT_BYTES:
                raise ValueError("an event longer than the bound")
            self.tail = buf
            return b""
        out, self.tail = buf[:end], buf[end:]
        if len(self.tail) > MAX_EVENT_BYTES:
            raise ValueError("an event longer than the bound")
        return self._scan(out)

    def flush(self) -> bytes:
        """At the end of the upstream body: what is left (an unterminated last event), scanned."""
        rest, self.tail = self.tail, b""
        return self._scan(rest) if rest.strip() else rest

    def _scan(self, out: bytes) -> bytes:
        if self.anthropic:
            self.counted += out.count(b'"content_block_delta"')
            if b'"usage"' in out:
                self._anthropic_usage(out)
            if b'"stop_reason":"' in out:
                self.finished = True
            if b'"message_stop"' in out:
                self.done = True
            return out
        for key, empty in self._text:
            n = out.count(key)
            if n:
                self.counted += n - out.count(empty)
        if b'"finish_reason":"' in out:
            self.finished = True
        if b'"usage":{' in out:
            out = self._openai_usage(out)
        if b"data: [DONE]" in out:
            self.done = True
        return out

    @staticmethod
    def _data(event: bytes) -> Any:
        for line in event.splitlines():
            if line.startswith(b"data:"):
                try:
                    return orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    return None
        return None

    def _openai_usage(self, out: bytes) -> bytes:
        cut: list[tuple[int, int]] = []
        for start, end in _events_with(out, b'"usage":{'):
            obj = self._data(out[start:end])
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = map_usage(obj["usage"])
                if self.drop_usage and not obj.get("choices"):
                    cut.append((start, end))
        if not cut:
            return out
        parts, at = [], 0
        for start, end in cut:  # the usage chunk's bytes, its blank line with them
            parts.append(out[at:start])
            at = end
        parts.append(out[at:])
        return b"".join(parts)

    def _anthropic_usage(self, out: bytes) -> None:
        for start, end in _events_with(out, b'"usage"'):
            obj = self._data(out[start:end])
            if not isinstance(obj, dict):
                continue
            usage = obj.get("usage")
            if usage is None and isinstance(obj.get("message"), dict):
                usage = obj["message"].get("usage")  # message_start
            if isinstance(usage, dict):
                self._raw.update({k: v for k, v in usage.items() if v is not None})
                self.usage = anthropic_usage(self._raw)
