"""A passed-through answer read for its bill: each event parsed once, its bytes passed on as they came.

`SSEScanner.feed(data)` frames the stream by the SSE spec (an event ends at a blank line; its
`data:` lines joined; `data: [DONE]` ends an OpenAI stream only as an event's whole data, never
as text inside a delta), parses each event's data once (orjson), and returns the bytes of the
whole events to pass on (a partial event waits for its end). On the way it keeps what billing
needs: the usage reported (OpenAI's usage chunk, or Anthropic's message_start / message_delta),
the output deltas counted per answer (each carried at least one token: a lower bound; Anthropic's
signature_delta, which closes a thinking block, and empty deltas carry none), and whether the
stream ended. An event whose delta takes an answer past the output cap is not passed on, nor
anything after it (`capped`): the cut is at that event, not after the read that held it.
When the edge added `stream_options.include_usage`, the usage chunk (no choices) is not passed
on: its bytes are cut out, the others go on as they came.

`json_usage(family, body)` reads a whole JSON answer's usage, `json_output(family, body)` what
its answers wrote (for a count when the usage cannot be read). Both give Responses-shaped usage
(proxy.protocol.response.map_usage), unchecked: proxy.ledger.usage.clean_usage checks it.
"""

from __future__ import annotations

import re
from itertools import repeat
from operator import and_, itemgetter
from typing import Any

import orjson

from proxy.protocol.deltas import NOT_PLAIN, RESTARTS, RUN_MIN
from proxy.protocol.response import map_usage

MAX_EVENT_BYTES = 4 * 1024 * 1024  # one event longer than this is an upstream fault (an endless line)
_OPENAI_TEXT = ("content", "reasoning_content", "reasoning")
_ANTHROPIC_TEXT = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}


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


_USAGE_IN_TAIL = re.compile(rb'"usage"\s*:\s*(\{(?:[^{}]|\{[^{}]*\})*\})')


def usage_in_tail(tail: bytes) -> dict | None:
    """The usage object nearest the end of an answer's last bytes (an answer too large to read
    whole), Responses-shaped: OpenAI's fields or Anthropic's; None when none can be read."""
    objects = _USAGE_IN_TAIL.findall(tail)
    if not objects:
        return None
    try:
        usage = orjson.loads(objects[-1])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(usage, dict):
        return None
    return anthropic_usage(usage) if "input_tokens" in usage else map_usage(usage)


def _call_texts(calls: Any) -> list[str]:
    out: list[str] = []
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            out.extend(v for v in (function.get("name"), function.get("arguments")) if isinstance(v, str))
    return out


def json_output(family: str, answer: Any) -> tuple[str, int]:
    """(every text the answers of a JSON answer wrote, how many answers wrote any)."""
    texts: list[str] = []
    written = 0
    if not isinstance(answer, dict):
        return "", 0
    if family in ("messages", "messages_count"):
        for block in answer.get("content") or ():
            if isinstance(block, dict):
                value = block.get("text") or block.get("thinking") or block.get("input")
                if value:
                    texts.append(value if isinstance(value, str) else orjson.dumps(value).decode())
        return "".join(texts), 1 if texts else 0
    for choice in answer.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if family == "completions":
            found = [choice["text"]] if isinstance(choice.get("text"), str) and choice["text"] else []
        else:
            message: dict = choice["message"] if isinstance(choice.get("message"), dict) else {}
            found = [message[k] for k in _OPENAI_TEXT if isinstance(message.get(k), str) and message[k]]
            found += _call_texts(message.get("tool_calls"))
        texts.extend(found)
        written += 1 if found else 0
    return "".join(texts), written


def _event_data(event: bytes) -> tuple[bytes | None, bytes | None]:
    """(the event's type, its data lines joined) by the SSE spec; None: no such field."""
    if event.startswith(b"data:"):
        end = event.find(b"\n")
        if (end < 0 or end >= len(event) - 2) and b"\r" not in event:  # one data line (and its blank line)
            data = event[5:end] if end >= 0 else event[5:]
            return None, data[1:] if data.startswith(b" ") else data
    kind = None
    lines: list[bytes] = []
    for line in event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
        name, colon, value = line.partition(b":")
        if not colon or not name:
            continue  # a comment (":..."), or a field without a value
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            lines.append(value)
        elif name == b"event":
            kind = value
    return kind, b"\n".join(lines) if lines else None


def _boundary(buf: bytes) -> int:
    """The end of the last whole event in `buf` (past its blank line); -1: none."""
    if b"\r" not in buf:
        end = buf.rfind(b"\n\n")
        return end + 2 if end >= 0 else -1
    best = -1
    for sep in (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n"):
        at = buf.rfind(sep)
        if at >= 0:
            best = max(best, at + len(sep))
    return best


def _events(out: bytes) -> list[tuple[int, int]]:
    """(start, end) of each event of `out` (whole events), end past its blank line."""
    if b"\r" in out:
        spans, at, n = [], 0, len(out)
        i = 0
        while i < n:
            # a line ends at \r\n, \n or \r; a blank line ends the event
            j = i
            while j < n and out[j] not in (10, 13):
                j += 1
            k = j + 2 if out[j:j + 2] == b"\r\n" else j + 1
            if j == i:  # a blank line
                if i > at:
                    spans.append((at, k))
                at = k
            i = k
        if at < n:
            spans.append((at, n))
        return spans
    spans, at = [], 0
    while True:
        end = out.find(b"\n\n", at)
        if end < 0:
            if out[at:].strip():
                spans.append((at, len(out)))
            return spans
        if end > at:
            spans.append((at, end + 2))
        at = end + 2
        while out.startswith(b"\n", at):  # blank lines beyond the one that ended the event
            at += 1


class SSEScanner:
    __slots__ = ("anthropic", "completions", "drop_usage", "cap", "tail", "usage", "counted", "per_answer",
                 "completed", "finished", "capped", "runs", "_raw", "_held", "_head", "_tail", "_cut", "_index")

    def __init__(self, family: str, drop_usage: bool, cap: int | None = None, *, runs: bool = True) -> None:
        self.anthropic = family == "messages"
        self.completions = family == "completions"
        self.drop_usage = drop_usage
        self.cap = cap  # the most output deltas one answer may have; past it the stream is cut
        self.tail = b""
        self.usage: dict | None = None  # Responses-shaped
        self.counted = 0  # output deltas, every answer's
        self.per_answer: dict[int, int] = {}
        self.completed = False  # the terminal event was seen
        self.finished = False  # a finish_reason / stop_reason was seen
        self.capped = False  # an answer went past the cap: the stream was cut there
        self._raw: dict = {}  # Anthropic: the usage fields seen so far, merged
        self._held: list[bytes] = []  # terminal chunks waiting for the usage chunk's fingerprint
        self.runs = runs  # False: every event parsed (the reference the fast path is held to)
        # A plain text chunk's bytes up to its string's opening quote and from its closing one
        # (without the blank line), learned from a parsed one; its cut and its answer's index.
        self._head: bytes | None = None
        self._tail = b""
        self._cut = (0, 0)
        self._index = 0

    @property
    def done(self) -> bool:
        """Nothing more is to be read: the stream ended, or was cut at the cap."""
        return self.completed or self.capped

    def feed(self, data: bytes) -> bytes:
        """The whole events of tail + data to pass on; the rest waits. ValueError: an endless event."""
        buf = self.tail + data if self.tail else data
        end = _boundary(buf)
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
        out = self._scan(rest) if rest.strip() else rest
        return self._release(None) + out if self._held else out

    def _scan(self, out: bytes) -> bytes:
        """The events of `out` to pass on: all of them as they came, but a withheld usage chunk,
        whatever follows a cut or the end, and a terminal chunk held for its fingerprint."""
        if b"\r" in out:
            return self._scan_spans(out)
        pieces = out.split(b"\n\n")
        if not pieces[-1]:
            pieces.pop()  # out ends with the blank line of its last event (flush's may not)
        n = len(pieces)
        head = self._head
        flags = self._flags(pieces, 0) if head is not None and n >= RUN_MIN else None
        restarts = RESTARTS
        parts: list[bytes] | None = None  # None: every byte of `out`
        i = 0
        while i < n:
            if self.completed or self.capped:
                if parts is None:
                    parts = [b"\n\n".join(pieces[:i]) + b"\n\n"] if i else []
                break
            if self._head is not head:  # a chunk parsed on the way taught another shape
                head = self._head
                flags = None
                if head is not None and n - i >= RUN_MIN and restarts:
                    restarts -= 1
                    flags = self._flags(pieces, i)
            if flags is not None and flags[i] and not self._held:
                j = flags.index(False, i)
                if self._run(pieces, i, j):
                    if parts is not None:
                        parts.append(b"\n\n".join(pieces[i:j]) + b"\n\n")
                    i = j
                    continue
            event = pieces[i] + b"\n\n"
            emitted = self._event(event)
            if emitted is not event:
                if parts is None:
                    parts = [b"\n\n".join(pieces[:i]) + b"\n\n"] if i else []
                parts.append(emitted)
            elif parts is not None:
                parts.append(event)
            i += 1
        if self.capped and self._held:
            parts = [out] if parts is None else parts
            parts.append(self._release(None))
        return out if parts is None else b"".join(parts)

    def _flags(self, pieces: list[bytes], start: int) -> list[bool]:
        """Which pieces (from `start` on; the ones before: False) have the learned shape."""
        head, tail = self._head, self._tail
        assert head is not None
        rest = pieces[start:] if start else pieces
        flags = list(map(and_, map(bytes.startswith, rest, repeat(head)), map(bytes.endswith, rest, repeat(tail))))
        if start:
            flags[:0] = [False] * start
        flags.append(False)  # the end: every run stops there
        return flags

    def _run(self, pieces: list[bytes], i: int, j: int) -> bool:
        """pieces[i:j] are the learned text chunk's bytes around other strings: when every one
        is a plain non-empty string (what the JSON writer leaves as it is) and the answer's cap
        holds them all, they are counted as the chunks they are, without a parse each (the
        differential test holds this to parsing every one). False: parse them one by one."""
        hl, tl = self._cut
        texts = list(map(itemgetter(slice(hl, -tl)), pieces[i:j]))
        if not all(texts) or NOT_PLAIN.search(b"".join(texts)) is not None:
            return False
        index = self._index
        seen = self.per_answer.get(index, 0) + (j - i)
        if self.cap is not None and seen > self.cap:
            return False  # the cut is inside the run: found event by event
        self.per_answer[index] = seen
        self.counted += j - i
        return True

    def _learn(self, event: bytes, key: bytes, text: str, index: int) -> None:
        """Keep the bytes around the string of a chunk that carried only that text (plain, and
        there once): a run of chunks of that shape is counted without a parse each (_run)."""
        if not self.runs:
            return
        enc = orjson.dumps(text)
        if NOT_PLAIN.search(enc, 1, len(enc) - 1) is not None:
            return
        body = event.rstrip(b"\r\n")
        needle = key + enc
        at = body.find(needle)
        if at < 0 or body.find(needle, at + 1) >= 0:
            return
        cut = at + len(key) + 1
        self._head, self._tail = body[:cut], body[cut + len(enc) - 2:]
        self._cut, self._index = (cut, len(self._tail)), index

    def _scan_spans(self, out: bytes) -> bytes:
        """_scan for events framed with CR or CRLF line ends (no server seen sends them)."""
        parts: list[bytes] | None = None
        for start, end in _events(out):
            if self.completed or self.capped:
                if parts is None:
                    parts = [out[:start]]
                break
            event = out[start:end]
            emitted = self._event(event)
            if emitted is event:
                if parts is not None:
                    parts.append(event)
                continue
            if parts is None:
                parts = [out[:start]]
            parts.append(emitted)
        if self.capped and self._held:
            parts = [out] if parts is None else parts
            parts.append(self._release(None))
        return out if parts is None else b"".join(parts)

    def _release(self, fingerprint: Any) -> bytes:
        """The terminal chunks held back, with the fingerprint vLLM would have put on them had
        the edge not asked for the usage chunk that carried it (written into their bytes)."""
        held, self._held = self._held, []
        if not isinstance(fingerprint, str):
            return b"".join(held)
        stamp = b',"system_fingerprint":' + orjson.dumps(fingerprint) + b"}"
        out = []
        for event in held:
            body = event.rstrip(b"\r\n")
            out.append(body[:-1] + stamp + event[len(body):] if body.endswith(b"}") else event)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        """Read one event; -> the bytes to pass on for it (`event` itself when passed as it came)."""
        _, data = _event_data(event)
        if data is None:
            return event  # a comment or a keep-alive
        if not self.anthropic and data == b"[DONE]":
            self.completed = True
            return self._release(None) + event if self._held else event
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return event  # not ours to judge: passed on as it came
        if not isinstance(obj, dict):
            return event
        if self.anthropic:
            return event if self._anthropic(obj, event) else b""
        return self._openai(obj, event)

    def _count(self, index: Any) -> bool:
        """One more delta of answer `index`; False when it takes the answer past the cap."""
        index = index if type(index) is int else 0
        seen = self.per_answer.get(index, 0) + 1
        if self.cap is not None and seen > self.cap:
            self.capped = True
            return False
        self.per_answer[index] = seen
        self.counted += 1
        return True

    def _openai(self, obj: dict, event: bytes) -> bytes:
        choices = obj.get("choices")
        ended = False
        learn = None  # (key, text, index) of a chunk of one plain text delta: its shape is learned
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                if self._wrote(choice):
                    if not self._count(choice.get("index")):
                        return b""
                    if len(choices) == 1:
                        learn = self._plain(choice)
                if isinstance(choice.get("finish_reason"), str):
                    self.finished = ended = True
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = map_usage(usage)
            if self.drop_usage and not choices:
                return self._release(obj.get("system_fingerprint"))
        if learn is not None and not ended and usage is None and (self._head is None
                                                                   or not event.startswith(self._head)):
            self._learn(event, learn[0], learn[1], learn[2])
        if self.drop_usage:
            if ended and "system_fingerprint" not in obj:
                # vLLM stamps its fingerprint on the terminal chunk when the client asked for no
                # usage, on the usage chunk when it did: held until that chunk says it.
                self._held.append(event)
                return b""
            if self._held:
                return self._release(None) + event
        return event

    def _plain(self, choice: dict) -> tuple[bytes, str, int] | None:
        """(its key, its text, its index) when a choice is one text delta and nothing else."""
        index = choice.get("index")
        if type(index) is not int:
            return None
        if self.completions:
            text = choice.get("text")
            return (b'"text":', text, index) if isinstance(text, str) and text else None
        delta = choice.get("delta")
        if isinstance(delta, dict) and len(delta) == 1:
            text = delta.get("content")
            if isinstance(text, str) and text:
                return b'"content":', text, index
        return None

    def _wrote(self, choice: dict) -> bool:
        if self.completions:
            text = choice.get("text")
            return isinstance(text, str) and text != ""
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return False
        for key in _OPENAI_TEXT:
            value = delta.get(key)
            if isinstance(value, str) and value:
                return True
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str) \
                        and function["arguments"]:
                    return True
        return False

    def _anthropic(self, obj: dict, event: bytes) -> bool:
        kind = obj.get("type")
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if not isinstance(delta, dict):
                return True
            key = _ANTHROPIC_TEXT.get(delta.get("type"))  # type: ignore[arg-type]  # any value: a miss is None
            if key is None or not isinstance(delta.get(key), str) or not delta[key]:
                return True
            if not self._count(0):
                return False
            if self._head is None or not event.startswith(self._head):
                self._learn(event, b'"' + key.encode() + b'":', delta[key], 0)
            return True
        usage = None
        if kind == "message_start" and isinstance(obj.get("message"), dict):
            usage = obj["message"].get("usage")
        elif kind == "message_delta":
            usage = obj.get("usage")
            delta = obj.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self.finished = True
        elif kind == "message_stop":
            self.completed = True
        if isinstance(usage, dict):
            self._raw.update({k: v for k, v in usage.items() if v is not None})
            self.usage = anthropic_usage(self._raw)
        return True
