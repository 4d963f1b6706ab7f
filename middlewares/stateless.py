"""Refuse what needs stored state: this proxy stores nothing (004 doc, "Stateless").

`previous_response_id` is refused by default; `previous_response_id: ignore` follows the
000 doc instead and drops it. `store: true` is accepted and nothing is stored.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

from aiohttp import web

from proxy.config import ConfigError
from proxy.errors import APIError
from proxy.request import read_json

_GUARDED_PATHS = ("/v1/responses", "/v1/responses/input_tokens")


def _refuse(message: str, param: str) -> APIError:
    return APIError(400, message, code="stateless_only", param=param)


def _item_reference_at(items: list) -> int | None:
    """The index of the first item_reference item, if any."""
    # Long conversations have hundreds of items: look through their types in C first
    # (dict.get over the list); only a hit, or an item that is not an object, walks them.
    try:
        if "item_reference" not in map(dict.get, items, repeat("type")):
            return None
    except TypeError:  # an item that is not an object: the translation refuses it later
        pass
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            return i
    return None


def create(section: dict[str, Any], app: web.Application):
    mode = section.get("previous_response_id", "refuse")
    if mode not in ("refuse", "ignore"):
        raise ConfigError(f"stateless.previous_response_id must be 'refuse' or 'ignore', not {mode!r}")

    @web.middleware
    async def stateless(request: web.Request, handler):
        if request.method != "POST" or request.path not in _GUARDED_PATHS:
            return await handler(request)
        body = await read_json(request)
        if body.get("previous_response_id") is not None:
            if mode == "refuse":
                raise _refuse("previous_response_id is not supported: this endpoint is stateless; "
                              "send the whole conversation in input.", "previous_response_id")
            body.pop("previous_response_id")
        if body.get("background") is True:
            raise _refuse("background mode needs stored state: stream the response or wait for it.", "background")
        if body.get("prompt") is not None:
            raise _refuse("Stored prompts are not supported: send instructions and input.", "prompt")
        items = body.get("input")
        if isinstance(items, list):
            at = _item_reference_at(items)
            if at is not None:
                raise _refuse("item_reference points at stored state: send the item itself.", f"input[{at}]")
        return await handler(request)

    return stateless
