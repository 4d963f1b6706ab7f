"""A Responses request whose input ends with a `compaction_trigger` item (Codex's remote
compaction v2; the openai SDK's `CompactionTrigger`), answered statelessly with one `compaction`
output item: the summary of the whole window, sealed to the caller's key.

The request is an ordinary one: its unit (POST /v1/responses, a WebSocket `response.create`,
the summary turn of /v1/responses/compact) runs every phase it declares on the client's own
body. The translation (proxy.protocol.translate) made it the summary's request: the window, then
the summary instructions as the last user message, thinking switched off, the proxy's own output
cap (fitted to the model's window by the context check, proxy.upstream.routing); the balance
held for it. This handler forwards it (proxy.http.responses_handler.forward: the upstream answer read
whole) and answers, as events (an HTTP event stream, or a transport's turn) or as JSON:

    response.created, response.in_progress, response.output_item.added (the compaction item),
    response.output_item.done, response.completed (output: [the compaction item], the usage)

which is what Codex collects (codex-rs compact_remote_v2: exactly one compaction output item,
then response.completed).

A model that answers all reasoning and no text (it ignored the switch, or thought up to the cap):
the summary is asked for once more, differently: without the switch and without a cap (the room
the window leaves), as the unit COMPACT_SUMMARY (its own hold and bill); the first answer is
billed as it stands, as the request's own, when this handler returns. Its usage is added to the
answer's; a second empty answer is a 502.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.http.event_stream import open_event_stream
from proxy.http.responses_handler import forward
from proxy.http.turn import TURN, TurnAnswer, run_turn
from proxy.protocol.compaction import compaction_item, summary_text, take_trigger
from proxy.protocol.events import (
    Event,
    OutputItemAdded,
    OutputItemDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseInProgress,
    TerminalEvent,
)
from proxy.protocol.seal import binding
from proxy.protocol.translate import Translation
from proxy.state import RequestContext, Tail
from proxy.units import COMPACT_SUMMARY


async def answer_trigger(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    """After the phases: the translated compaction_trigger request, answered."""
    first = await forward(request, ctx)  # the translation asked for JSON: a web.Response, not yet sent
    response = orjson.loads(first.body)  # type: ignore[attr-defined]  # that web.Response's bytes
    summary = summary_text(response)
    usage = response.get("usage")
    if not summary:
        summary, more = await _once_more(request, ctx)
        usage = add_usage(usage, more)
    if not summary:
        raise APIError(502, "The model wrote an empty summary.", code="upstream_error")
    item = compaction_item(summary, request.app[state.SEALER].bound(binding(ctx.key))[0])
    final = {**response, "status": "completed", "incomplete_details": None, "error": None, "output": [item],
             "usage": usage, "completed_at": response.get("completed_at") or int(time.time())}
    return await _answer(request, ctx, final)


async def _answer(request: web.Request, ctx: RequestContext, final: dict[str, Any]) -> web.StreamResponse:
    turn = request.get(TURN)
    if turn is None and not (ctx.body or {}).get("stream"):
        return web.Response(body=orjson.dumps(final), content_type="application/json")
    stream, enc = open_event_stream(request)
    await stream.prepare(request)  # before the first event: the transport's say in the headers
    started = {**final, "status": "in_progress", "output": [], "usage": None, "completed_at": None}
    item = final["output"][0]
    enc.event(ResponseCreated(started))
    enc.event(ResponseInProgress(started))
    enc.event(OutputItemAdded(0, item))
    enc.event(OutputItemDone(0, item))
    enc.event(ResponseCompleted(final))
    enc.end()
    ctx.tail = Tail(stream, enc.take(), True)  # written once the answer is billed (proxy.state.Tail)
    return stream


async def _once_more(request: web.Request, ctx: RequestContext) -> tuple[str, dict | None]:
    """The summary asked for again as an ordinary request: the window, the instructions, no
    thinking switch, no output cap; run as the unit COMPACT_SUMMARY. -> (its text, its usage)."""
    body = ctx.body or {}
    items, _ = take_trigger(body.get("input"))
    t = ctx.translation
    assert isinstance(t, Translation) and t.compaction is not None  # translated with its ask
    ask = t.compaction
    again: dict[str, Any] = {"model": body.get("model"),
                             "input": [*items, {"role": "user", "content": ask.instructions}],
                             "store": False, "stream": True}
    for name in ("instructions", "prompt_cache_key"):
        if body.get(name) is not None:
            again[name] = body[name]
    terminal: list[TerminalEvent] = []  # the turn's last event

    def on_event(event: Event) -> Event:
        if isinstance(event, TerminalEvent):
            terminal.append(event)
        return event

    answer = await run_turn(request, orjson.dumps(again), unit=COMPACT_SUMMARY, on_event=on_event)
    carry_notices(request, answer)
    if not answer.streamed:
        raise refusal(answer)
    response = terminal[-1].response if terminal else None
    if not isinstance(response, dict) or response.get("status") not in ("completed", "incomplete"):
        error = (response or {}).get("error") or {}
        raise APIError(502, f"The summary could not be written: {error.get('message') or 'the model failed'}",
                       code=error.get("code") or "upstream_error")
    return summary_text(response), response.get("usage")


def carry_notices(request: web.Request, answer: TurnAnswer) -> None:
    """A summary turn's notices (x-token-notice), on the answer of the request that ran it."""
    notice = request.app.get(state.NOTICES_HEADER)
    if notice is not None and notice in answer.headers:
        state.context(request).notices.append(answer.headers[notice])


def refusal(answer: TurnAnswer) -> APIError:
    """A turn's refusal (its JSON error envelope) as the error of the request that ran it."""
    try:
        error = orjson.loads(answer.body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    error = error if isinstance(error, dict) else {}
    headers = {k: v for k, v in answer.headers.items() if k.lower() in ("retry-after", "x-should-retry")}
    message = error["message"] if isinstance(error.get("message"), str) else "The summary could not be written."
    return APIError(answer.status, message, code=error.get("code"), param=error.get("param"),
                    type=error.get("type"), headers=headers)


_ZERO = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
         "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}


def add_usage(a: dict | None, b: dict | None) -> dict:
    """Two Responses usages as one (every count summed)."""
    out: dict[str, Any] = {}
    for key, zero in _ZERO.items():
        x, y = (a or {}).get(key), (b or {}).get(key)
        if isinstance(zero, dict):
            out[key] = {k: int((x or {}).get(k) or 0) + int((y or {}).get(k) or 0) for k in zero}
        else:
            out[key] = int(x or 0) + int(y or 0)
    return out
