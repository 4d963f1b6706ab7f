"""Compaction of an input window (POST /v1/responses/compact), sans-I/O.

A window is cut in two: the recent items (from the last user message on, at most
`keep_recent_items`, never starting on a tool output without its call) stay as they are; the
older ones are summarized by the model, and the summary travels as a `compaction` item whose
`encrypted_content` is the proxy's seal (proxy.protocol.seal, bound to the caller's API key)
of the summary text. When the window comes back in a later request, the translation opens the
item (`compaction_message`) into a user message carrying the summary; an item in this proxy's
seal format that it cannot open is a 400, never a silently shorter context (another provider's
compaction item is replayed as a placeholder, as any hosted item).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.http.errors import bad_request
from proxy.protocol.ids import random_bits

# Sealed text of a compaction starts with this, so a reasoning ciphertext cannot pose as one.
_TAG = "compaction\x00"
SUMMARY_HEADER = "Summary of the earlier part of this conversation (compacted):\n\n"
# proxy.protocol.seal's token prefix (seal.PREFIX + "."; importing it would close an import
# cycle through proxy.state; tests/test_compact.py checks they agree).
SEAL_FORMAT = "rp2."
_TOOL_OUTPUTS = ("function_call_output", "custom_tool_call_output")
_USER_ROLES = ("user",)


def _kind(item: Any) -> str | None:
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if kind is None and "role" in item:
        return "message"
    return kind if isinstance(kind, str) else None


def split_window(items: list[Any], keep_recent: int) -> tuple[list[Any], list[Any]]:
    """-> (older, recent). Recent: from the last user message on, at most `keep_recent` items
    (and at least one, so there is something older to summarize whenever the window has two)."""
    if len(items) < 2:
        return [], list(items)
    last_user = max((i for i, it in enumerate(items)
                     if _kind(it) == "message" and it.get("role") in _USER_ROLES), default=len(items) - 1)
    cut = max(last_user, len(items) - keep_recent, 1)
    cut = min(cut, len(items) - 1)
    # A tool output needs its call before it: move the cut back over outputs and their calls.
    while cut > 0 and _kind(items[cut]) in _TOOL_OUTPUTS:
        cut -= 1
    while cut > 0 and _kind(items[cut - 1]) in ("function_call", "custom_tool_call", "reasoning"):
        cut -= 1
    return items[:cut], items[cut:]


def summary_request(body: dict[str, Any], older: list[Any], instructions: str, max_tokens: int) -> dict[str, Any]:
    """The Responses request whose answer is the summary of `older`."""
    request: dict[str, Any] = {
        "model": body["model"],
        "input": [*older, {"type": "message", "role": "user", "content": instructions}],
        "store": False,
        "max_output_tokens": max_tokens,
    }
    for name in ("instructions", "prompt_cache_key"):
        if body.get(name) is not None:
            request[name] = body[name]
    return request


def summary_text(response: dict[str, Any]) -> str:
    """The text the model wrote in a Response object."""
    texts = []
    for item in response.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or []:
                if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
    return "".join(texts).strip()


def compaction_item(summary: str, seal: Callable[[str], str]) -> dict[str, Any]:
    return {"type": "compaction", "id": f"cmp_{random_bits(128):032x}", "encrypted_content": seal(_TAG + summary)}


def is_sealed_here(item: dict[str, Any]) -> bool:
    """A compaction item in this proxy's seal format (another provider's is replayed as a
    hosted item: a placeholder)."""
    sealed = item.get("encrypted_content")
    return isinstance(sealed, str) and sealed.startswith(SEAL_FORMAT)


def compaction_message(item: dict[str, Any], param: str, unseal: Callable[[str], str | None] | None) -> dict:
    """A compaction input item -> the chat message that carries its summary; 400 when it cannot be opened."""
    sealed = item.get("encrypted_content")
    if not isinstance(sealed, str) or not sealed:
        raise bad_request("A compaction item needs its 'encrypted_content' string.",
                          param=f"{param}.encrypted_content", code="invalid_encrypted_content")
    try:
        opened = unseal(sealed) if unseal is not None else None
    except Exception:  # SealExpired and any failure of the hook: the summary is gone either way
        opened = None
    if not isinstance(opened, str) or not opened.startswith(_TAG):
        raise bad_request("This compaction item cannot be opened here (made for another API key, by another "
                          "deployment, expired, or altered): compact the window again.",
                          param=f"{param}.encrypted_content", code="invalid_encrypted_content")
    return {"role": "user", "content": SUMMARY_HEADER + opened[len(_TAG):]}


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{random_bits(96):024x}"


def _parts(content: Any, role: str) -> Any:
    if isinstance(content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": content}
        if kind == "output_text":
            part["annotations"] = []
        return [part]
    return content


def as_output_item(item: Any) -> Any:
    """A kept input item in the shape of an item resource (ids, status, content parts), as
    the spec's compacted window lists them; anything unfamiliar is kept as sent."""
    kind = _kind(item)
    if kind == "message":
        role = item.get("role", "user")
        return {"type": "message", "id": item.get("id") or _hex_id("msg"), "status": item.get("status") or "completed",
                "role": role, "content": _parts(item.get("content"), role)}
    if kind in ("function_call", "function_call_output"):
        prefix = "fc" if kind == "function_call" else "fco"
        return {**item, "id": item.get("id") or _hex_id(prefix), "status": item.get("status") or "completed"}
    if kind == "reasoning":
        return {**item, "id": item.get("id") or _hex_id("rs"), "summary": item.get("summary") or []}
    return item
