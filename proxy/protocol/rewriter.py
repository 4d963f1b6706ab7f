"""Chat-completions stream -> Responses stream, as a sans-I/O state machine.

    rw = StreamRewriter(ctx)
    send(rw.start())                       # response.created + response.in_progress
    async for chunk in upstream: send(rw.feed(chunk))   # any byte split
    send(rw.finish())                      # upstream EOF (b"" if [DONE] already ended it)
    # or, on a timeout / reset after the headers went out:
    send(rw.fail("upstream timed out", code="upstream_timeout"))

Every call returns the Responses SSE bytes it produced (possibly b""); once `done` is
set every call returns b"". `response_from_completion` turns a non-stream chat.completion
into the same Response object the stream would end with: what the accumulator makes of the
message as one delta (built directly for the usual shapes; the tests hold the two equal).

Item lifecycle:
  reasoning  opens on the first reasoning delta, closes on the first content/tool delta
             (or at the finish); hidden entirely when ctx.reasoning_items is False.
  message    opens on the first non-empty content delta, closes at the finish.
  calls      open when their name is known, close at the finish (never earlier: vLLM
             interleaves parallel calls by index). Custom tools stream no argument deltas:
             their `input` is only known once the JSON arguments are complete.
A finish_reason "length"/"content_filter" closes items with status "incomplete" and ends
in response.incomplete; a failure leaves open items "incomplete" in the failed response
without emitting their done events (a half-streamed call must not look runnable).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from itertools import repeat
from operator import and_, itemgetter
from typing import TYPE_CHECKING, Any, Callable

import orjson

from proxy.protocol.ids import random_bytes
from proxy.protocol.sse import MAX_LINE, SSEDecoder

_TRACE_START = re.compile(r"\s*(?:Traceback \(most recent call last\)|File \")")
_ABS_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@+-]+){2,}[\\/]?")


def public_message(message: str, limit: int = 500) -> str:
    """An upstream message as the client may see it: no traceback, no file-system paths
    (the model server's internals), bounded in length."""
    found = _TRACE_START.search(message)
    if found:
        message = message[: found.start()]
    message = _ABS_PATH.sub("<path>", message).strip()
    return message[:limit] or "The model server failed."

if TYPE_CHECKING:  # proxy.protocol.translate is written separately; only its shape matters here
    from proxy.protocol.translate import ToolOrigin

__all__ = ["ResponseContext", "StreamRewriter", "response_from_completion", "map_usage", "client_usage"]

# ResponseError.code is a closed set in the SDK; anything else is reported as server_error
# (the original code travels in error.type).
_ERROR_CODES = frozenset(
    {
        "server_error",
        "rate_limit_exceeded",
        "invalid_prompt",
        "vector_store_timeout",
        "invalid_image",
        "invalid_image_format",
        "invalid_base64_image",
        "invalid_image_url",
        "image_too_large",
        "image_too_small",
        "image_parse_error",
        "image_content_policy_violation",
        "invalid_image_mode",
        "image_file_too_large",
        "unsupported_image_media_type",
        "empty_image_file",
        "failed_to_download_image",
        "image_file_not_found",
    }
)

_TERMINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete"}

# Fields the rewriter owns; ctx.echo cannot override them.
_OWNED = frozenset({"id", "object", "created_at", "status", "model", "output", "usage", "error", "incomplete_details"})


@dataclass(slots=True)
class ResponseContext:
    response_id: str  # "resp_" + hex
    model: str  # as sent
    created_at: int
    echo: dict = field(default_factory=dict)  # from Translation.echo
    tools: dict[str, "ToolOrigin"] = field(default_factory=dict)  # upstream name -> origin
    ai_markers: bool = True
    ai_notice: str = "[AI-generated content]"
    reasoning_items: bool = True
    seal: Callable[[str], str] | None = None  # reasoning text -> encrypted_content
    # Addition to DESIGN.md: with a seal, False sends the reasoning only as ciphertext
    # (summary [] and no summary events); True (default) sends the summary text as well.
    reasoning_in_clear: bool = True
    # The max_tokens sent upstream: no more output deltas than this reach the client (an
    # upstream that ignores it is cut off there, the response ends incomplete).
    output_cap: int | None = None
    # tool_choice {"type": "allowed_tools"}: the upstream names the model may call; a call to
    # any other never reaches the client (the Open Responses spec makes the set a hard limit).
    allowed_tools: frozenset[str] | None = None


# The Open Responses spec ends every stream with this literal after the terminal event.
_DONE = b"data: [DONE]\n\n"


def _hex() -> str:
    """24 hex digits, unique (proxy.protocol.ids); looked up by name at each call: tests swap it for a counter."""
    return random_bytes(12).hex()


def _now() -> int:
    """completed_at; looked up by name at each call, as _hex: tests swap it for a constant."""
    return int(time.time())


def _origin(origin: Any) -> tuple[str, str | None, str | None]:
    """(kind, name, namespace) of a ToolOrigin (or anything shaped like one, dicts included)."""
    if origin is None:
        return "function", None, None
    if isinstance(origin, dict):
        return origin.get("kind") or "function", origin.get("name"), origin.get("namespace")
    get = getattr
    return get(origin, "kind", None) or "function", get(origin, "name", None), get(origin, "namespace", None)


def _count(value: Any) -> int | None:
    """A reported token count, or None when it is not one (the ledger then bills its fallback)."""
    if value.__class__ is int:
        return value if 0 <= value <= _MAX_COUNT else None
    if value.__class__ is float and value.is_integer() and 0 <= value <= _MAX_COUNT:
        return int(value)
    return None


_MAX_COUNT = 2**63 - 1


def map_usage(u: dict) -> dict:
    """Chat usage -> Responses usage (input_tokens includes cached and written tokens). A count
    that is missing or not a count (negative, fractional, huge, a string) is None here: the
    ledger replaces it (proxy.ledger.usage) and the client is shown 0 (client_usage)."""
    inp = _count(u.get("prompt_tokens"))
    out = _count(u.get("completion_tokens"))
    ptd = u.get("prompt_tokens_details")
    ptd = ptd if ptd.__class__ is dict else {}
    ctd = u.get("completion_tokens_details")
    ctd = ctd if ctd.__class__ is dict else {}
    rs = ctd.get("reasoning_tokens")
    if rs is None:
        rs = u.get("reasoning_tokens")  # SGLang reports reasoning_tokens at the top level of usage
    return {
        "input_tokens": inp,
        "input_tokens_details": {
            "cached_tokens": _count(ptd.get("cached_tokens") or 0),
            "cache_write_tokens": _count(ptd.get("created_cache_tokens") or ptd.get("cache_write_tokens") or 0),
        },
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": _count(rs or 0)},
        "total_tokens": inp + out if inp is not None and out is not None else None,
    }


def client_usage(usage: dict, cap: int | None) -> dict:
    """The usage a client is shown: every count an int, the output at most the cap."""
    out = usage["output_tokens"]
    itd = usage["input_tokens_details"]
    cached, rs = itd["cached_tokens"], usage["output_tokens_details"]["reasoning_tokens"]
    if (usage["total_tokens"] is not None and cached is not None and rs is not None
            and itd["cache_write_tokens"] is not None and cached <= usage["input_tokens"] and rs <= out
            and (cap is None or out <= cap)):
        return usage
    inp = usage["input_tokens"] or 0
    out = out or 0
    if cap is not None and out > cap:
        out = cap
    cached = cached or 0
    rs = rs or 0
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached if cached <= inp else 0,
                                 "cache_write_tokens": usage["input_tokens_details"]["cache_write_tokens"] or 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": rs if rs <= out else out},
        "total_tokens": inp + out,
    }


# The Response object before any output, in the SDK's field order. Copied per response
# (one C-level dict copy instead of building 40 keys); None marks what _base_response fills
# in: id, created_at, model, and fresh "output" and "tools" lists (never shared).
_BASE: dict[str, Any] = {
    "id": None,
    "object": "response",
    "created_at": None,
    "status": "in_progress",
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "max_output_tokens": None,
    "model": None,
    "output": None,
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": None,
    "store": False,
    "temperature": None,
    "text": None,
    "tool_choice": "auto",
    "tools": None,
    "top_p": None,
    "truncation": "disabled",
    "usage": None,
    "user": None,
    "metadata": None,
    "background": False,
    "max_tool_calls": None,
    "prompt_cache_key": None,
    "safety_identifier": None,
    "service_tier": "default",
    "top_logprobs": None,
    "conversation": None,
    "prompt": None,
    # Fields of the SDK's Response this proxy has nothing to say about (completed_at
    # too: the rewriter is pure, so its bytes do not depend on the clock).
    "completed_at": None,
    "prompt_cache_retention": None,
    "prompt_cache_options": None,
    "prompt_cache_diagnostics": None,
    "input_transformations": None,
    "moderation": None,
    "tool_usage": None,
    "image": None,
    "access_programs": None,
}
assert _OWNED <= _BASE.keys()  # so that resetting an owned field keeps its place


def _base_response(ctx: ResponseContext) -> dict:
    """The in-progress Response: the template, the echoed request fields, the AI markers."""
    r = _BASE.copy()
    echo = ctx.echo
    if echo:
        r.update(echo)  # new keys land after the template's, in echo order
        if not _OWNED.isdisjoint(echo):  # ctx.echo cannot override the rewriter's fields
            for k in _OWNED.intersection(echo):
                r[k] = _BASE[k]
        if r["tool_choice"] is None:
            r["tool_choice"] = "auto"
        if r["parallel_tool_calls"] is None:
            r["parallel_tool_calls"] = True
    if r["tools"] is None:
        r["tools"] = []
    r["id"] = ctx.response_id
    r["created_at"] = ctx.created_at
    r["model"] = ctx.model
    r["output"] = []
    if ctx.ai_markers:
        r["ai_generated"] = True
        r["ai_notice"] = ctx.ai_notice
    return r


class _Item:
    __slots__ = (
        "kind", "id", "index", "parts", "open", "final",
        "upstream_id", "upstream_name", "call_id", "name", "namespace", "announced", "tpl",
    )

    def __init__(self, kind: str, prefix: str) -> None:
        self.kind = kind  # reasoning | message | function_call | custom_tool_call
        self.id = prefix + _hex()
        self.index: int | None = None  # output_index; None while not announced / hidden
        self.parts: list[str] = []
        self.open = True
        self.final: dict | None = None
        self.upstream_id: str | None = None
        self.upstream_name: str | None = None
        self.call_id: str | None = None
        self.name: str | None = None
        self.namespace: str | None = None
        self.announced = False
        self.tpl: tuple[bytes, bytes, bytes] | None = None  # delta-event byte template (fast path)

    def text(self) -> str:
        parts = self.parts
        if len(parts) > 1:
            joined = "".join(parts)
            parts.clear()  # in place: the fast path holds on to this list
            parts.append(joined)
            return joined
        return parts[0] if parts else ""


# ---------------------------------------------------------------------- delta fast path
# The three per-token events are written from byte templates instead of dict + orjson.dumps:
#   head + sequence_number + mid + orjson.dumps(delta) + tail
# byte for byte what _event() writes for the same dict (same key order, orjson's compact form).
_SEQ = tuple(b"%d" % i for i in range(8192))  # sequence_number digits, precomputed
_NSEQ = len(_SEQ)
_JSONDecodeError = orjson.JSONDecodeError
_RUNS_MIN = 4  # events in a feed before _feed_runs looks for runs of raw text chunks
_SPLIT_MIN = 2048  # bytes in a read before _feed_split (vLLM's chunks are ~200 bytes)
_SPLIT_KEY = 32  # bytes of a raw chunk's start that _feed_split splits a read on
# A byte other than these in a content string (a quote, a backslash, a control character,
# non-ASCII: orjson would write the string otherwise) sends its chunk to the per-chunk path.
_NOT_PLAIN = re.compile(rb"[^\x20\x21\x23-\x5b\x5d-\x7f]")


def _event_head(event_type: str) -> bytes:
    """What an event of that type starts with, up to its sequence_number."""
    return b'event: %s\ndata: {"type":%s,"sequence_number":' % (event_type.encode(), orjson.dumps(event_type))


# (head, mid % (JSON item id, output_index), tail) per delta event, the constant parts built once:
_TEXT_DELTA = (_event_head("response.output_text.delta"),  # ..."content_index","delta","logprobs"}
               b',"item_id":%s,"output_index":%d,"content_index":0,"delta":', b',"logprobs":[]}\n\n')
_REASONING_DELTA = (_event_head("response.reasoning_summary_text.delta"),  # ..."summary_index","delta"}
                    b',"item_id":%s,"output_index":%d,"summary_index":0,"delta":', b"}\n\n")
_ARGS_DELTA = (_event_head("response.function_call_arguments.delta"),  # ..."output_index","delta"}
               b',"item_id":%s,"output_index":%d,"delta":', b"}\n\n")


def _delta_template(it: "_Item", kind: tuple[bytes, bytes, bytes]) -> tuple[bytes, bytes, bytes]:
    head, mid, tail = kind
    tpl = it.tpl = (head, mid % (orjson.dumps(it.id), it.index), tail)
    return tpl


def _text_template(it: "_Item") -> tuple[bytes, bytes, bytes]:
    return _delta_template(it, _TEXT_DELTA)


def _reasoning_template(it: "_Item") -> tuple[bytes, bytes, bytes]:
    return _delta_template(it, _REASONING_DELTA)


def _args_template(it: "_Item") -> tuple[bytes, bytes, bytes]:
    return _delta_template(it, _ARGS_DELTA)


# The per-stream events, also from templates; same bytes as _event() for the same dicts.
_CREATED = b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":'
_IN_PROGRESS = b'}\n\nevent: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1,"response":'
# output_item.added: % (sequence_number, output_index, JSON item id)
_MSG_ADDED = (b'event: response.output_item.added\ndata: {"type":"response.output_item.added","sequence_number":%d,'
              b'"output_index":%d,"item":{"type":"message","id":%s,"status":"in_progress","role":"assistant",'
              b'"content":[]}}\n\n')
_RS_ADDED = (b'event: response.output_item.added\ndata: {"type":"response.output_item.added","sequence_number":%d,'
             b'"output_index":%d,"item":{"type":"reasoning","id":%s,"summary":[],"status":"in_progress"}}\n\n')
# content_part.added / reasoning_summary_part.added: % (sequence_number, JSON item id, output_index)
_TEXT_PART_ADDED = (b'event: response.content_part.added\ndata: {"type":"response.content_part.added",'
                    b'"sequence_number":%d,"item_id":%s,"output_index":%d,"content_index":0,'
                    b'"part":{"type":"output_text","text":"","annotations":[],"logprobs":[]}}\n\n')
_SUMMARY_PART_ADDED = (b'event: response.reasoning_summary_part.added\ndata: {"type":'
                       b'"response.reasoning_summary_part.added","sequence_number":%d,"item_id":%s,'
                       b'"output_index":%d,"summary_index":0,"part":{"type":"summary_text","text":""}}\n\n')


class StreamRewriter:
    """Upstream chat-completions SSE bytes in, Responses SSE bytes out. Pure; no I/O."""

    def __init__(self, ctx: ResponseContext, *, max_line: int = MAX_LINE) -> None:
        self.ctx = ctx
        self.done = False
        self.status = "in_progress"
        self.usage: dict | None = None  # Responses-shaped, only when the upstream reported usage
        self.output_tokens_seen = 0
        self.reasoning_deltas_seen = 0
        self.finish_reason: str | None = None
        cap = ctx.output_cap
        self._cap = cap if cap is not None and cap >= 0 else None
        self.capped = False  # the upstream went past the cap: cut off (its connection must not be reused)
        self._decoder = SSEDecoder(max_line)
        self._started = False
        self._emit = True
        self._clear = ctx.seal is None or ctx.reasoning_in_clear  # reasoning text may reach the client
        self._out: list[bytes] = []
        self._seq = 0
        self._items: list[_Item] = []  # announced, visible items in output_index order
        self._reasoning: _Item | None = None
        self._message: _Item | None = None
        self._calls: dict[int, _Item] = {}  # upstream tool_call index -> current call
        self._all_calls: list[_Item] = []
        self._call_ids: set[str] = set()
        self._last_call_index: int | None = None
        self._base = _base_response(ctx)
        self.response: dict = self._base  # the terminal response once done
        self._fs: tuple | None = None  # _feed_fast's view of the state, None once stale
        # The bytes around the content string of the last plain text chunk (see _feed_fast).
        self._raw: tuple[bytes, bytes] | None = None

    # ------------------------------------------------------------------ public API
    def start(self) -> bytes:
        if self._started or self.done:
            return b""
        self._started = True
        out = self._out = []
        base = self._base
        if self._emit:
            if self._fast:  # the same two events, with the response serialised once
                body = orjson.dumps(base)
                self._seq = 2
                return _CREATED + body + _IN_PROGRESS + body + b"}\n\n"
            self._event({"type": "response.created", "sequence_number": 0, "response": base})
            self._event({"type": "response.in_progress", "sequence_number": 0, "response": base})
        return b"".join(out)

    def feed(self, data: bytes) -> bytes:
        if self.done:
            return b""
        if not self._started:
            return self.start() + self.feed(data)
        out = self._out = []
        dec = self._decoder
        raw = self._raw
        if (raw is not None and len(data) > _SPLIT_MIN and self._fast and self._emit and dec.at_event_start
                and data[-2:] == b"\n\n" and 13 not in data
                and (self._cap is None or self.output_tokens_seen + data.count(b"\n\n") <= self._cap)):
            self._feed_split(data, raw)
        else:
            self._feed_payloads(dec.feed(data))
        if dec.overflow and not self.done:
            self._fail(f"upstream sent a line longer than {dec.max_line} bytes", "server_error", 1000, True)
        return b"".join(out)

    def _feed_payloads(self, payloads: list[bytes]) -> None:
        if not payloads:
            return
        # Each payload adds at most one output token: the batched paths run only while the
        # cap cannot be reached within this read; near it, each chunk is checked (_on_delta).
        cap = self._cap
        if self._fast and self._emit and (cap is None or self.output_tokens_seen + len(payloads) <= cap):
            if self._raw is not None and len(payloads) >= _RUNS_MIN:
                self._feed_runs(payloads)
            else:
                rest = self._feed_fast(payloads)
                if rest:  # the text chunk's bytes became known with many events to go
                    self._feed_runs(payloads[rest:])
        else:
            for payload in payloads:
                self._on_payload(payload)
                if self.done:
                    break
            self._fs = None  # the state _feed_fast keeps may have changed

    def finish(self) -> bytes:
        if self.done:
            return b""
        head = self.start() if not self._started else b""
        out = self._out = []
        for payload in self._decoder.flush():
            self._on_payload(payload)
            if self.done:
                break
        if not self.done:
            self._end_of_stream()
        return head + b"".join(out)

    def fail(
        self,
        message: str,
        *,
        code: str = "upstream_error",
        retry_after_ms: int | None = 1000,
        should_retry: bool = True,
        verbatim_code: bool = False,
    ) -> bytes:
        """End the stream as response.failed. `verbatim_code` keeps a code outside the SDK's
        closed set (insufficient_quota: what Codex reads as "stop, do not retry")."""
        if self.done:
            return b""
        head = self.start() if not self._started else b""
        out = self._out = []
        self._fail(message, code, retry_after_ms, should_retry, verbatim_code)
        return head + b"".join(out)

    # ------------------------------------------------------------------ fast path
    # False: every payload takes the general path and every event is built as a dict, then
    # serialised (the reference the tests compare the byte templates with).
    _fast = True

    def _feed_fast(self, payloads: list[bytes]) -> int:
        """Same as `for p in payloads: self._on_payload(p)`, with the per-token chunks (one
        choice, no finish_reason, a delta with only text, only reasoning, or the argument text
        of an already announced call) handled inline: parsed once, checked for exactly that
        shape, written from the item's byte template. The first text or reasoning of an item
        calls the item methods directly (as _on_delta would, then the state is reloaded).
        Anything else (tool-call starts, finish, errors, [DONE], odd shapes) goes through the
        general path unchanged, after the state kept in locals has been written back."""
        loads = orjson.loads
        dumps = orjson.dumps
        write = self._out.extend  # the event's five pieces; feed() joins them all once
        seq_digits = _SEQ
        nseq = _NSEQ
        seq = self._seq
        ntok = 0  # output_tokens_seen increments not yet written back
        nrsn = 0  # reasoning_deltas_seen increments not yet written back
        fs = self._fs  # the state below, kept from the last feed unless the general path ran since
        if fs is not None:
            open_, m_tpl, m_parts, r_tpl, r_parts, hide_rs, calls = fs
        raw = self._raw
        first_learn = raw is None
        if raw is not None:
            raw_head, raw_tail = raw
            head_len, tail_len = len(raw_head), len(raw_tail)
        rest = 0
        for i, payload in enumerate(payloads):
            if fs is None:  # (re)load the state the general path may have changed
                if self.done:
                    break
                fs = self._fast_state()
                open_, m_tpl, m_parts, r_tpl, r_parts, hide_rs, calls = fs
            # Text chunks differ from each other only in their content string (same id, model,
            # created, nulls): a payload that is the last plain text chunk's bytes around
            # another string is that same chunk with other text, and when that string holds no
            # escape, no control character and no non-ASCII byte, its JSON bytes are what
            # orjson.dumps would write. No parse, no checks, no dump.
            if (raw is not None and m_tpl is not None and payload.startswith(raw_head)
                    and payload.endswith(raw_tail)):
                enc = payload[head_len:len(payload) - tail_len]
                if (len(enc) > 2 and enc[0] == 34 and enc[-1] == 34 and enc.count(34) == 2 and 92 not in enc
                        and enc.isascii() and min(enc) > 31):
                    m_parts.append(enc[1:-1].decode())
                    write((m_tpl[0], seq_digits[seq] if seq < nseq else b"%d" % seq, m_tpl[1], enc, m_tpl[2]))
                    seq += 1
                    ntok += 1
                    continue
            if payload == b"[DONE]":  # not JSON: spare orjson raising (an exception object per stream)
                obj = None
            else:
                try:
                    obj = loads(payload)
                except _JSONDecodeError:
                    obj = None
            if open_ and obj.__class__ is dict and not obj.get("error") and obj.get("object") != "error":
                choices = obj.get("choices")
                usage = obj.get("usage")
                handled = False
                if not choices:
                    handled = True
                elif choices.__class__ is list and len(choices) == 1:
                    ch = choices[0]
                    if ch.__class__ is dict and not ch.get("index") and not ch.get("finish_reason"):
                        delta = ch.get("delta")
                        if not delta:
                            handled = True
                        elif delta.__class__ is dict:
                            c = delta.get("content")
                            if len(delta) == 1 and c.__class__ is str:  # vLLM: {"content": "..."}
                                r = tcs = None
                            else:
                                r = delta.get("reasoning")
                                if r is None:
                                    r = delta.get("reasoning_content")
                                if c.__class__ is not str:
                                    c = None  # not text: ignored, as in _on_delta
                                tcs = delta.get("tool_calls")
                            if not tcs:
                                if not r:
                                    if not c:
                                        handled = True  # e.g. the role-only first chunk
                                    elif m_tpl is not None:
                                        m_parts.append(c)
                                        enc = dumps(c)
                                        write((m_tpl[0], seq_digits[seq] if seq < nseq else b"%d" % seq,
                                               m_tpl[1], enc, m_tpl[2]))
                                        seq += 1
                                        ntok += 1
                                        handled = True
                                    else:  # the message opens (or reasoning ends): _on_delta's steps
                                        self._seq = seq
                                        self._close_reasoning("completed")
                                        self._text_delta(c)
                                        seq = self._seq
                                        ntok += 1
                                        fs = None
                                        handled = True
                                        enc = None
                                    # A plain text chunk whose bytes are not (yet) the raw
                                    # path's: learn them (SGLang's first text chunk also carries
                                    # the role, vLLM's does not; later ones are alike).
                                    if c and usage is None and (raw is None or not (
                                            payload.startswith(raw_head) and payload.endswith(raw_tail))):
                                        learned = self._learn_raw(payload, enc or dumps(c))
                                        if learned is not None:
                                            raw = learned
                                            raw_head, raw_tail = raw
                                            head_len, tail_len = len(raw_head), len(raw_tail)
                                            if first_learn and len(payloads) - i > _RUNS_MIN:
                                                rest = i + 1  # the rest of this read: _feed_runs
                                                break
                                elif not c and r.__class__ is str:
                                    if hide_rs:
                                        ntok += 1
                                        nrsn += 1
                                        handled = True
                                    elif r_parts is not None:
                                        r_parts.append(r)
                                        if r_tpl is not None:
                                            write((r_tpl[0], seq_digits[seq] if seq < nseq else b"%d" % seq,
                                                   r_tpl[1], dumps(r), r_tpl[2]))
                                            seq += 1
                                        ntok += 1
                                        nrsn += 1
                                        handled = True
                                    else:  # the reasoning item opens
                                        self._seq = seq
                                        self._reasoning_delta(r)
                                        seq = self._seq
                                        ntok += 1
                                        nrsn += 1
                                        fs = None
                                        handled = True
                            elif (not r and not c and calls is not None and tcs.__class__ is list
                                  and len(tcs) == 1):
                                tc = tcs[0]
                                if tc.__class__ is dict and not tc.get("id"):
                                    fn = tc.get("function")
                                    idx = tc.get("index")
                                    if fn.__class__ is dict and idx.__class__ is int:
                                        args = fn.get("arguments")
                                        call = calls.get(idx)
                                        if args.__class__ is str and call is not None and call.announced:
                                            self._last_call_index = idx
                                            if args:
                                                call.parts.append(args)
                                                if call.kind == "function_call":
                                                    tpl = call.tpl or _args_template(call)
                                                    write((tpl[0], seq_digits[seq] if seq < nseq else b"%d" % seq,
                                                           tpl[1], dumps(args), tpl[2]))
                                                    seq += 1
                                                ntok += 1
                                            handled = True
                if handled:
                    if usage.__class__ is dict:
                        self.usage = map_usage(usage)  # continuous usage stats: the last one wins
                    continue
            # the general path, with the state written back first
            self._seq = seq
            if ntok:
                self.output_tokens_seen += ntok
                ntok = 0
            if nrsn:
                self.reasoning_deltas_seen += nrsn
                nrsn = 0
            if obj.__class__ is dict:
                self._on_chunk(obj)
            else:
                self._on_payload(payload)
            seq = self._seq
            fs = None
        self._fs = fs
        self._raw = raw
        self._seq = seq
        if ntok:
            self.output_tokens_seen += ntok
        if nrsn:
            self.reasoning_deltas_seen += nrsn
        return rest

    def _feed_runs(self, payloads: list[bytes]) -> None:
        """_feed_fast for a read of many events once the plain text chunk's bytes are known
        (a coalescing server, a reader that fell behind): each run of consecutive chunks that
        are those bytes around another plain string is written with a handful of C-level
        calls for the whole run (the per-chunk checks as map()s over the list, the events as
        one interleaved join) instead of a dozen interpreted steps per chunk. Everything else,
        and the one chunk of a run whose string holds anything unusual, goes through
        _feed_fast, in order."""
        head, tail = self._raw  # type: ignore[misc]
        head += b'"'
        tail = b'"' + tail
        head_len, tail_len = len(head), len(tail)
        flags = list(map(and_, map(bytes.startswith, payloads, repeat(head)),
                         map(bytes.endswith, payloads, repeat(tail))))
        flags.append(False)  # the end: every run stops there
        n = len(payloads)
        at = 0
        while at < n:
            try:
                start = flags.index(True, at, n)
            except ValueError:
                start = n
            if start > at:
                self._feed_fast(payloads[at:start])
                if self.done or start == n:
                    return
            end = flags.index(False, start)
            while start < end:
                written = self._write_run(payloads[start:end], head_len, tail_len)
                if written < 0:  # no open message: the general path decides, for the whole run
                    self._feed_fast(payloads[start:end])
                    start = end
                else:
                    start += written
                    if start < end:  # the chunk the run stopped at
                        self._feed_fast(payloads[start:start + 1])
                        start += 1
                if self.done:
                    return
            at = end

    def _write_run(self, run: list[bytes], head_len: int, tail_len: int) -> int:
        """Write the delta events of the leading chunks of a run of raw text chunks, byte for
        byte what _feed_fast writes for each, up to the first whose content string is empty
        or holds anything orjson would write differently. How many were written; -1 (none)
        when no message is open."""
        texts = list(map(itemgetter(slice(head_len, -tail_len)), run))
        joined = b"".join(texts)
        if not all(texts) or _NOT_PLAIN.search(joined) is not None:
            n = 0
            for text in texts:
                if not text or _NOT_PLAIN.search(text) is not None:
                    break
                n += 1
            if not n:
                return 0 if self._text_template() is not None else -1
            texts = texts[:n]
            joined = b"".join(texts)
        return self._write_texts(texts, joined)

    def _text_template(self) -> tuple[bytes, bytes, bytes] | None:
        """The open message's delta template (from _fast_state, kept), None when no message
        takes plain text deltas now."""
        fs = self._fs
        if fs is None:
            if self.done:
                return None
            fs = self._fs = self._fast_state()
        return fs[1]

    def _write_texts(self, texts: list[bytes], joined: bytes) -> int:
        """The delta events of these plain, non-empty content strings (their JSON bytes without
        the quotes; `joined` is all of them), in one interleaved join: len(texts), or -1
        (nothing written) when no message is open."""
        tpl = self._text_template()
        if tpl is None:  # reasoning still open, a call, the finish seen: not plain text deltas
            return -1
        n = len(texts)
        seq = self._seq
        seqs = _SEQ[seq:seq + n] if seq + n <= _NSEQ else [b"%d" % i for i in range(seq, seq + n)]
        head, mid, end = tpl
        # head, then per event: seq, mid + quote, text, quote + end + the next head (the last: end)
        pieces = [mid + b'"'] * (4 * n)
        pieces[0::4] = seqs
        pieces[2::4] = texts
        pieces[3::4] = repeat(b'"' + end + head, n)
        pieces[-1] = b'"' + end
        out = self._out
        out.append(head)
        out.extend(pieces)
        self._fs[2].append(joined.decode())  # type: ignore[index]  # the message text: one part
        self._seq = seq + n
        self.output_tokens_seen += n
        return n

    def _feed_split(self, data: bytes, raw: tuple[bytes, bytes]) -> None:
        """feed() for a read of whole events once the plain text chunk's bytes are known: the
        run of such chunks in it is found with one split of the read on the last bytes before
        their string (a short needle: bytes.split is several times slower with a long one),
        each part then checked to end with the rest of what lies between two such strings, so
        the run's events are neither decoded nor parsed one by one. What comes before and
        after the run takes the usual path; anything unexpected (a string that is not plain,
        the run not made of whole events), the whole read."""
        head, tail = raw
        opener = b"data: " + head + b'"'  # a raw chunk's bytes up to its string
        closer = b'"' + tail + b"\n\n"  # and after it
        key = opener[-_SPLIT_KEY:]
        lead = opener[:-len(key)]
        between = closer + lead  # what comes between a string and the needle before the next one
        parts = data.split(key)
        dec = self._decoder
        if len(parts) < 3:
            return self._feed_payloads(dec.feed(data))
        first = parts[0]  # the events before the run, then the start of its first chunk
        at = len(first) - len(lead)
        last = parts[-1]  # the string of the run's last chunk, then the events after the run
        to = last.find(closer)
        if (not first.endswith(lead) or (at and not first.endswith(b"\n\n", 0, at))
                or not all(map(bytes.endswith, parts[1:-1], repeat(between)))):
            return self._feed_payloads(dec.feed(data))
        texts = list(map(itemgetter(slice(None, -len(between))), parts[1:-1]))
        text = last[:to]
        if to > 0 and _NOT_PLAIN.search(text) is None:
            texts.append(text)
            to = len(data) - len(last) + to + len(closer)
        else:  # that chunk only starts like a raw one: the run ends with the one before
            to = len(data) - len(last) - len(opener)
        joined = b"".join(texts)  # no "\n" in a plain string: each text is one chunk's string
        if len(texts) < 2 or not all(texts) or _NOT_PLAIN.search(joined) is not None:
            return self._feed_payloads(dec.feed(data))
        if at:
            self._feed_payloads(dec.feed(data[:at]))
            if self.done:
                return
        if self._write_texts(texts, joined) < 0:  # no open message: the general path decides
            self._feed_payloads(dec.feed(data[at:to]))
            if self.done:
                return
        if to < len(data):
            self._feed_payloads(dec.feed(data[to:]))


    @staticmethod
    def _learn_raw(payload: bytes, enc: bytes) -> tuple[bytes, bytes] | None:
        """The bytes before and after the content string of a plain text chunk, when that
        string is written as orjson writes it (ASCII, no escapes) and appears once."""
        if 92 in enc or not enc.isascii():
            return None
        needle = b'"content":' + enc
        at = payload.find(needle)
        if at < 0 or payload.find(needle, at + 1) >= 0:
            return None
        cut = at + 10
        return payload[:cut], payload[cut + len(enc):]

    def _fast_state(self) -> tuple:
        """What _feed_fast needs to know, read once: (open, message template, message parts,
        reasoning template, reasoning parts, reasoning hidden, calls)."""
        open_ = self.finish_reason is None
        rs = self._reasoning
        msg = self._message
        m_tpl = m_parts = r_tpl = r_parts = None
        if open_ and rs is None and msg is not None and msg.open:
            m_parts = msg.parts
            m_tpl = msg.tpl or _text_template(msg)
        if open_ and rs is not None:
            r_parts = rs.parts
            if self._clear:
                r_tpl = rs.tpl or _reasoning_template(rs)
        calls = self._calls if open_ and rs is None else None
        return open_, m_tpl, m_parts, r_tpl, r_parts, not self.ctx.reasoning_items, calls

    # ------------------------------------------------------------------ emission
    def _event(self, ev: dict) -> None:
        ev["sequence_number"] = self._seq
        self._seq += 1
        self._out.append(b"event: " + ev["type"].encode() + b"\ndata: " + orjson.dumps(ev) + b"\n\n")

    # ------------------------------------------------------------------ upstream events
    def _on_payload(self, payload: bytes) -> None:
        stripped = payload.strip()
        if not stripped:
            return
        if stripped == b"[DONE]":
            self._end_of_stream()
            return
        try:
            obj = orjson.loads(stripped)
        except orjson.JSONDecodeError:
            self._fail(f"upstream sent an invalid event (not JSON): {stripped[:200]!r}", "server_error", 1000, True)
            return
        if not isinstance(obj, dict):
            self._fail(f"upstream sent an invalid event (not an object): {stripped[:200]!r}",
                       "server_error", 1000, True)
            return
        self._on_chunk(obj)

    def _on_chunk(self, obj: dict) -> None:
        err = obj.get("error")
        if err or obj.get("object") == "error":
            self._upstream_error(err if err else obj)
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = map_usage(usage)  # continuous usage stats: the last one wins
        choices = obj.get("choices")
        if not choices:
            return
        for ch in choices:
            if not isinstance(ch, dict) or (ch.get("index") or 0) != 0:
                continue  # n > 1: only the first choice becomes the response
            delta = ch.get("delta")
            if delta and self.finish_reason is None:
                self._on_delta(delta)
            fr = ch.get("finish_reason")
            if fr and not self.done:
                self._on_finish(fr if isinstance(fr, str) else str(fr))

    def _on_delta(self, delta: dict) -> None:
        if self._cap is not None and self.output_tokens_seen >= self._cap and _carries_output(delta):
            self._cut_at_cap()
            return
        counted = False
        r = delta.get("reasoning")
        if r is None:
            r = delta.get("reasoning_content")
        if r and isinstance(r, str):
            counted = True
            self.reasoning_deltas_seen += 1
            if self.ctx.reasoning_items:
                self._reasoning_delta(r)
        c = delta.get("content")
        if c and isinstance(c, str):
            counted = True
            self._close_reasoning("completed")
            self._text_delta(c)
        tcs = delta.get("tool_calls")
        if tcs:
            self._close_reasoning("completed")
            for tc in tcs:
                if isinstance(tc, dict) and self._tool_delta(tc):
                    counted = True
        if counted:
            self.output_tokens_seen += 1

    # ------------------------------------------------------------------ items
    def _add_from_templates(self, item: _Item, added: bytes, part_added: bytes | None) -> None:
        """_add + the part.added event, written from byte templates (%-formatted with the
        sequence number, the item id and the output index: see _MSG_ADDED)."""
        item.index = index = len(self._items)
        item.announced = True
        self._items.append(item)
        seq = self._seq
        item_id = orjson.dumps(item.id)
        ev = added % (seq, index, item_id)
        if part_added is not None:
            seq += 1
            ev += part_added % (seq, item_id, index)
        self._seq = seq + 1
        self._out.append(ev)

    def _delta_event(self, tpl: tuple[bytes, bytes, bytes], delta: str) -> None:
        seq = self._seq
        self._seq = seq + 1
        self._out.extend((tpl[0], _SEQ[seq] if seq < _NSEQ else b"%d" % seq, tpl[1], orjson.dumps(delta), tpl[2]))

    def _add(self, item: _Item, added: dict) -> None:
        item.index = len(self._items)
        item.announced = True
        self._items.append(item)
        if self._emit:
            self._event({"type": "response.output_item.added", "sequence_number": 0,
                         "output_index": item.index, "item": added})

    def _reasoning_delta(self, text: str) -> None:
        it = self._reasoning
        if it is None:
            it = self._reasoning = _Item("reasoning", "rs_")
            if self._fast and self._emit:
                self._add_from_templates(it, _RS_ADDED, _SUMMARY_PART_ADDED if self._clear else None)
            else:
                self._add(it, {"type": "reasoning", "id": it.id, "summary": [], "status": "in_progress"})
                if self._emit and self._clear:
                    self._event({"type": "response.reasoning_summary_part.added", "sequence_number": 0,
                                 "item_id": it.id, "output_index": it.index, "summary_index": 0,
                                 "part": {"type": "summary_text", "text": ""}})
        it.parts.append(text)
        if self._emit and self._clear:
            if self._fast:
                self._delta_event(it.tpl or _reasoning_template(it), text)
            else:
                self._event({"type": "response.reasoning_summary_text.delta", "sequence_number": 0,
                             "item_id": it.id, "output_index": it.index, "summary_index": 0, "delta": text})

    def _close_reasoning(self, status: str) -> None:
        it = self._reasoning
        if it is None:
            return
        self._reasoning = None
        it.open = False
        text = it.text()
        it.final = final = {"type": "reasoning", "id": it.id,
                            "summary": [{"type": "summary_text", "text": text}] if self._clear else [],
                            "status": status}
        if self.ctx.seal is not None:
            final["encrypted_content"] = self.ctx.seal(text)
        if self._emit and self._clear:
            self._event({"type": "response.reasoning_summary_text.done", "sequence_number": 0,
                         "item_id": it.id, "output_index": it.index, "summary_index": 0, "text": text})
            self._event({"type": "response.reasoning_summary_part.done", "sequence_number": 0,
                         "item_id": it.id, "output_index": it.index, "summary_index": 0,
                         "part": {"type": "summary_text", "text": text}})
        if self._emit:
            self._event({"type": "response.output_item.done", "sequence_number": 0,
                         "output_index": it.index, "item": final})

    def _text_delta(self, text: str) -> None:
        it = self._message
        if it is None:
            it = self._message = _Item("message", "msg_")
            if self._fast and self._emit:
                self._add_from_templates(it, _MSG_ADDED, _TEXT_PART_ADDED)
            else:
                self._add(it, {"type": "message", "id": it.id, "status": "in_progress", "role": "assistant",
                               "content": []})
                if self._emit:
                    self._event({"type": "response.content_part.added", "sequence_number": 0,
                                 "item_id": it.id, "output_index": it.index, "content_index": 0,
                                 "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        it.parts.append(text)
        if self._emit:
            if self._fast:
                self._delta_event(it.tpl or _text_template(it), text)
            else:
                self._event({"type": "response.output_text.delta", "sequence_number": 0, "item_id": it.id,
                             "output_index": it.index, "content_index": 0, "delta": text, "logprobs": []})

    def _message_final(self, it: _Item, status: str) -> dict:
        return {"type": "message", "id": it.id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": it.text(), "annotations": [], "logprobs": []}]}

    def _close_message(self, status: str) -> None:
        it = self._message
        if it is None or not it.open:
            return
        it.open = False
        text = it.text()
        it.final = final = self._message_final(it, status)
        if self._emit:
            self._event({"type": "response.output_text.done", "sequence_number": 0, "item_id": it.id,
                         "output_index": it.index, "content_index": 0, "text": text, "logprobs": []})
            self._event({"type": "response.content_part.done", "sequence_number": 0, "item_id": it.id,
                         "output_index": it.index, "content_index": 0, "part": final["content"][0]})
            self._event({"type": "response.output_item.done", "sequence_number": 0,
                         "output_index": it.index, "item": final})

    def _tool_delta(self, tc: dict) -> bool:
        """Apply one tool_calls[] entry; True when it carried argument text."""
        fn = tc.get("function") or {}
        tid = tc.get("id") or None
        name = fn.get("name") or None
        args = fn.get("arguments")
        if args is not None and not isinstance(args, str):
            args = orjson.dumps(args).decode()
        idx = tc.get("index")
        if not isinstance(idx, int):
            if tid or self._last_call_index is None:
                idx = max(self._calls, default=-1) + 1
            else:
                idx = self._last_call_index
        self._last_call_index = idx
        call = self._calls.get(idx)
        if call is not None and tid and call.upstream_id and tid != call.upstream_id:
            call = None  # a new call reusing the index (one call per chunk, SGLang style)
        if call is None:
            call = _Item("function_call", "fc_")
            self._calls[idx] = call
            self._all_calls.append(call)
        if tid and not call.upstream_id:
            call.upstream_id = tid
        if args:
            call.parts.append(args)
        if not call.announced:
            if name:
                self._announce_call(call, name)
        elif args and call.kind == "function_call" and self._emit:
            self._event({"type": "response.function_call_arguments.delta", "sequence_number": 0,
                         "item_id": call.id, "output_index": call.index, "delta": args})
        return bool(args)

    def _announce_call(self, call: _Item, upstream_name: str) -> None:
        call.upstream_name = upstream_name
        allowed = self.ctx.allowed_tools
        if allowed is not None and upstream_name not in allowed:
            return  # never announced: no event, no output item (its argument deltas are kept quiet)
        kind, name, ns = _origin(self.ctx.tools.get(upstream_name) if self.ctx.tools else None)
        call.name = name or upstream_name
        call.namespace = ns
        cid = call.upstream_id or ("call_" + _hex())
        while cid in self._call_ids:  # call_id is the SDK's identity for a call: keep it unique
            cid = "call_" + _hex()
        self._call_ids.add(cid)
        call.call_id = cid
        if kind == "custom":
            call.kind = "custom_tool_call"
            call.id = "ctc_" + call.id[3:]
            added = {"type": "custom_tool_call", "id": call.id, "call_id": cid, "name": call.name, "input": ""}
        else:
            added = {"type": "function_call", "id": call.id, "call_id": cid, "name": call.name,
                     "arguments": "", "status": "in_progress"}
        if ns:
            added["namespace"] = ns
        self._add(call, added)
        if call.parts and call.kind == "function_call" and self._emit:  # arguments that came before the name
            self._event({"type": "response.function_call_arguments.delta", "sequence_number": 0,
                         "item_id": call.id, "output_index": call.index, "delta": call.text()})

    def _call_final(self, call: _Item, status: str) -> dict:
        args = call.text()
        if call.kind == "custom_tool_call":
            final = {"type": "custom_tool_call", "id": call.id, "call_id": call.call_id,
                     "name": call.name, "input": _custom_input(args)}
        else:
            final = {"type": "function_call", "id": call.id, "call_id": call.call_id,
                     "name": call.name, "arguments": args, "status": status}
        if call.namespace:
            final["namespace"] = call.namespace
        return final

    def _close_call(self, call: _Item, status: str) -> None:
        if not call.open:
            return
        call.open = False
        if not call.announced:
            return  # never got a name: nothing a client could run
        call.final = final = self._call_final(call, status)
        if not self._emit:
            return
        if call.kind == "custom_tool_call":
            if final["input"]:
                self._event({"type": "response.custom_tool_call_input.delta", "sequence_number": 0,
                             "item_id": call.id, "output_index": call.index, "delta": final["input"]})
            self._event({"type": "response.custom_tool_call_input.done", "sequence_number": 0,
                         "item_id": call.id, "output_index": call.index, "input": final["input"]})
        else:
            self._event({"type": "response.function_call_arguments.done", "sequence_number": 0,
                         "item_id": call.id, "output_index": call.index, "arguments": final["arguments"]})
        self._event({"type": "response.output_item.done", "sequence_number": 0,
                     "output_index": call.index, "item": final})

    # ------------------------------------------------------------------ endings
    def _on_finish(self, reason: str) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        if reason == "abort":  # SGLang: the engine gave up on the request
            self._fail("upstream aborted the generation", "server_error", 1000, True)
            return
        item_status = "incomplete" if reason in ("length", "content_filter") else "completed"
        # Reasoning that was still running when the cap hit is cut short, too.
        self._close_reasoning(item_status)
        pending: list[_Item] = []
        if self._message is not None:
            pending.append(self._message)
        pending.extend(c for c in self._all_calls if c.announced)
        pending.sort(key=lambda it: it.index)
        for it in pending:
            if it.kind == "message":
                self._close_message(item_status)
            else:
                self._close_call(it, item_status)
        for c in self._all_calls:
            c.open = False

    def _end_of_stream(self) -> None:
        """[DONE] or EOF: the terminal event."""
        if self.done:
            return
        reason = self.finish_reason
        if reason is None:
            self._fail("upstream stream ended without a finish_reason", "server_error", 1000, True)
            return
        if reason == "length":
            self._terminal("incomplete", incomplete={"reason": "max_output_tokens"})
        elif reason == "content_filter":
            self._terminal("incomplete", incomplete={"reason": "content_filter"})
        else:
            # "stop" after a forced named call and "tool_calls" without calls are both fine
            self._terminal("completed")

    def _cut_at_cap(self) -> None:
        """An output delta past the cap sent upstream: the upstream ignores max_tokens. The
        response ends where it would have ("length"), nothing past the cap is shown or billed."""
        self.capped = True
        self._on_finish("length")
        if not self.done:
            self._end_of_stream()

    def _upstream_error(self, err: Any) -> None:
        if isinstance(err, dict):
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
        elif isinstance(raw, str) and raw in _ERROR_CODES:
            code = raw
        else:
            code = "server_error"
        retry = not (status is not None and 400 <= status < 500 and status != 429)
        self._fail(str(message), code, 1000 if retry else None, retry)

    def _fail(self, message: str, code: str, retry_after_ms: int | None, should_retry: bool,
              verbatim_code: bool = False) -> None:
        if self.done:
            return
        message = public_message(message)
        known = verbatim_code or code in _ERROR_CODES
        error: dict[str, Any] = {"code": code if known else "server_error", "message": message}
        if error["code"] != code:
            error["type"] = code
        extra = {"retry_after_ms": retry_after_ms, "x_should_retry": should_retry}
        self._terminal("failed", error=error, extra=extra)

    def _terminal(self, status: str, *, incomplete: dict | None = None, error: dict | None = None,
                  extra: dict | None = None) -> None:
        output = []
        for it in self._items:
            if it.final is None:  # still open: only on failure
                it.open = False
                if it.kind == "reasoning":
                    it.final = {"type": "reasoning", "id": it.id,
                                "summary": [{"type": "summary_text", "text": it.text()}] if self._clear else [],
                                "status": "incomplete"}
                elif it.kind == "message":
                    it.final = self._message_final(it, "incomplete")
                else:
                    it.final = self._call_final(it, "incomplete")
            output.append(it.final)
        r = dict(self._base)
        r["status"] = status
        r["output"] = output
        r["usage"] = (client_usage(self.usage, self._cap) if self.usage is not None
                      else _counted_usage(self.output_tokens_seen, self.reasoning_deltas_seen))
        r["incomplete_details"] = incomplete
        r["error"] = error
        if status == "completed":
            r["completed_at"] = _now()
        if extra:
            r.update(extra)
        self.response = r
        self.status = status
        self.done = True
        if self._emit:
            kind = _TERMINAL_EVENT.get(status, "response.failed")
            self._event({"type": kind, "sequence_number": 0, "response": r})
            self._out.append(_DONE)


def _carries_output(delta: Any) -> bool:
    """Whether a delta holds what counts as an output token (as _on_delta counts)."""
    if not isinstance(delta, dict):
        return False
    r = delta.get("reasoning")
    if r is None:
        r = delta.get("reasoning_content")
    c = delta.get("content")
    if (r and isinstance(r, str)) or (c and isinstance(c, str)):
        return True
    tcs = delta.get("tool_calls")
    if tcs and isinstance(tcs, list):
        for tc in tcs:
            fn = tc.get("function") if isinstance(tc, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if args is not None and (args or not isinstance(args, str)):  # as _tool_delta counts
                return True
    return False


def _counted_usage(output_tokens: int, reasoning_tokens: int) -> dict:
    """Usage when the upstream reported none: the deltas counted."""
    return {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": output_tokens,
    }


def _custom_input(args: str) -> str:
    """A custom tool travels upstream as a function with one string parameter `input`."""
    try:
        parsed = orjson.loads(args)
    except orjson.JSONDecodeError:
        return args
    if isinstance(parsed, dict) and "input" in parsed:
        v = parsed["input"]
        return v if isinstance(v, str) else orjson.dumps(v).decode()
    if isinstance(parsed, str):
        return parsed
    return args


def response_from_completion(ctx: ResponseContext, completion: dict) -> dict:
    """A non-stream chat.completion -> the Response object the equivalent stream ends with.

    The usual shapes are built directly (_response_direct); anything odd (errors, no choice
    at index 0 in front, "abort", a message or a function that is not an object, ...) drives
    the StreamRewriter with the message as one delta, which defines what the answer is."""
    if completion.__class__ is dict and not completion.get("error") and completion.get("object") != "error":
        choices = completion.get("choices")
        if choices.__class__ is list and choices:
            choice = choices[0]
            if choice.__class__ is dict and not choice.get("index"):
                msg = choice.get("message") or {}
                fr = choice.get("finish_reason") or "stop"
                if msg.__class__ is dict and fr.__class__ is str and fr != "abort":
                    calls = msg.get("tool_calls")
                    calls = _plain_calls(calls) if calls else []
                    if calls is not None:
                        return _response_direct(ctx, msg, fr, completion.get("usage"), calls)
    return _response_via_rewriter(ctx, completion)


def _plain_calls(calls: Any) -> list[dict] | None:
    """The tool_calls entries the rewriter would take (the objects), or None when one of
    them has a `function` that is not an object (left to the rewriter, which fails on it)."""
    if calls.__class__ is not list:
        return None
    plain = []
    for tc in calls:
        if isinstance(tc, dict):
            if not isinstance(tc.get("function") or {}, dict):
                return None
            plain.append(tc)
    return plain


def _response_direct(ctx: ResponseContext, msg: dict, fr: str, usage: Any, calls: list[dict]) -> dict:
    """What StreamRewriter makes of one delta {reasoning, content, tool_calls} and finish
    reason `fr` (not "abort"), without the rewriter, its items and the intermediate chunk.
    Ids are drawn in the same order: reasoning, message, then each call (and its call_id)."""
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    has_reasoning = bool(reasoning) and isinstance(reasoning, str)
    content = msg.get("content")
    has_text = bool(content) and isinstance(content, str)
    item_status = "incomplete" if fr == "length" or fr == "content_filter" else "completed"
    output: list[dict] = []
    if has_reasoning and ctx.reasoning_items:
        # closed as completed by the text or calls after it, else by the finish
        item = {"type": "reasoning", "id": "rs_" + _hex(),
                "summary": [{"type": "summary_text", "text": reasoning}]
                if ctx.seal is None or ctx.reasoning_in_clear else [],
                "status": "completed" if has_text or calls else item_status}
        if ctx.seal is not None:
            item["encrypted_content"] = ctx.seal(reasoning)
        output.append(item)
    if has_text:
        output.append({"type": "message", "id": "msg_" + _hex(), "status": item_status, "role": "assistant",
                       "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}]})
    counted = has_reasoning or has_text
    if calls and _append_calls(output, ctx, calls, item_status):
        counted = True
    r = _base_response(ctx)
    if fr == "length":
        r["status"] = "incomplete"
        r["incomplete_details"] = {"reason": "max_output_tokens"}
    elif fr == "content_filter":
        r["status"] = "incomplete"
        r["incomplete_details"] = {"reason": "content_filter"}
    else:
        r["status"] = "completed"
        r["completed_at"] = _now()
    r["output"] = output
    r["usage"] = (client_usage(map_usage(usage), ctx.output_cap) if isinstance(usage, dict)
                  else _counted_usage(int(counted), int(has_reasoning)))
    return r


def _append_calls(output: list[dict], ctx: ResponseContext, calls: list[dict], status: str) -> bool:
    """Append the final item of each named call (one without a name is nothing a client
    could run); True when any carried argument text. As _tool_delta + _announce_call +
    _call_final do for a call that arrives whole."""
    tools = ctx.tools
    allowed = ctx.allowed_tools
    call_ids: set = set()
    counted = False
    for tc in calls:
        fn = tc.get("function") or {}
        item_id = "fc_" + _hex()
        tid = tc.get("id") or None
        upstream_name = fn.get("name") or None
        args = fn.get("arguments")
        if args is not None and not isinstance(args, str):
            args = orjson.dumps(args).decode()
        if args:
            counted = True
        else:
            args = ""
        if not upstream_name or (allowed is not None and upstream_name not in allowed):
            continue
        kind, name, ns = _origin(tools.get(upstream_name) if tools else None)
        cid = tid or ("call_" + _hex())
        while cid in call_ids:  # call_id is the SDK's identity for a call: keep it unique
            cid = "call_" + _hex()
        call_ids.add(cid)
        if kind == "custom":
            item = {"type": "custom_tool_call", "id": "ctc_" + item_id[3:], "call_id": cid,
                    "name": name or upstream_name, "input": _custom_input(args)}
        else:
            item = {"type": "function_call", "id": item_id, "call_id": cid, "name": name or upstream_name,
                    "arguments": args, "status": status}
        if ns:
            item["namespace"] = ns
        output.append(item)
    return counted


def _response_via_rewriter(ctx: ResponseContext, completion: Any) -> dict:
    """The general case: the completion replayed through a StreamRewriter as one chunk."""
    rw = StreamRewriter(ctx)
    rw._emit = False
    rw.start()
    if not isinstance(completion, dict):
        rw._fail("upstream sent an invalid completion", "server_error", 1000, True)
        return rw.response
    if completion.get("error") or completion.get("object") == "error":
        rw._on_chunk(completion)
        return rw.response
    chunk: dict[str, Any] = {"usage": completion.get("usage")}
    choices = completion.get("choices")
    choice = None
    if isinstance(choices, list):
        choice = next((c for c in choices if isinstance(c, dict) and (c.get("index") or 0) == 0), None)
    if choice is None:
        rw._on_chunk(chunk)
        rw._fail("upstream completion has no choices", "server_error", 1000, True)
        return rw.response
    msg = choice.get("message") or {}
    delta: dict[str, Any] = {
        "reasoning": msg.get("reasoning") if msg.get("reasoning") is not None else msg.get("reasoning_content"),
        "content": msg.get("content"),
    }
    calls = msg.get("tool_calls")
    if calls:
        delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(calls) if isinstance(tc, dict)]
    chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason") or "stop"}]
    rw._on_chunk(chunk)
    rw._end_of_stream()
    return rw.response
