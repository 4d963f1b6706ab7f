"""The size of a chat prompt's text, as the chat template renders it (pure).

`prompt_bytes(chat)` bounds a prompt's tokens from above (a byte-level or byte-fallback
token covers at least one byte) and says whether the prompt carries media, which no byte
count bounds. The Translation computes it once (Translation.prompt_size); the balance
(is the input billed by the bound?) and the context check (can the prompt fit?) read it.
"""

from __future__ import annotations

import orjson

__all__ = ["prompt_bytes"]

_TEXT_KEYS = frozenset(("content", "reasoning_content", "reasoning", "name", "tool_call_id"))


def _utf8_len(text: str) -> int:
    # isascii() is a flag check in CPython: an ASCII string's length is its UTF-8 size, no copy.
    return len(text) if text.isascii() else len(text.encode())


def _parts_bytes(parts: list) -> tuple[int, bool]:
    total, media = 0, False
    for part in parts:
        if isinstance(part, dict):
            text = part.get("text")
            if isinstance(text, str):
                total += _utf8_len(text)
            elif part.get("type") not in (None, "text"):
                media = True
        elif isinstance(part, str):
            total += _utf8_len(part)
    return total, media


def prompt_bytes(chat: dict) -> tuple[int, bool]:
    """(UTF-8 bytes of every text the template renders, whether the prompt carries media)."""
    total, media = 0, False
    for message in chat.get("messages") or []:
        if not isinstance(message, dict):
            continue
        # A message's own keys (usually just role and content), not a lookup of every text key.
        for key, value in message.items():
            if key in _TEXT_KEYS:
                if isinstance(value, str):
                    total += _utf8_len(value)
                elif isinstance(value, list):
                    size, has_media = _parts_bytes(value)
                    total += size
                    media = media or has_media
            elif key == "tool_calls" and value:
                for call in value:
                    if isinstance(call, dict):
                        total += len(orjson.dumps(call.get("function") or {}))
    if chat.get("tools"):
        total += len(orjson.dumps(chat["tools"]))
    return total, media
