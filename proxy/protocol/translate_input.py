"""The request's `input` (and `instructions`) -> chat-completions messages (pure). Consecutive
assistant-side items (text, reasoning, calls) become one assistant turn; sealed reasoning is opened
with TranslateOptions.unseal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from proxy.errors import bad_request
from proxy.policy.rules import item_reference_refusal
from proxy.protocol.compaction import compaction_message, is_sealed_here
from proxy.protocol.translate_options import REASONING_EFFORTS, TranslateOptions, add_notice, show

# Input items produced by hosted tools: replayed as an assistant-side note.
HOSTED_ITEM_TYPES: frozenset[str] = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "code_interpreter_call",
        "computer_call",
        "computer_call_output",
        "image_generation_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "tool_search_call",
        "tool_search_output",
        "compaction",
        "compaction_summary",
    }
)

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_UNSUPPORTED_PARTS = frozenset({"input_file", "input_audio", "file"})
_IMAGE_DETAILS = frozenset({"auto", "low", "high"})
# Items that may stand for earlier calls without showing them (a compaction's summary): a tool
# output after one may answer a call the client no longer sends.
_SUMMARY_ITEM_TYPES = frozenset({"compaction", "compaction_summary"})
_OUTPUT_NAMES = {"function_call_output": "function call output", "custom_tool_call_output": "custom tool call output"}
UNSEAL_FAILED = ("reasoning item dropped: encrypted_content could not be opened (sealed elsewhere, "
                  "for another API key, with a retired key, or altered)")
NO_SEAL_KEY = "encrypted_content ignored: no reasoning seal key is configured on this proxy"


def _text_of(part: dict, param: str) -> str:
    t = part.get("text")
    if t is None and part.get("type") == "refusal":
        t = part.get("refusal")
    if not isinstance(t, str):
        raise bad_request("Invalid content part: 'text' must be a string.", param=f"{param}.text")
    return t


def _image_part(part: dict, param: str) -> dict:
    url = part.get("image_url")
    if isinstance(url, dict):  # chat-completions shape, tolerated
        url = url.get("url")
    if url is None:
        if part.get("file_id") is not None:
            raise bad_request(
                "input_image with a file_id is not supported: send an image URL or a data URI.",
                param=param,
                code="unsupported_content",
            )
        raise bad_request("Missing required parameter: 'image_url'.", param=f"{param}.image_url")
    if not isinstance(url, str) or not (
        url.startswith(("https://", "http://", "data:"))
    ):
        raise bad_request("Invalid 'image_url': expected an http(s) URL or a data URI.", param=f"{param}.image_url")
    img: dict[str, Any] = {"url": url}
    detail = part.get("detail")
    if isinstance(detail, str) and detail in _IMAGE_DETAILS:
        img["detail"] = detail
    return {"type": "image_url", "image_url": img}


def _typed_parts(parts: list, param: str, what: str) -> Iterator[tuple[str, dict, Any]]:
    """(path, part, type) of each part of a content or output array; a non-object is a 400."""
    for j, part in enumerate(parts):
        pparam = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"Invalid {what} part: expected an object.", param=pparam)
        yield pparam, part, part.get("type")


def _message_content(content: Any, param: str, allow_images: bool) -> tuple[list[dict], bool]:
    """-> (chat parts, has_images). Parts are {"type":"text"} or {"type":"image_url"}."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}], False
    if not isinstance(content, list):
        raise bad_request("Invalid type for message 'content': expected a string or an array.", param=param)
    out: list[dict] = []
    has_images = False
    for pparam, part, ptype in _typed_parts(content, param, "content"):
        if isinstance(ptype, str) and ptype in _TEXT_PARTS:
            out.append({"type": "text", "text": _text_of(part, pparam)})
        elif ptype == "input_image":
            if not allow_images:
                raise bad_request(
                    "Images are only supported in user messages.", param=pparam, code="unsupported_content"
                )
            out.append(_image_part(part, pparam))
            has_images = True
        elif isinstance(ptype, str) and ptype in _UNSUPPORTED_PARTS:
            raise bad_request(
                f"Content part type '{ptype}' is not supported: send text or images by URL.",
                param=pparam,
                code="unsupported_content",
            )
        else:
            shown = show(ptype)
            raise bad_request(f"Unknown content part type '{shown}'.", param=f"{pparam}.type")
    return out, has_images


def _joined_text(parts: list[dict]) -> str:
    return "\n".join(p["text"] for p in parts if p["type"] == "text")


def _tool_output(output: Any, param: str) -> str:
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        raise bad_request("Invalid type for 'output': expected a string or an array.", param=param)
    texts: list[str] = []
    for pparam, part, ptype in _typed_parts(output, param, "output"):
        if isinstance(ptype, str) and ptype in _TEXT_PARTS:
            texts.append(_text_of(part, pparam))
        elif ptype == "input_image":
            texts.append("[image]")
        elif ptype == "input_file":
            texts.append("[file]")
        else:
            shown = show(ptype)
            raise bad_request(f"Unknown output part type '{shown}'.", param=f"{pparam}.type")
    return "\n".join(texts)


def _req_str(item: dict, key: str, param: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise bad_request(f"Missing required parameter: '{key}' must be a non-empty string.", param=f"{param}.{key}")
    return v


def _call_name(item: dict, param: str) -> str:
    name = _req_str(item, "name", param)
    ns = item.get("namespace")
    if ns is None or ns == "":
        return name
    if not isinstance(ns, str):
        raise bad_request("Invalid type for 'namespace': expected a string.", param=f"{param}.namespace")
    return f"{ns}__{name}"


def _reasoning_text(item: dict, param: str, options: TranslateOptions, notices: list[str]) -> str | None:
    """The text a reasoning item contributes, or None."""
    content_texts: list[str] = []
    summary_texts: list[str] = []
    for key, sink in (("content", content_texts), ("summary", summary_texts)):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise bad_request(f"Invalid type for reasoning '{key}': expected an array.", param=f"{param}.{key}")
        for j, part in enumerate(parts):
            if not isinstance(part, dict):
                raise bad_request("Invalid reasoning part: expected an object.", param=f"{param}.{key}[{j}]")
            t = part.get("text")
            if not isinstance(t, str):
                raise bad_request("Invalid reasoning part: 'text' must be a string.", param=f"{param}.{key}[{j}].text")
            if t:
                sink.append(t)
    # the full reasoning text wins over its summary
    plain = "\n\n".join(content_texts or summary_texts) or None
    sealed = item.get("encrypted_content")
    if sealed is not None and not isinstance(sealed, str):
        raise bad_request("Invalid type for 'encrypted_content': expected a string.",
                          param=f"{param}.encrypted_content")
    if sealed and options.unseal is not None:
        failed = UNSEAL_FAILED
        try:
            opened = options.unseal(sealed)
        except Exception as exc:  # an unseal hook must never turn a request into a 500
            opened = None
            failed = getattr(exc, "notice", None) or failed  # e.g. proxy.protocol.seal.SealExpired
        if isinstance(opened, str):
            return opened or plain
        if plain is None:
            add_notice(notices, failed)
        return plain
    if sealed:
        add_notice(notices, NO_SEAL_KEY)
    return plain


class _Turn:
    """One assistant turn being assembled from consecutive assistant-side items."""

    __slots__ = ("texts", "reasoning", "calls")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []

    def flush_into(self, messages: list[dict]) -> None:
        if not (self.texts or self.reasoning or self.calls):
            return
        msg: dict[str, Any] = {"role": "assistant"}
        if self.texts:
            msg["content"] = "\n\n".join(self.texts)
        else:
            msg["content"] = None if self.calls else ""
        if self.reasoning:
            msg["reasoning_content"] = "\n\n".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = self.calls
        messages.append(msg)
        self.texts = []
        self.reasoning = []
        self.calls = []


def _message_item(item: dict, param: str, systems: list[str], messages: list[dict], turn: _Turn) -> None:
    """A message input item: system/developer text joins `systems`, a user message starts a
    turn, assistant text joins the current turn."""
    role = item.get("role")
    cparam = f"{param}.content"
    content = item.get("content")
    if role in ("system", "developer"):
        parts, _ = _message_content(content, cparam, allow_images=False)
        text = _joined_text(parts)
        if text:
            systems.append(text)
    elif role == "user":
        turn.flush_into(messages)
        parts, has_images = _message_content(content, cparam, allow_images=True)
        if has_images:
            messages.append({"role": "user", "content": parts})
        else:
            messages.append({"role": "user", "content": _joined_text(parts)})
    elif role == "assistant":
        parts, _ = _message_content(content, cparam, allow_images=False)
        text = _joined_text(parts)
        if text:
            turn.texts.append(text)
    else:
        shown = show(role)
        raise bad_request(
            f"Invalid message role '{shown}': expected user, assistant, system or developer.",
            param=f"{param}.role",
        )


def _call_item(item: dict, param: str, itype: str) -> dict:
    """A function_call or custom_tool_call input item -> the chat tool call."""
    call_id = _req_str(item, "call_id", param)
    name = _call_name(item, param)
    if itype == "function_call":
        args = item.get("arguments")
        if not isinstance(args, str):
            raise bad_request("Invalid type for 'arguments': expected a string.", param=f"{param}.arguments")
    else:
        raw = item.get("input")
        if not isinstance(raw, str):
            raise bad_request("Invalid type for 'input': expected a string.", param=f"{param}.input")
        try:
            args = orjson.dumps({"input": raw}).decode()
        except orjson.JSONEncodeError:
            raise bad_request("Invalid 'input': not valid UTF-8 text.", param=f"{param}.input") from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _orphan_output(itype: str, call_id: str) -> Exception:
    """OpenAI's refusal of a tool output that answers no call in the input (its words, its param)."""
    return bad_request(f"No tool call found for {_OUTPUT_NAMES[itype]} with call_id {call_id[:128]}.", param="input")


def _translate_input(
    inp: Any, options: TranslateOptions, notices: list[str]
) -> tuple[list[str], list[dict], str | None]:
    """-> (system texts in order, non-system chat messages, effort from configuration_update)"""
    if isinstance(inp, str):
        return [], [{"role": "user", "content": inp}], None
    if not isinstance(inp, list):
        raise bad_request("Invalid type for 'input': expected a string or an array.", param="input")
    systems: list[str] = []
    messages: list[dict] = []
    turn = _Turn()
    config_effort: str | None = None
    # The call ids of the calls so far (a function or custom call, or a hosted call whose result
    # comes back as a function_call_output, as Codex does for local_shell_call); a summary item
    # before an output may stand for its call (`summarized`).
    calls: set[str] = set()
    summarized = False
    for i, item in enumerate(inp):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request("Invalid input item: expected an object.", param=param)
        itype = item.get("type")
        if itype is None and "role" in item:
            itype = "message"
        if itype == "message":
            _message_item(item, param, systems, messages, turn)
        elif itype == "reasoning":
            text = _reasoning_text(item, param, options, notices)
            if text:
                turn.reasoning.append(text)
        elif itype in ("function_call", "custom_tool_call"):
            call = _call_item(item, param, itype)
            calls.add(call["id"])
            turn.calls.append(call)
        elif itype in ("function_call_output", "custom_tool_call_output"):
            turn.flush_into(messages)
            call_id = _req_str(item, "call_id", param)
            if "output" not in item:
                raise bad_request("Missing required parameter: 'output'.", param=f"{param}.output")
            out = _tool_output(item["output"], f"{param}.output")
            if call_id not in calls and not summarized:
                raise _orphan_output(itype, call_id)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": out})
        elif itype == "compaction" and is_sealed_here(item):  # made by /v1/responses/compact
            turn.flush_into(messages)
            messages.append(compaction_message(item, param, options.unseal))
            summarized = True
        elif isinstance(itype, str) and itype in HOSTED_ITEM_TYPES:
            summarized = summarized or itype in _SUMMARY_ITEM_TYPES
            hosted_call = item.get("call_id")
            if isinstance(hosted_call, str) and not itype.endswith("_output"):
                calls.add(hosted_call)
            turn.texts.append(
                f"[{itype} replayed from a previous conversation: hosted tool results are not replayed]"
            )
        elif itype == "configuration_update":
            reasoning = item.get("reasoning")
            if isinstance(reasoning, dict):
                effort = reasoning.get("effort")
                if effort is not None:
                    if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
                        raise bad_request(
                            "Invalid reasoning effort in configuration_update.", param=f"{param}.reasoning.effort"
                        )
                    config_effort = effort
        elif itype == "item_reference":
            raise item_reference_refusal(param)
        else:
            shown = show(itype)
            raise bad_request(f"Unknown input item type '{shown}'.", param=f"{param}.type")
    turn.flush_into(messages)
    return systems, messages, config_effort


# --------------------------------------------------------------------------- top level


def messages_of(inp: Any, instructions: str | None, options: TranslateOptions,
                 notices: list[str]) -> tuple[list[dict], str | None]:
    """-> (the chat messages, the effort a configuration_update item set)."""
    systems, messages, config_effort = _translate_input(inp, options, notices)
    if instructions:
        systems.insert(0, instructions)
    if systems:
        messages.insert(0, {"role": "system", "content": "\n\n".join(systems)})
    if not messages:
        # An empty input (or one of items that translate to nothing) would reach the model
        # server as an empty chat, which it refuses after the balance was held.
        raise bad_request("Invalid 'input': it contains no message to answer.", param="input", code="empty_input")
    return messages, config_effort
