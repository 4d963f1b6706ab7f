"""Upstream chat-completions chunks -> typed delta events (sans-I/O).

Each SSE payload is parsed once (orjson) and becomes, in order:
  Usage            the chunk's usage (continuous usage stats: every chunk may carry one)
  OUTPUT_TOKEN     the chunk's delta carries output: the events after it are one output
                   token (what the output cap counts, and what is billed when the upstream
                   reports no usage)
  Reasoning, Text  the delta's reasoning text (vLLM `reasoning`, SGLang `reasoning_content`),
                   then its content
  ToolCallFragment one per tool_calls[] entry (arguments already text)
  Finish           the choice's finish_reason
or UpstreamError (an error object), Invalid (not JSON, not an object, a field of the wrong
type), END ([DONE]). Only the first choice (index 0) is read: n > 1 answers the first.

A non-stream chat.completion is the same events for its message taken as one delta
(`completion_events`), so both answers go through one assembler.

The one fast path (TextRun): a coalescing server sends many chunks in one read, and text
chunks differ from each other only in their content string. Once a plain text chunk has
been seen, a run of payloads that are its bytes around another plain string (ASCII, no
quote, backslash or control character: what orjson writes unchanged) becomes one TextRun
of those strings without parsing each, and is written with one join. The per-chunk case
(one chunk per read) is always parsed: there the shortcut saves too little to be kept
(bench/results.md, Design measurements).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import repeat
from operator import and_, itemgetter
from typing import Any

import orjson

from proxy.protocol.response import ERROR_CODES

__all__ = ["Text", "Reasoning", "ToolCallFragment", "Finish", "Usage", "UpstreamError", "Invalid", "TextRun",
           "OutputToken", "End", "OUTPUT_TOKEN", "END", "Delta", "ChunkParser", "chunk_events", "completion_events"]


@dataclass(slots=True)
class Text:
    text: str  # non-empty


@dataclass(slots=True)
class Reasoning:
    text: str  # non-empty


@dataclass(slots=True)
class ToolCallFragment:
    index: int | None  # the upstream's tool_calls index, when it sent one
    id: str | None
    name: str | None  # None until the upstream names the call
    arguments: str | None


@dataclass(slots=True)
class Finish:
    reason: str


@dataclass(slots=True)
class Usage:
    usage: dict  # the chunk's chat usage as sent; the assembler maps the last one (map_usage) when read


@dataclass(slots=True)
class UpstreamError:
    message: str
    code: str  # Responses error code (server_error when the upstream's is not one)
    retry_after_ms: int | None
    should_retry: bool


@dataclass(slots=True)
class Invalid:
    message: str


@dataclass(slots=True)
class TextRun:
    """Several text chunks in a row, each one output token: their content strings as JSON
    string bodies (plain, so equal to the text), in order."""
    texts: list[bytes]


class OutputToken:
    __slots__ = ()


class End:
    __slots__ = ()


OUTPUT_TOKEN = OutputToken()
END = End()

Delta = Text | Reasoning | ToolCallFragment | Finish | Usage | UpstreamError | Invalid | TextRun | OutputToken | End

_DONE = b"[DONE]"
_RUN_MIN = 4  # payloads in a read before runs of text chunks are looked for
_RESTARTS = 4  # times a read's runs are looked for again after a new shape was learned
# A byte other than these in a content string (a quote, a backslash, a control character,
# non-ASCII: orjson would write the string otherwise) keeps its chunk out of a run.
_NOT_PLAIN = re.compile(rb"[^\x20\x21\x23-\x5b\x5d-\x7f]")
# For the pass-through's scanner (proxy.protocol.chat_usage), which counts runs the same way:
NOT_PLAIN = _NOT_PLAIN  # a byte a JSON writer would not leave as it is in a string (or non-ASCII)
RUN_MIN = _RUN_MIN
RESTARTS = _RESTARTS


class ChunkParser:
    """SSE payloads -> delta events. `runs=False`: every payload parsed as JSON (the reference
    the differential tests hold the TextRun path to)."""

    __slots__ = ("_runs", "_head", "_tail")

    def __init__(self, *, runs: bool = True) -> None:
        self._runs = runs
        self._head: bytes | None = None  # a plain text chunk's bytes up to and with its string's quote
        self._tail = b""  # and from the closing quote on

    def events(self, payloads: list[bytes]) -> list[Delta]:
        out: list[Delta] = []
        at, n = 0, len(payloads)
        if n == 1:  # one chunk per read: the usual stream
            payload = payloads[0]
            head = self._head
            if head is not None and payload.startswith(head) and payload.endswith(self._tail):
                # The learned text chunk's shape: a run of one, as _with_runs reads it.
                text = payload[len(head):-len(self._tail)]
                if text and _NOT_PLAIN.search(text) is None:
                    out.append(OUTPUT_TOKEN)
                    out.append(Text(text.decode()))
                    return out
            self._payload(payload, out)
            return out
        restarts = _RESTARTS
        while at < n:
            if self._head is None or n - at < _RUN_MIN or not restarts:
                self._payload(payloads[at], out)
                at += 1
            else:
                at = self._with_runs(payloads, at, out)
                restarts -= 1
        return out

    def _payload(self, payload: bytes, out: list[Delta]) -> None:
        if payload == _DONE:
            out.append(END)
            return
        stripped = payload.strip()
        if not stripped:
            return
        if stripped == _DONE:
            out.append(END)
            return
        try:
            obj = orjson.loads(stripped)
        except orjson.JSONDecodeError:
            out.append(Invalid(f"upstream sent an invalid event (not JSON): {stripped[:200]!r}"))
            return
        if obj.__class__ is not dict:
            out.append(Invalid(f"upstream sent an invalid event (not an object): {stripped[:200]!r}"))
            return
        before = len(out)
        chunk_events(obj, out)
        if (self._runs and len(out) - before == 2 and out[-1].__class__ is Text and obj.get("usage") is None
                and not (self._head is not None and stripped.startswith(self._head)
                         and stripped.endswith(self._tail))):
            self._learn(stripped, out[-1].text)

    def _learn(self, payload: bytes, text: str) -> None:
        """Keep the bytes around the content string of a chunk that carried only that text,
        when the string is plain and appears once."""
        enc = orjson.dumps(text)
        if _NOT_PLAIN.search(enc, 1, len(enc) - 1) is not None:
            return
        needle = b'"content":' + enc
        at = payload.find(needle)
        if at < 0 or payload.find(needle, at + 1) >= 0:
            return
        cut = at + len(needle) - len(enc) + 1
        self._head, self._tail = payload[:cut], payload[cut + len(enc) - 2:]

    def _with_runs(self, payloads: list[bytes], at: int, out: list[Delta]) -> int:
        """Events of payloads[at:], runs of the learned text chunk as TextRuns, up to the end
        or to a payload that taught another shape (SGLang's first text chunk also carries the
        role, later ones do not): -> where it stopped."""
        head, tail = self._head, self._tail
        assert head is not None  # runs start only once a text chunk's shape is learned
        hl, tl = len(head), len(tail)
        flags = list(map(and_, map(bytes.startswith, payloads, repeat(head)),
                         map(bytes.endswith, payloads, repeat(tail))))
        flags.append(False)  # the end: every run stops there
        n = len(payloads)
        while at < n:
            try:
                start = flags.index(True, at, n)
            except ValueError:
                start = n
            while at < start:
                self._payload(payloads[at], out)
                at += 1
                if self._head is not head:
                    return at
            if start == n:
                return n
            end = flags.index(False, start)
            texts = list(map(itemgetter(slice(hl, -tl)), payloads[start:end]))
            good = _plain_prefix(texts)
            if good > 1:
                out.append(TextRun(texts[:good]))
            elif good:
                out.append(OUTPUT_TOKEN)
                out.append(Text(texts[0].decode()))
            at = start + good
            if at < end:  # the chunk the run stopped at: only looks like a text chunk
                self._payload(payloads[at], out)
                at += 1
        return n


def _plain_prefix(texts: list[bytes]) -> int:
    """How many of the leading strings are plain and non-empty."""
    if all(texts) and _NOT_PLAIN.search(b"".join(texts)) is None:
        return len(texts)
    n = 0
    for text in texts:
        if not text or _NOT_PLAIN.search(text) is not None:
            break
        n += 1
    return n


def chunk_events(obj: dict, out: list[Delta]) -> None:
    """One parsed chat.completion.chunk (or a completion's envelope) -> its events."""
    err = obj.get("error")
    if err or obj.get("object") == "error":
        out.append(upstream_error(err if err else obj))
        return
    usage = obj.get("usage")
    if usage.__class__ is dict:
        out.append(Usage(usage))  # continuous usage stats: on every chunk, so mapped only when read
    choices = obj.get("choices")
    if not choices or choices.__class__ is not list:
        return
    for ch in choices:
        if ch.__class__ is not dict or (ch.get("index") or 0) != 0:
            continue  # n > 1: only the first choice becomes the response
        delta = ch.get("delta")
        if delta:
            delta_events(delta, out)
        fr = ch.get("finish_reason")
        if fr:
            out.append(Finish(fr if fr.__class__ is str else str(fr)))


def delta_events(delta: Any, out: list[Delta]) -> None:
    if delta.__class__ is not dict:
        out.append(Invalid("upstream sent an invalid delta (not an object)"))
        return
    c = delta.get("content")
    if len(delta) == 1 and c.__class__ is str:  # vLLM's text chunk: {"content": "..."}
        if c:
            out.append(OUTPUT_TOKEN)
            out.append(Text(c))
        return
    r = delta.get("reasoning")
    if r is None:
        r = delta.get("reasoning_content")
    r = r if r and r.__class__ is str else None
    c = c if c and c.__class__ is str else None
    tcs = delta.get("tool_calls")
    calls: list[ToolCallFragment] = []
    if tcs and tcs.__class__ is list:
        for tc in tcs:
            if tc.__class__ is dict:
                fragment = _fragment(tc)
                if isinstance(fragment, str):
                    out.append(Invalid(f"upstream sent an invalid tool call ({fragment})"))
                    return
                calls.append(fragment)
    if r is not None or c is not None or any(f.arguments for f in calls):
        out.append(OUTPUT_TOKEN)
    if r is not None:
        out.append(Reasoning(r))
    if c is not None:
        out.append(Text(c))
    out.extend(calls)


def _fragment(tc: dict) -> ToolCallFragment | str:
    """A tool_calls[] entry as a fragment, or what is wrong with it."""
    fn = tc.get("function") or {}
    if fn.__class__ is not dict:
        return "its function is not an object"
    name = fn.get("name") or None
    if name is not None and name.__class__ is not str:
        return "its name is not a string"
    args = fn.get("arguments")
    if args is not None and args.__class__ is not str:
        args = orjson.dumps(args).decode()
    tid = tc.get("id") or None
    index = tc.get("index")
    return ToolCallFragment(index if index.__class__ is int or index.__class__ is bool else None,
                            tid if tid.__class__ is str else None, name, args)


def upstream_error(err: Any) -> UpstreamError:
    """An upstream error object -> the Responses error it becomes (code, retry advice)."""
    if err.__class__ is dict:
        message = err.get("message") or err.get("detail") or "upstream error"
        raw = err.get("code")
        etype = err.get("type")
    else:
        message, raw, etype = str(err), None, None
    status = raw if isinstance(raw, int) else None
    if isinstance(raw, str) and raw.isdigit():
        status = int(raw)
    if status == 429 or raw == "rate_limit_exceeded" or etype == "rate_limit_exceeded":
        code = "rate_limit_exceeded"
    elif isinstance(raw, str) and raw in ERROR_CODES:
        code = raw
    else:
        code = "server_error"
    retry = not (status is not None and 400 <= status < 500 and status != 429)
    return UpstreamError(str(message), code, 1000 if retry else None, retry)


def completion_events(completion: Any) -> list[Delta]:
    """A non-stream chat.completion -> the events of the stream it stands for: its message as
    one delta, its finish_reason ("stop" when missing), then the end."""
    out: list[Delta] = []
    if completion.__class__ is not dict:
        out.append(Invalid("upstream sent an invalid completion"))
        return out
    if completion.get("error") or completion.get("object") == "error":
        chunk_events(completion, out)
        return out
    usage = completion.get("usage")
    if usage.__class__ is dict:
        out.append(Usage(usage))
    choices = completion.get("choices")
    choice = None
    if choices.__class__ is list:
        choice = next((c for c in choices if c.__class__ is dict and (c.get("index") or 0) == 0), None)
    if choice is None:
        out.append(Invalid("upstream completion has no choices"))
        return out
    msg = choice.get("message") or {}
    if msg.__class__ is not dict:
        out.append(Invalid("upstream sent an invalid completion (its message is not an object)"))
        return out
    reasoning = msg.get("reasoning")
    delta: dict[str, Any] = {"reasoning": reasoning if reasoning is not None else msg.get("reasoning_content"),
                             "content": msg.get("content")}
    calls = msg.get("tool_calls")
    if calls and calls.__class__ is list:
        delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(calls) if tc.__class__ is dict]
    delta_events(delta, out)
    fr = choice.get("finish_reason") or "stop"
    out.append(Finish(fr if fr.__class__ is str else str(fr)))
    out.append(END)
    return out
