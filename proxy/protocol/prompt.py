"""A chat prompt's size and the one upper bound of its tokens (pure).

`prompt_bytes(chat)` measures the text the chat template renders (UTF-8 bytes) and says
whether the prompt carries media. The Translation computes its bound once (Translation.prompt_bound).

`prompt_bound(chat, size, bytes_per_token)` is the prompt's bound, the one both the balance
(how much input to hold) and the context check (can the prompt fit?) use: every token of a
byte-level (or byte-fallback) tokenizer covers at least one byte of the rendered text, so the
text is at most as many tokens as its bytes; the template adds its own tokens in front of
everything (a default system prompt, the generation prompt), around each message and in front
of a tool list. Media are not bounded by any byte count: the bound carries their parts' size
as sent (so the balance holds for the size of what was sent) and the `media` flag, for which
the worker's tokenizer or report has the last word.
"""

from __future__ import annotations

from typing import NamedTuple

import orjson

__all__ = ["PER_MESSAGE_OVERHEAD", "PER_TOOL_CALL_OVERHEAD", "TEMPLATE_OVERHEAD", "TOOLS_OVERHEAD", "PromptBound",
           "prompt_bound", "prompt_bytes"]

# The chat template's own tokens: in front of everything, around each message, in front of a
# tool list (a tool-use preamble; the tools' JSON itself is in the bytes).
TEMPLATE_OVERHEAD = 256
PER_MESSAGE_OVERHEAD = 16
TOOLS_OVERHEAD = 512
# ...and around each tool call of an assistant message (tags, newlines: <tool_call>\n...\n</tool_call>),
# counted with the call's JSON in prompt_bytes (a message may carry any number of calls).
PER_TOOL_CALL_OVERHEAD = 8

_TEXT_KEYS = frozenset(("content", "reasoning_content", "reasoning", "name", "tool_call_id"))
# The roles a template renders as its own few tokens (the per-message overhead covers them); any
# other role string is rendered as sent (vLLM accepts any), so its bytes count.
_ROLES = frozenset(("system", "user", "assistant", "tool", "developer", "function"))


class PromptBound(NamedTuple):
    tokens: int  # at least the prompt's tokens when there are no media
    text: int  # the bytes it was computed from (the rendered text, and media parts as sent)
    media: bool  # images or other media: no byte count bounds their tokens


def _utf8_len(text: str) -> int:
    # isascii() is a flag check in CPython: an ASCII string's length is its UTF-8 size, no copy.
    return len(text) if text.isascii() else len(text.encode())


def _json_bytes(value: object) -> int:
    """The bytes of `value` as a template renders it as JSON: Jinja's tojson (transformers) writes
    ", " and ": ", one byte more than compact JSON per comma and colon (counting those inside
    strings too keeps it an upper bound, at C speed)."""
    raw = orjson.dumps(value)
    return len(raw) + raw.count(b",") + raw.count(b":")


def _parts_bytes(parts: list) -> tuple[int, bool]:
    total, media = 0, False
    for part in parts:
        if isinstance(part, dict):
            text = part.get("text")
            if isinstance(text, str):
                total += _utf8_len(text)
            elif part.get("type") not in (None, "text"):
                media = True
                total += len(orjson.dumps(part))  # as sent: a data URL's bytes, or just the URL's
        elif isinstance(part, str):
            total += _utf8_len(part)
    return total, media


def prompt_bytes(chat: dict) -> tuple[int, bool]:
    """(UTF-8 bytes of every text the template renders, with the JSON of tool calls and tools as
    tojson writes it, and of each media part as sent; whether the prompt carries media)."""
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
            elif key == "role":
                if isinstance(value, str) and value not in _ROLES:
                    total += _utf8_len(value)
            elif key == "tool_calls" and value:
                for call in value:
                    if isinstance(call, dict):
                        # The arguments as an escaped JSON string: at least the bytes of the object
                        # a template renders from them (vLLM parses them before rendering).
                        total += _json_bytes(call.get("function") or {}) + PER_TOOL_CALL_OVERHEAD
    if chat.get("tools"):
        total += _json_bytes(chat["tools"])
    return total, media


def prompt_bound(chat: dict, size: tuple[int, bool] | None = None, bytes_per_token: float = 1) -> PromptBound:
    """The upper bound of `chat`'s prompt tokens. `size`: its prompt_bytes when known (the
    text and media of a Translation's cached bound); bytes_per_token: at most 1 keeps it a bound (the
    balance's setting; below 1 it is more generous)."""
    text, media = prompt_bytes(chat) if size is None else size
    messages = chat.get("messages")
    n = len(messages) if isinstance(messages, list) else 1 if messages else 0
    overhead = TEMPLATE_OVERHEAD + PER_MESSAGE_OVERHEAD * n + (TOOLS_OVERHEAD if chat.get("tools") else 0)
    return PromptBound(int(-(-text // bytes_per_token)) + overhead, text, media)
