"""POST /v1/responses/compact (Open Responses 2026-04-24): a Responses request's input window
in, the compacted window out (`object: "response.compaction"`), nothing stored.

The request is the unit COMPACT (proxy.http.units): authenticated, limited, its body bounded and
counted, the key's models checked, whether or not the window is long enough to summarize. The
summary is one Responses turn run through `proxy.http.turn.run_turn`, the whole HTTP path with
this request's headers, as the unit COMPACT_SUMMARY: authenticated again, held and billed as any
request (its concurrency slot and rate token are the compact request's), and its usage is the
one reported. The cut and the sealed item are proxy.protocol.compaction's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from proxy import state
from proxy.http.errors import APIError, bad_request
from proxy.http.request import read_json
from proxy.http.turn import run_turn
from proxy.http.units import COMPACT_SUMMARY, UNBILLED_BODY
from proxy.policy.rules import apply_stateless, previous_response_mode
from proxy.protocol.compaction import as_output_item, compaction_item, split_window, summary_request, summary_text
from proxy.protocol.continuation import TERMINAL_EVENTS
from proxy.protocol.ids import random_bits
from proxy.protocol.seal import binding
from proxy.upstream.models import resolve_model

_ZERO_USAGE = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
               "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}


@dataclass(frozen=True)
class CompactSettings:
    keep_recent_items: int = 8
    max_summary_tokens: int = 2048
    instructions: str = "Summarize the conversation above for a model that will continue it."
    previous_response_id: str = "refuse"  # the operator's stateless policy (proxy.policy.rules)

    @classmethod
    def from_section(cls, section: dict[str, Any], stateless: dict[str, Any] | None = None) -> "CompactSettings":
        return cls(keep_recent_items=int(section.get("keep_recent_items", cls.keep_recent_items)),
                   max_summary_tokens=int(section.get("max_summary_tokens", cls.max_summary_tokens)),
                   instructions=str(section.get("instructions") or cls.instructions),
                   previous_response_id=previous_response_mode(stateless or {}))


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
        raise bad_request("Invalid 'input': expected a string or an array of items.", param="input", code="invalid_type")
    return value


async def _summarize(request: web.Request, body: dict[str, Any], older: list[Any],
                     settings: CompactSettings) -> dict[str, Any] | web.Response:
    """-> the summary turn's final Response object, or the refusal to pass on as it is."""
    terminal: dict[str, Any] = {}

    async def emit(name: str, data: bytes) -> None:
        if name in TERMINAL_EVENTS:
            terminal.update(orjson.loads(data))

    turn = summary_request(body, older, settings.instructions, settings.max_summary_tokens)
    answer = await run_turn(request, orjson.dumps({**turn, "stream": True}), emit, unit=COMPACT_SUMMARY)
    notice = request.app.get(state.NOTICES_HEADER)
    if notice is not None and notice in answer.headers:  # the summary turn's notices, on this answer
        state.context(request).notices.append(answer.headers[notice])
    if not answer.streamed:
        headers = {k: v for k, v in answer.headers.items() if k.lower() in ("retry-after", "x-should-retry")}
        return web.Response(status=answer.status, body=answer.body, content_type="application/json", headers=headers)
    response = terminal.get("response")
    if not isinstance(response, dict) or response.get("status") not in ("completed", "incomplete"):
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


async def compact_handler(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    settings = request.app.get(state.COMPACT_SETTINGS) or CompactSettings()
    items = _window(body, settings)
    _check_model(request, body["model"])
    sealer = request.app.get(state.SEALER)
    if sealer is None:
        raise APIError(501, "Compaction needs a sealing key: the operator has not configured reasoning_seal.keys.",
                       code="compaction_unavailable")
    older, recent = split_window(items, settings.keep_recent_items)
    kept = [as_output_item(item) for item in recent]
    if not older:  # nothing to summarize: the window is already as short as it gets
        answer = orjson.dumps({"id": f"resp_{random_bits(128):032x}", "object": "response.compaction",
                               "created_at": int(time.time()), "output": kept, "usage": _ZERO_USAGE})
        # Free of charge, so bounded as free work is: a small compressed body must not buy an
        # answer of server.max_body_bytes.
        limit = int(request.app[state.CONFIG].section("server")[UNBILLED_BODY])
        if len(answer) > limit:
            raise APIError(413, f"A window with nothing to summarize is answered free of charge up to {limit} bytes; "
                                "this one is larger.", code="request_too_large")
        return web.Response(body=answer, content_type="application/json")
    response = await _summarize(request, body, older, settings)
    if isinstance(response, web.Response):
        return response
    summary = summary_text(response)
    if not summary:
        raise APIError(502, "The model wrote an empty summary.", code="upstream_error")
    seal = sealer.bound(binding(state.context(request).key))[0]
    answer = {"id": response.get("id"), "object": "response.compaction", "created_at": response.get("created_at"),
              "output": [compaction_item(summary, seal), *kept], "usage": response.get("usage") or _ZERO_USAGE}
    return web.Response(body=orjson.dumps(answer), content_type="application/json")
