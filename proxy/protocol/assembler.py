"""Delta events -> Responses events: the state machine of output items (sans-I/O).

    asm = Assembler(ctx, encoder)      # encoder: SSEEncoder, or Discard for the final response only;
                                       # it is handed proxy.protocol.events objects
    asm.start()                        # response.created + response.in_progress
    asm.feed(events)                   # proxy.protocol.deltas events, in order
    asm.fail(message, code=...)        # a timeout / reset after the headers went out
    asm.response                       # the terminal Response once `done`

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

The output cap: an OUTPUT_TOKEN past ctx.output_cap means the upstream ignored the
max_tokens it was sent; the response ends there as if it had said "length" (`capped`),
and nothing past the cap is shown or billed. Nothing else enforces it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import orjson

from proxy.protocol.deltas import (
    End,
    Finish,
    Invalid,
    OutputToken,
    Reasoning,
    Text,
    TextRun,
    ToolCallFragment,
    UpstreamError,
    Usage,
)
from proxy.protocol.encoder import Encoder
from proxy.protocol.events import (
    ContentPartAdded,
    ContentPartDone,
    CustomToolCallInputDelta,
    CustomToolCallInputDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    ReasoningSummaryPartAdded,
    ReasoningSummaryPartDone,
    ReasoningSummaryTextDelta,
    ReasoningSummaryTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    TerminalEvent,
)
from proxy.protocol.response import (
    ERROR_CODES,
    ResponseContext,
    base_response,
    client_usage,
    counted_usage,
    map_usage,
    public_message,
)

__all__ = ["INCOMPLETE_REASONS", "Assembler", "message_item"]

_TERMINAL_EVENT: dict[str, type[TerminalEvent]] = {"completed": ResponseCompleted, "incomplete": ResponseIncomplete}
# finish_reason -> the response's incomplete_details.reason (any other ends it completed)
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}
_INCOMPLETE = INCOMPLETE_REASONS


class _Item:
    __slots__ = ("kind", "id", "index", "parts", "final", "upstream_id", "call_id", "name", "namespace", "announced")

    def __init__(self, kind: str, item_id: str) -> None:
        self.kind = kind  # reasoning | message | function_call | custom_tool_call
        self.id = item_id
        self.index = -1  # output_index, once announced
        self.parts: list[str] = []
        self.final: dict | None = None  # the item as done (set when it closes)
        self.upstream_id: str | None = None
        self.call_id: str | None = None
        self.name: Any = None
        self.namespace: str | None = None
        self.announced = False

    def text(self) -> str:
        parts = self.parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""


def _origin(origin: Any) -> tuple[str, str | None, str | None]:
    """(kind, name, namespace) of a ToolOrigin (or anything shaped like one, dicts included)."""
    if origin is None:
        return "function", None, None
    if isinstance(origin, dict):
        return origin.get("kind") or "function", origin.get("name"), origin.get("namespace")
    get = getattr
    return get(origin, "kind", None) or "function", get(origin, "name", None), get(origin, "namespace", None)


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


def message_item(item_id: str, status: str, text: str) -> dict:
    """An assistant message output item as it ends: its one output_text part."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


class Assembler:
    def __init__(self, ctx: ResponseContext, encoder: Encoder) -> None:
        self.ctx = ctx
        self.done = False
        self.status = "in_progress"
        # The chat usage of the last chunk that carried one (continuous usage stats: every chunk,
        # so the prompt's count from the first one and the output so far), and the one before it;
        # `usage` maps it (map_usage) when read, not per chunk.
        self._raw_usage: dict | None = None
        self._raw_before: dict | None = None
        self._mapped: dict | None = None
        self._mapped_of: dict | None = None
        self.output_tokens_seen = 0
        self.reasoning_deltas_seen = 0
        self.finish_reason: str | None = None
        cap = ctx.output_cap
        self.cap = cap if cap is not None and cap >= 0 else None
        self.capped = False  # the upstream went past the cap: cut off (its connection must not be reused)
        self._enc = encoder
        self._clear = ctx.seal is None or ctx.reasoning_in_clear  # reasoning text may reach the client
        self._items: list[_Item] = []  # announced, visible items in output_index order
        self._reasoning: _Item | None = None
        self._message: _Item | None = None
        self._calls: dict[int, _Item] = {}  # upstream tool_call index -> current call
        self._all_calls: list[_Item] = []
        self._call_ids: set[str] = set()
        self._last_call_index: int | None = None
        self._base = base_response(ctx)
        self.response: dict = self._base  # the terminal response once done

    @property
    def usage(self) -> dict | None:
        """Responses-shaped (map_usage), only when the upstream reported usage: the last seen."""
        raw = self._raw_usage
        if raw is None:
            return None
        if self._mapped_of is not raw:
            self._mapped, self._mapped_of = map_usage(raw), raw
        return self._mapped

    # ------------------------------------------------------------------ input
    def start(self) -> None:
        base = self._base
        self._enc.event(ResponseCreated(base))
        self._enc.event(ResponseInProgress(base))

    def feed(self, events: Iterable[Any]) -> None:
        on = _ON
        for ev in events:
            if self.done:
                return
            on[ev.__class__](self, ev)

    def fail(self, message: str, code: str, retry_after_ms: int | None, should_retry: bool,
             verbatim_code: bool = False, usage: dict | None = None) -> None:
        """End as response.failed. `verbatim_code` keeps a code outside the SDK's closed set
        (insufficient_quota: what Codex reads as "stop, do not retry"). `usage` (chat-shaped):
        what the failed response shows instead of the usage last reported (the bill)."""
        if self.done:
            return
        if usage is not None:
            self._raw_usage = usage
        message = public_message(message)
        known = verbatim_code or code in ERROR_CODES
        error: dict[str, Any] = {"code": code if known else "server_error", "message": message}
        if error["code"] != code:
            error["type"] = code
        self._terminal("failed", error=error, extra={"retry_after_ms": retry_after_ms, "x_should_retry": should_retry})

    def end_of_input(self) -> None:
        """[DONE] or EOF: the terminal event."""
        if self.done:
            return
        reason = self.finish_reason
        if reason is None:
            self.fail("upstream stream ended without a finish_reason", "server_error", 1000, True)
        elif reason in _INCOMPLETE:
            self._terminal("incomplete", incomplete={"reason": _INCOMPLETE[reason]})
        else:
            # "stop" after a forced named call and "tool_calls" without calls are both fine
            self._terminal("completed")

    # ------------------------------------------------------------------ events
    def _usage(self, ev: Usage) -> None:
        self._raw_before = self._raw_usage  # continuous usage stats: the last one wins
        self._raw_usage = ev.usage

    def _token(self, _: OutputToken) -> None:
        if self.finish_reason is not None:
            return
        if self.cap is not None and self.output_tokens_seen >= self.cap:
            self._cut_at_cap()
        else:
            self.output_tokens_seen += 1

    def _reasoning_delta(self, ev: Reasoning) -> None:
        if self.finish_reason is not None:
            return
        self.reasoning_deltas_seen += 1
        if not self.ctx.reasoning_items:
            return
        it = self._reasoning
        if it is None:
            it = self._reasoning = _Item("reasoning", "rs_" + self.ctx.ids())
            self._announce(it, {"type": "reasoning", "id": it.id, "summary": [], "status": "in_progress"})
            if self._clear:
                self._enc.event(ReasoningSummaryPartAdded(it.id, it.index, 0, {"type": "summary_text", "text": ""}))
        it.parts.append(ev.text)
        if self._clear:
            self._enc.delta(ReasoningSummaryTextDelta, it.id, it.index, ev.text)

    def _text(self, ev: Text) -> None:
        if self.finish_reason is not None:
            return
        it = self._message
        if it is None or self._reasoning is not None:
            it = self._open_message()
        it.parts.append(ev.text)
        self._enc.delta(OutputTextDelta, it.id, it.index, ev.text)

    def _text_run(self, ev: TextRun) -> None:
        """Each text one output token, as that many OUTPUT_TOKEN + Text."""
        if self.finish_reason is not None:
            return
        texts = ev.texts
        cut = self.cap is not None and self.output_tokens_seen + len(texts) > self.cap
        if cut:
            texts = texts[:max(self.cap - self.output_tokens_seen, 0)]  # type: ignore[operator]
        if texts:
            it = self._open_message()
            it.parts.append(b"".join(texts).decode())
            self.output_tokens_seen += len(texts)
            self._enc.text_run(it.id, it.index, texts)
        if cut:
            self._cut_at_cap()

    def _open_message(self) -> _Item:
        self._close_reasoning("completed")
        it = self._message
        if it is None:
            it = self._message = _Item("message", "msg_" + self.ctx.ids())
            self._announce(it, {"type": "message", "id": it.id, "status": "in_progress", "role": "assistant",
                                "content": []})
            self._enc.event(ContentPartAdded(it.id, it.index, 0, {"type": "output_text", "text": "", "annotations": [],
                                                                  "logprobs": []}))
        return it

    def _tool_fragment(self, ev: ToolCallFragment) -> None:
        if self.finish_reason is not None:
            return
        self._close_reasoning("completed")
        call = self._call_for(ev)
        args = ev.arguments
        if args:
            call.parts.append(args)
        if not call.announced:
            if ev.name:
                self._announce_call(call, ev.name)
        elif args and call.kind == "function_call":
            self._enc.delta(FunctionCallArgumentsDelta, call.id, call.index, args)

    def _call_for(self, ev: ToolCallFragment) -> _Item:
        """The call a fragment belongs to (a new one when it starts one)."""
        idx, tid = ev.index, ev.id
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
            call = self._calls[idx] = _Item("function_call", "fc_" + self.ctx.ids())
            self._all_calls.append(call)
        if tid and not call.upstream_id:
            call.upstream_id = tid
        return call

    def _announce_call(self, call: _Item, upstream_name: Any) -> None:
        allowed = self.ctx.allowed_tools
        if allowed is not None and upstream_name not in allowed:
            return  # never announced: no event, no output item (its argument deltas are kept quiet)
        kind, name, ns = _origin(self.ctx.tools.get(upstream_name) if self.ctx.tools else None)
        call.name = name or upstream_name
        call.namespace = ns
        cid = call.upstream_id or ("call_" + self.ctx.ids())
        while cid in self._call_ids:  # call_id is the SDK's identity for a call: keep it unique
            cid = "call_" + self.ctx.ids()
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
        self._announce(call, added)
        if call.parts and call.kind == "function_call":  # arguments that came before the name
            self._enc.delta(FunctionCallArgumentsDelta, call.id, call.index, call.text())

    def _announce(self, item: _Item, added: dict) -> None:
        item.index = len(self._items)
        item.announced = True
        self._items.append(item)
        self._enc.event(OutputItemAdded(item.index, added))

    def _finish(self, ev: Finish) -> None:
        if self.finish_reason is not None:
            return
        reason = self.finish_reason = ev.reason
        if reason == "abort":  # SGLang: the engine gave up on the request
            self.fail("upstream aborted the generation", "server_error", 1000, True)
            return
        status = "incomplete" if reason in _INCOMPLETE else "completed"
        # Reasoning that was still running when the cap hit is cut short, too.
        self._close_reasoning(status)
        pending = [c for c in self._all_calls if c.announced]
        if self._message is not None:
            pending.append(self._message)
        for it in sorted(pending, key=lambda it: it.index):
            if it.kind == "message":
                self._close_message(status)
            else:
                self._close_call(it, status)

    def _end(self, _: End) -> None:
        self.end_of_input()

    def _invalid(self, ev: Invalid) -> None:
        self.fail(ev.message, "server_error", 1000, True)

    def _upstream_error(self, ev: UpstreamError) -> None:
        self.fail(ev.message, ev.code, ev.retry_after_ms, ev.should_retry)

    def _cut_at_cap(self) -> None:
        self.capped = True
        usage = self.usage
        if usage is not None and self._raw_before is not None and (usage["output_tokens"] or 0) > (self.cap or 0):
            # The chunk that went past the cap carried its own running usage: the output seen is
            # what the chunk before it reported.
            self._raw_usage = self._raw_before
        self._finish(Finish("length"))
        self.end_of_input()

    # ------------------------------------------------------------------ closing items
    def _close_reasoning(self, status: str) -> None:
        it = self._reasoning
        if it is None:
            return
        self._reasoning = None
        text = it.text()
        it.final = final = self._reasoning_final(it, status)
        if self.ctx.seal is not None:
            final["encrypted_content"] = self.ctx.seal(text)
        enc = self._enc
        if self._clear:
            enc.event(ReasoningSummaryTextDone(it.id, it.index, 0, text))
            enc.event(ReasoningSummaryPartDone(it.id, it.index, 0, {"type": "summary_text", "text": text}))
        enc.event(OutputItemDone(it.index, final))

    def _reasoning_final(self, it: _Item, status: str) -> dict:
        return {"type": "reasoning", "id": it.id,
                "summary": [{"type": "summary_text", "text": it.text()}] if self._clear else [], "status": status}

    def _message_final(self, it: _Item, status: str) -> dict:
        return message_item(it.id, status, it.text())

    def _close_message(self, status: str) -> None:
        it = self._message
        if it is None or it.final is not None:
            return
        it.final = final = self._message_final(it, status)
        part = final["content"][0]
        enc = self._enc
        enc.event(OutputTextDone(it.id, it.index, 0, part["text"]))
        enc.event(ContentPartDone(it.id, it.index, 0, part))
        enc.event(OutputItemDone(it.index, final))

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
        if call.final is not None:
            return
        call.final = final = self._call_final(call, status)
        enc = self._enc
        if call.kind == "custom_tool_call":
            if final["input"]:
                enc.event(CustomToolCallInputDelta(call.id, call.index, final["input"]))
            enc.event(CustomToolCallInputDone(call.id, call.index, final["input"]))
        else:
            enc.event(FunctionCallArgumentsDone(call.id, call.index, final["arguments"]))
        enc.event(OutputItemDone(call.index, final))

    # ------------------------------------------------------------------ the end
    def _terminal(self, status: str, *, incomplete: dict | None = None, error: dict | None = None,
                  extra: dict | None = None) -> None:
        output = []
        for it in self._items:
            if it.final is None:  # still open: only on failure
                if it.kind == "reasoning":
                    it.final = self._reasoning_final(it, "incomplete")
                elif it.kind == "message":
                    it.final = self._message_final(it, "incomplete")
                else:
                    it.final = self._call_final(it, "incomplete")
            output.append(it.final)
        r = dict(self._base)
        r["status"] = status
        r["output"] = output
        r["usage"] = (client_usage(self.usage, self.cap) if self.usage is not None
                      else counted_usage(self.output_tokens_seen, self.reasoning_deltas_seen))
        r["incomplete_details"] = incomplete
        r["error"] = error
        if status == "completed":
            r["completed_at"] = self.ctx.clock()
        if extra:
            r.update(extra)
        self.response = r
        self.status = status
        self.done = True
        self._enc.event(_TERMINAL_EVENT.get(status, ResponseFailed)(r))
        self._enc.end()


# Event class -> its handler (plain functions: bound methods kept on the instance would make
# every assembler a reference cycle, alive until the cyclic GC).
_ON: dict[type, Callable[[Assembler, Any], None]] = {
    Text: Assembler._text, OutputToken: Assembler._token, Reasoning: Assembler._reasoning_delta,
    ToolCallFragment: Assembler._tool_fragment, TextRun: Assembler._text_run, Usage: Assembler._usage,
    Finish: Assembler._finish, End: Assembler._end, Invalid: Assembler._invalid,
    UpstreamError: Assembler._upstream_error}
