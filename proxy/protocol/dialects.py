"""What each model server expects in the fields the translation leaves neutral.

The translation (proxy.protocol.translate) is done once per request, before a worker is chosen, so it
writes two things in a neutral form that this module adapts to the worker that gets the request:

* A replayed assistant message's reasoning. The translation writes `reasoning_content`.
  vLLM 0.32 reads `reasoning`: its chat endpoint renames `reasoning_content`, but its
  /tokenize does not, so a count of a replayed conversation would leave the reasoning out
  (the context check and the balance's count would undercount). SGLang reads
  `reasoning_content`.
* The thinking switch, a chat-template kwarg whose name depends on the model family
  (Qwen3, GLM: `enable_thinking`; DeepSeek V3.1: `thinking`). The translation writes
  `enable_thinking`; a worker's `thinking_switch` names what its model's template reads,
  or `none` to never send it.

Pure: dicts in, dicts out; the input is never mutated, and returned as is when nothing changes.
"""

from __future__ import annotations

from typing import Any

NEUTRAL_REASONING = "reasoning_content"
REASONING_FIELD = {"vllm": "reasoning", "sglang": "reasoning_content"}
NEUTRAL_SWITCH = "enable_thinking"
THINKING_SWITCHES = ("enable_thinking", "thinking", "none")


def messages_for(messages: list, dialect: str) -> list:
    """`messages` with each assistant's reasoning under the field `dialect` reads."""
    field = REASONING_FIELD.get(dialect, NEUTRAL_REASONING)
    if field == NEUTRAL_REASONING or not any(
            isinstance(m, dict) and NEUTRAL_REASONING in m for m in messages):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and NEUTRAL_REASONING in m:
            out.append({(field if k == NEUTRAL_REASONING else k): v for k, v in m.items()})
        else:
            out.append(m)
    return out


def chat_for(chat: dict[str, Any], dialect: str, thinking_switch: str = NEUTRAL_SWITCH) -> dict[str, Any]:
    """The chat request as a worker of `dialect` whose template reads `thinking_switch` expects it."""
    messages = chat.get("messages")
    adapted = messages_for(messages, dialect) if isinstance(messages, list) else messages
    kwargs = chat.get("chat_template_kwargs")
    switch_moves = (thinking_switch != NEUTRAL_SWITCH and isinstance(kwargs, dict) and NEUTRAL_SWITCH in kwargs)
    if adapted is messages and not switch_moves:
        return chat
    out = dict(chat)
    out["messages"] = adapted
    if switch_moves:
        assert isinstance(kwargs, dict)  # switch_moves says so
        kwargs = {k: v for k, v in kwargs.items() if k != NEUTRAL_SWITCH}
        if thinking_switch != "none":
            kwargs[thinking_switch] = chat["chat_template_kwargs"][NEUTRAL_SWITCH]
        if kwargs:
            out["chat_template_kwargs"] = kwargs
        else:
            del out["chat_template_kwargs"]
    return out
