"""Compaction of an input window, sans-I/O: the summary the model writes, sealed to the key.

Two ways in, one way the summary is written:

* a `compaction_trigger` input item, the last of an ordinary Responses request (Codex's
  remote compaction v2): the translation (proxy.protocol.translate) makes the request the
  summary's (`take_trigger`, `summary_chat`): the window, then the summary instructions as the
  last user message, the model's thinking switched off, and the output cap the proxy's own
  (`SummaryAsk.max_tokens`, fitted to the model's window by the context check, never refused
  as a client's cap would be); proxy.http.compaction_trigger answers it with one `compaction`
  output item.
* POST /v1/responses/compact (proxy.http.compact): the window with a trigger is that same
  request, run as the compact request's summary turn; its answer is the latest user messages
  as they are (`kept_user_messages`, at most `keep_recent_items`), then the compaction item:
  the openai SDK's `CompactedResponse` ("all user messages, followed by a single compaction
  item").

The summary covers the whole window. It travels as a `compaction` item whose
`encrypted_content` is the proxy's seal (proxy.protocol.seal, bound to the caller's API key)
of the summary text. When the item comes back in a later request, the translation opens it
(`compaction_message`) into a user message carrying the summary; an item in this proxy's seal
format that it cannot open is a 400, never a silently shorter context (another provider's
compaction item is replayed as a placeholder, as any hosted item).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from proxy.errors import bad_request
from proxy.protocol.ids import random_bits

# Sealed text of a compaction starts with this, so a reasoning ciphertext cannot pose as one.
_TAG = "compaction\x00"
SUMMARY_HEADER = "Summary of the conversation so far (compacted):\n\n"
# proxy.protocol.seal's token prefix (seal.PREFIX + "."; importing it would close an import
# cycle through proxy.state; tests/http/test_compact.py checks they agree).
SEAL_FORMAT = "rp2."
TRIGGER = "compaction_trigger"


class SummaryAsk(NamedTuple):
    """How a summary is asked for (config.yaml `compact`): its instructions and output cap."""

    instructions: str
    max_tokens: int


def _kind(item: Any) -> str | None:
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if kind is None and "role" in item:
        return "message"
    return kind if isinstance(kind, str) else None


def take_trigger(value: Any) -> tuple[Any, bool]:
    """(the input without its compaction_trigger, whether it had one). The trigger must be the
    last item (the openai SDK: "Must be the final input item"); anywhere else it is a 400."""
    if not isinstance(value, list) or not value:
        return value, False
    found = [i for i, item in enumerate(value) if _kind(item) == TRIGGER]
    if not found:
        return value, False
    if found[0] != len(value) - 1:
        raise bad_request("A compaction_trigger item must be the last input item.",
                          param=f"input[{found[0]}].type", code="invalid_compaction_trigger")
    return value[:-1], True


def without_trigger(items: list[Any]) -> list[Any]:
    """A window as a later request continues it: a compaction_trigger has done its work."""
    return [item for item in items if _kind(item) != TRIGGER]


def summary_chat(messages: list[dict], ask: SummaryAsk) -> list[dict]:
    """The summary request's messages: the window's, then the instructions as the user's."""
    return [*messages, {"role": "user", "content": ask.instructions}]


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


def compaction_of(response: dict[str, Any]) -> dict[str, Any] | None:
    """The compaction item of a Response object (a compaction_trigger's answer), if any."""
    for item in response.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "compaction":
            return item
    return None


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


def _user_item(item: dict[str, Any]) -> dict[str, Any]:
    """A user message input item as an item resource (id, status, content parts), the shape the
    spec's compacted window and the openai SDK's input message items have."""
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    ident, status = item.get("id"), item.get("status")
    return {"type": "message", "id": ident if isinstance(ident, str) and ident else f"msg_{random_bits(96):024x}",
            "status": status if status in ("in_progress", "completed", "incomplete") else "completed",
            "role": "user", "content": content}


def kept_user_messages(items: list[Any], keep: int) -> tuple[list[dict[str, Any]], bool]:
    """(the latest user messages of a window, at most `keep`, as item resources in their order;
    whether they are the whole window: then there is nothing to summarize)."""
    users = [i for i, item in enumerate(items) if _kind(item) == "message" and item.get("role") == "user"]
    chosen = users[-keep:] if keep > 0 else []
    return [_user_item(items[i]) for i in chosen], len(chosen) == len(items)
