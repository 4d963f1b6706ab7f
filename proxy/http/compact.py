"""POST /v1/responses/compact (Open Responses 2026-04-24): a Responses request's input window
in, the compacted window out (`object: "response.compaction"`), nothing stored.

The compacted window is the openai SDK's `CompactedResponse`: the latest user messages of the
window as they were (at most `keep_recent_items`, as item resources), then one `compaction` item,
the summary of the whole window sealed to the caller's key (proxy.protocol.compaction). A window
of user messages that are all kept has nothing to summarize: it comes back as it is, free.

The request is the unit COMPACT (proxy.units): authenticated, limited, its body bounded and
counted, the key's models checked, whether or not the window is long enough to summarize. The
summary is the window with a `compaction_trigger` item, run through `proxy.http.turn.run_turn`,
the whole HTTP path with this request's headers, as the unit COMPACT_SUMMARY: authenticated
again, translated (the summary's request: thinking off, its cap fitted to the model's window),
held and billed as any request (its concurrency slot and rate token are the compact request's),
and answered by proxy.http.compaction_trigger with the sealed compaction item; its usage is the
one reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError, bad_request
from proxy.http.compaction_trigger import carry_notices
from proxy.http.request import read_json
from proxy.http.turn import run_turn
from proxy.policy.rules import apply_stateless, previous_response_mode
from proxy.protocol.compaction import (
    TRIGGER,
    SummaryAsk,
    compaction_of,
    kept_user_messages,
)
from proxy.protocol.events import Event, TerminalEvent
from proxy.protocol.ids import random_bits
from proxy.protocol.models import resolve_model
from proxy.units import COMPACT_SUMMARY, UNBILLED_BODY

if TYPE_CHECKING:  # for annotations only
    from proxy.config.load import Config

_ZERO_USAGE = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
               "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}


@dataclass(frozen=True)
class CompactSettings:
    keep_recent_items: int
    max_summary_tokens: int
    instructions: str
    previous_response_id: str  # the operator's stateless policy (proxy.policy.rules)

    @classmethod
    def of(cls, config: Config) -> CompactSettings:
        """config.yaml `compact`, with what `stateless` says of previous_response_id."""
        compact = config.compact
        return cls(keep_recent_items=compact.keep_recent_items, max_summary_tokens=compact.max_summary_tokens,
                   instructions=compact.instructions, previous_response_id=previous_response_mode(config.stateless))

    @property
    def ask(self) -> SummaryAsk:
        """How the translation asks for a summary (a compaction_trigger's request)."""
        return SummaryAsk(self.instructions, self.max_summary_tokens)


def _window(body: dict[str, Any], settings: CompactSettings) -> list[Any]:
    model = body.get("model")
    if model is None:
        raise bad_request("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise bad_request("Invalid 'model': expected a non-empty string.", param="model", code="invalid_type")
    # The window is the whole conversation: an ignored previous_response_id is left out.
    value = apply_stateless(body, settings.previous_response_id).get("input")
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise bad_request("Invalid 'input': expected a string or an array of items.", param="input",
                          code="invalid_type")
    return value


def _summary_turn(body: dict[str, Any], window: list[Any]) -> dict[str, Any]:
    """The summary turn's request: the window with a compaction_trigger (its answer is the
    sealed compaction item), the client's system prompt and cache key."""
    turn: dict[str, Any] = {"model": body["model"], "input": [*window, {"type": TRIGGER}], "store": False,
                            "stream": True}
    for name in ("instructions", "prompt_cache_key"):
        if body.get(name) is not None:
            turn[name] = body[name]
    return turn


async def _summarize(request: web.Request, body: dict[str, Any], window: list[Any]) -> dict[str, Any] | web.Response:
    """-> the summary turn's final Response object, or the refusal to pass on as it is."""
    terminal: list[TerminalEvent] = []  # the turn's last event

    def on_event(event: Event) -> Event:
        if isinstance(event, TerminalEvent):
            terminal.append(event)
        return event

    answer = await run_turn(request, orjson.dumps(_summary_turn(body, window)), unit=COMPACT_SUMMARY,
                            on_event=on_event)
    carry_notices(request, answer)
    if not answer.streamed:
        headers = {k: v for k, v in answer.headers.items() if k.lower() in ("retry-after", "x-should-retry")}
        return web.Response(status=answer.status, body=answer.body, content_type="application/json", headers=headers)
    response = terminal[-1].response if terminal else None
    if not isinstance(response, dict) or response.get("status") != "completed" or compaction_of(response) is None:
        error = (response or {}).get("error") or {}
        raise APIError(502, f"The summary could not be written: {error.get('message') or 'the model failed'}",
                       code=error.get("code") or "upstream_error")
    return response


def _check_model(request: web.Request, model: str) -> None:
    """A model nobody serves is a 404 here too (a short window is answered without a turn)."""
    pool = request.app.get(state.POOL)
    if pool is not None and resolve_model(model, pool.serves) is None:
        raise APIError(404, f"The model '{model[:128]}' does not exist or is not served here.",
                       code="model_not_found", param="model")


def _as_it_is(request: web.Request, kept: list[Any]) -> web.Response:
    """A window with nothing to summarize, answered free of charge, so bounded as free work is:
    a small compressed body must not buy an answer of server.max_body_bytes."""
    answer = orjson.dumps({"id": f"resp_{random_bits(128):032x}", "object": "response.compaction",
                           "created_at": int(time.time()), "output": kept, "usage": _ZERO_USAGE})
    limit = getattr(request.app[state.CONFIG].server, UNBILLED_BODY)
    if len(answer) > limit:
        raise APIError(413, f"A window with nothing to summarize is answered free of charge up to {limit} bytes; "
                            "this one is larger.", code="request_too_large")
    return web.Response(body=answer, content_type="application/json")


async def compact_handler(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    settings = request.app[state.COMPACT_SETTINGS]
    items = _window(body, settings)
    _check_model(request, body["model"])
    if request.app.get(state.SEALER) is None:
        raise APIError(501, "Compaction needs a sealing key: the operator has not configured reasoning_seal.keys.",
                       code="compaction_unavailable")
    kept, whole = kept_user_messages(items, settings.keep_recent_items)
    if whole:  # nothing but the messages kept: the window is already as short as it gets
        return _as_it_is(request, kept)
    response = await _summarize(request, body, items)
    if isinstance(response, web.Response):
        return response
    # The user messages, then one compaction item (the openai SDK's CompactedResponse).
    answer = {"id": response.get("id"), "object": "response.compaction", "created_at": response.get("created_at"),
              "output": [*kept, compaction_of(response)], "usage": response.get("usage") or _ZERO_USAGE}
    return web.Response(body=orjson.dumps(answer), content_type="application/json")
