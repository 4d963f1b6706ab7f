"""The Responses API's Response object and usage, as the rewriter builds them (sans-I/O).

`ResponseContext` is what one answer needs to know about its request; `base_response` the
Response before any output; `map_usage` / `client_usage` / `counted_usage` the usage in
its three forms (as reported, as shown, as counted); `public_message` an upstream error as
a client may read it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proxy.protocol.ids import random_bytes

if TYPE_CHECKING:  # proxy.protocol.translate is written separately; only its shape matters here
    from proxy.protocol.translate import ToolOrigin

__all__ = ["ResponseContext", "base_response", "map_usage", "client_usage", "counted_usage", "public_message",
           "ERROR_CODES", "random_hex", "unix_time"]


def random_hex() -> str:
    """24 hex digits, unique (proxy.protocol.ids): the random part of item and call ids."""
    return random_bytes(12).hex()


def unix_time() -> int:
    return int(time.time())


@dataclass(slots=True)
class ResponseContext:
    response_id: str  # "resp_" + hex
    model: str  # as sent
    created_at: int
    echo: dict = field(default_factory=dict)  # from Translation.echo
    tools: dict[str, ToolOrigin] = field(default_factory=dict)  # upstream name -> origin
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
    # Where item ids and completed_at come from: the core stays pure (same input, same
    # bytes) when a caller passes deterministic ones, as the differential tests do.
    ids: Callable[[], str] = random_hex
    clock: Callable[[], int] = unix_time


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


# ResponseError.code is a closed set in the SDK; anything else is reported as server_error
# (the original code travels in error.type).
ERROR_CODES = frozenset(
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

_MAX_COUNT = 2**63 - 1


def _count(value: Any) -> int | None:
    """A reported token count, or None when it is not one (the ledger then bills its fallback)."""
    if value.__class__ is int:
        return value if 0 <= value <= _MAX_COUNT else None
    if value.__class__ is float and value.is_integer() and 0 <= value <= _MAX_COUNT:
        return int(value)
    return None


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


def counted_usage(output_tokens: int, reasoning_tokens: int) -> dict:
    """Usage when the upstream reported none: the deltas counted."""
    return {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": output_tokens,
    }


# Fields the rewriter owns; ctx.echo cannot override them.
_OWNED = frozenset({"id", "object", "created_at", "status", "model", "output", "usage", "error", "incomplete_details"})

# The Response object before any output, in the SDK's field order. Copied per response
# (one C-level dict copy instead of building 40 keys); None marks what base_response fills
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
    # too, until the response completes).
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


def base_response(ctx: ResponseContext) -> dict:
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
