"""Responses request body -> chat-completions request body (pure: dicts in, dicts out).

`translate_request(body)` validates a Responses API request and builds the body that vLLM and
SGLang accept on /v1/chat/completions, plus everything the response side needs (the tool name
map, the fields echoed in the Response object, notices). Every refusal is an `APIError(400)`;
no JSON value can make it raise anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

from proxy.http.errors import bad_request
from proxy.protocol.compaction import compaction_message, is_sealed_here
from proxy.upstream.models import DEFAULT_SAMPLING, resolve_model
from proxy.policy.rules import (
    HOSTED_TOOL_TYPES,
    REFUSED_TOOL_TYPES,
    check_stateless,
    hosted_tools_notice,
    item_reference_refusal,
    leave_out,
    tool_type_refusal,
)

__all__ = [
    "ToolOrigin",
    "Translation",
    "TranslateOptions",
    "translate_request",
    "set_output_cap",
    "HOSTED_TOOL_TYPES",
    "REFUSED_TOOL_TYPES",
    "HOSTED_ITEM_TYPES",
    "REASONING_EFFORTS",
]

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

REASONING_EFFORTS: frozenset[str] = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_UNSUPPORTED_PARTS = frozenset({"input_file", "input_audio", "file"})
_IMAGE_DETAILS = frozenset({"auto", "low", "high"})
_UNSEAL_FAILED = ("reasoning item dropped: encrypted_content could not be opened (sealed elsewhere, "
                  "for another API key, with a retired key, or altered)")
_NO_SEAL_KEY = "encrypted_content ignored: no reasoning seal key is configured on this proxy"
_NO_SEAL_INCLUDE = "reasoning.encrypted_content not returned: no reasoning seal key is configured on this proxy"


@dataclass
class ToolOrigin:
    kind: str  # "function" | "custom"
    name: str  # the name the client knows
    namespace: str | None = None  # set when the tool came from a {"type":"namespace"} tool


@dataclass
class Translation:
    chat: dict  # the chat-completions request body; chat["model"] is upstream_model
    model: str  # the model exactly as the client sent it
    upstream_model: str  # the served name `model` means (proxy.upstream.models.resolve_model)
    stream: bool
    tools: dict[str, ToolOrigin]  # upstream function name -> what the client knows it as
    echo: dict  # Response fields echoed back
    notices: list[str]
    include_encrypted_reasoning: bool
    prompt_cache_key: str | None
    conversation: str | None
    max_output_tokens: int | None
    allowed_tools: frozenset[str] | None = None  # tool_choice allowed_tools: upstream names, else None


@dataclass
class TranslateOptions:
    unseal: Callable[[str], str | None] | None = None  # encrypted_content -> text, None = cannot open
    served: Callable[[str], bool] | None = None  # is this model name served? None: every name is
    sampling_defaults: dict[str, dict[str, float]] | None = None  # served model -> its server's defaults


# --------------------------------------------------------------------------- small validators


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is None or isinstance(v, str):
        return v
    raise bad_request(f"Invalid type for '{key}': expected a string.", param=key)


def _opt_bool(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is None or isinstance(v, bool):
        return v
    raise bad_request(f"Invalid type for '{key}': expected a boolean.", param=key)


def _opt_number(body: dict, key: str, lo: float, hi: float) -> float | int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_num(v) or not (lo <= v <= hi):
        raise bad_request(f"Invalid '{key}': expected a number between {lo:g} and {hi:g}.", param=key)
    return v


def _show(v: Any) -> str:
    """A short printable form of any JSON value, for error messages."""
    if isinstance(v, str):
        return v[:64]
    if v is None or isinstance(v, (bool, float)) or (isinstance(v, int) and v.bit_length() < 200):
        return repr(v)[:64]
    return type(v).__name__


def _add_notice(notices: list[str], text: str) -> None:
    if text not in notices:
        notices.append(text)


# --------------------------------------------------------------------------- tools


@dataclass
class _Tools:
    chat_tools: list[dict] = field(default_factory=list)
    echo_tools: list[dict] = field(default_factory=list)
    origins: dict[str, ToolOrigin] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)


def _tool_name(tool: dict, param: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("Missing required parameter: tool 'name' must be a non-empty string.", param=f"{param}.name")
    return name


def _opt_desc(tool: dict, param: str) -> str | None:
    d = tool.get("description")
    if d is None or isinstance(d, str):
        return d
    raise bad_request("Invalid type for tool 'description': expected a string.", param=f"{param}.description")


def _function_tool(tool: dict, param: str, namespace: str | None) -> tuple[str, dict, dict]:
    """-> (upstream name, chat tool, echo tool)"""
    name = _tool_name(tool, param)
    desc = _opt_desc(tool, param)
    params = tool.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    elif not isinstance(params, dict):
        raise bad_request("Invalid type for tool 'parameters': expected an object.", param=f"{param}.parameters")
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("Invalid type for tool 'strict': expected a boolean.", param=f"{param}.strict")
    upstream = f"{namespace}__{name}" if namespace else name
    fn: dict[str, Any] = {"name": upstream}
    if desc is not None:
        fn["description"] = desc
    fn["parameters"] = params
    if strict is not None:
        fn["strict"] = strict
    echo = dict(tool)
    # description, parameters and strict are required (nullable) in the spec's FunctionTool
    echo.setdefault("description", None)
    echo.setdefault("parameters", None)
    echo.setdefault("strict", None)
    return upstream, {"type": "function", "function": fn}, echo


def _custom_tool(tool: dict, param: str, namespace: str | None) -> tuple[str, dict, dict]:
    name = _tool_name(tool, param)
    desc = _opt_desc(tool, param)
    fmt = tool.get("format")
    hint = ""
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise bad_request("Invalid type for custom tool 'format': expected an object.", param=f"{param}.format")
        ftype = fmt.get("type")
        if ftype == "grammar":
            syntax = fmt.get("syntax")
            definition = fmt.get("definition")
            if not isinstance(definition, str):
                raise bad_request(
                    "Invalid custom tool grammar: 'definition' must be a string.", param=f"{param}.format.definition"
                )
            syntax_name = syntax if isinstance(syntax, str) and syntax else "lark"
            hint = f"The input must match this {syntax_name} grammar:\n{definition}"
        elif ftype not in (None, "text"):
            raise bad_request(f"Invalid custom tool format type '{ftype}'.", param=f"{param}.format.type")
    input_desc = "The raw input for the tool (a string, not JSON)."
    if desc:
        input_desc = f"{desc}\n\n{input_desc}"
    if hint:
        input_desc = f"{input_desc}\n\n{hint}"
    upstream = f"{namespace}__{name}" if namespace else name
    fn: dict[str, Any] = {"name": upstream}
    if desc is not None:
        fn["description"] = desc
    fn["parameters"] = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": input_desc}},
        "required": ["input"],
    }
    return upstream, {"type": "function", "function": fn}, dict(tool)


def _register(acc: _Tools, upstream: str, origin: ToolOrigin, chat_tool: dict, param: str) -> None:
    if upstream in acc.origins:
        raise bad_request(
            f"Duplicate tool name '{upstream}': two tools resolve to the same function name.",
            param=param,
            code="duplicate_tool_name",
        )
    acc.origins[upstream] = origin
    acc.chat_tools.append(chat_tool)


_LEAF_TOOLS = ("function", "custom")


def _leaf_tool(acc: "_Tools", tool: dict, param: str, namespace: str | None) -> dict:
    """Register one function or custom tool (top level or inside a namespace); -> its echo."""
    kind = tool.get("type")
    build = _function_tool if kind == "function" else _custom_tool
    up, chat_tool, echo = build(tool, param, namespace)
    _register(acc, up, ToolOrigin(kind, tool["name"], namespace), chat_tool, param)
    return echo


def _translate_tools(tools: Any) -> _Tools:
    acc = _Tools()
    if tools is None:
        return acc
    if not isinstance(tools, list):
        raise bad_request("Invalid type for 'tools': expected an array.", param="tools")
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request("Invalid tool: expected an object.", param=param)
        ttype = tool.get("type")
        if ttype in _LEAF_TOOLS:
            acc.echo_tools.append(_leaf_tool(acc, tool, param, None))
        elif ttype == "namespace":
            ns = _tool_name(tool, param)
            _opt_desc(tool, param)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad_request("Invalid namespace tool: 'tools' must be an array.", param=f"{param}.tools")
            echo_inner = []
            for j, sub in enumerate(inner):
                sparam = f"{param}.tools[{j}]"
                if not isinstance(sub, dict):
                    raise bad_request("Invalid tool: expected an object.", param=sparam)
                stype = sub.get("type")
                if stype not in _LEAF_TOOLS:
                    raise bad_request(
                        f"Invalid tool type '{_show(stype)}' inside namespace '{ns}': only function and custom tools.",
                        param=f"{sparam}.type",
                    )
                echo_inner.append(_leaf_tool(acc, sub, sparam, ns))
            echo_ns = dict(tool)
            echo_ns["tools"] = echo_inner
            acc.echo_tools.append(echo_ns)
        elif not leave_out(ttype, f"{param}.type", acc.left_out):
            shown = _show(ttype)
            raise bad_request(f"Unknown tool type '{shown}'.", param=f"{param}.type")
    return acc


def _translate_tool_choice(choice: Any, acc: _Tools, notices: list[str]) -> Any:
    """-> the chat tool_choice, or None when nothing should be sent."""
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice in ("auto", "none", "required"):
            return choice
        raise bad_request(f"Invalid 'tool_choice' value '{choice[:64]}'.", param="tool_choice")
    if not isinstance(choice, dict):
        raise bad_request("Invalid type for 'tool_choice': expected a string or an object.", param="tool_choice")
    ctype = choice.get("type")
    if ctype in ("function", "custom"):
        name = choice.get("name")
        if name is None and ctype == "function" and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")  # chat-completions shape, tolerated
        if not isinstance(name, str) or not name:
            raise bad_request("Missing required parameter: 'tool_choice.name'.", param="tool_choice.name")
        ns = choice.get("namespace")
        if ns is not None and not isinstance(ns, str):
            raise bad_request("Invalid type for 'tool_choice.namespace'.", param="tool_choice.namespace")
        upstream = f"{ns}__{name}" if ns else name
        origin = acc.origins.get(upstream)
        if origin is None or origin.kind != ctype:
            raise bad_request(
                f"Tool choice '{upstream}' names a {ctype} tool that is not in 'tools'.", param="tool_choice"
            )
        return {"type": "function", "function": {"name": upstream}}
    if ctype == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad_request("Invalid 'tool_choice.mode': expected 'auto' or 'required'.", param="tool_choice.mode")
        return mode
    if leave_out(ctype, "tool_choice", acc.left_out):
        return "auto"
    shown = _show(ctype)
    raise bad_request(f"Unknown tool_choice type '{shown}'.", param="tool_choice.type")


def _allowed_tools(choice: dict, acc: _Tools) -> frozenset[str]:
    """The upstream names tool_choice {"type": "allowed_tools"} lets the model call. Hosted
    tools in the list are skipped (they are left out of the request anyway)."""
    listed = choice.get("tools")
    if not isinstance(listed, list):
        raise bad_request("Missing required parameter: 'tool_choice.tools' must be an array.",
                          param="tool_choice.tools")
    allowed: set[str] = set()
    for i, entry in enumerate(listed):
        param = f"tool_choice.tools[{i}]"
        if not isinstance(entry, dict):
            raise bad_request("Invalid type for an allowed tool: expected an object.", param=param)
        etype = entry.get("type")
        if etype in ("function", "custom"):
            name = entry.get("name")
            ns = entry.get("namespace")
            if not isinstance(name, str) or not name or (ns is not None and not isinstance(ns, str)):
                raise bad_request("Missing required parameter: an allowed tool needs a 'name'.", param=f"{param}.name")
            upstream = f"{ns}__{name}" if ns else name
            origin = acc.origins.get(upstream)
            if origin is None or origin.kind != etype:
                raise bad_request(f"Allowed tool '{upstream}' names a {etype} tool that is not in 'tools'.",
                                  param=param)
            allowed.add(upstream)
        elif not leave_out(etype, param, []):
            raise bad_request(f"Unknown allowed tool type '{_show(etype)}'.", param=f"{param}.type")
    return frozenset(allowed)


# --------------------------------------------------------------------------- input items


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
        url.startswith("https://") or url.startswith("http://") or url.startswith("data:")
    ):
        raise bad_request("Invalid 'image_url': expected an http(s) URL or a data URI.", param=f"{param}.image_url")
    img: dict[str, Any] = {"url": url}
    detail = part.get("detail")
    if isinstance(detail, str) and detail in _IMAGE_DETAILS:
        img["detail"] = detail
    return {"type": "image_url", "image_url": img}


def _message_content(content: Any, param: str, allow_images: bool) -> tuple[list[dict], bool]:
    """-> (chat parts, has_images). Parts are {"type":"text"} or {"type":"image_url"}."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}], False
    if not isinstance(content, list):
        raise bad_request("Invalid type for message 'content': expected a string or an array.", param=param)
    out: list[dict] = []
    has_images = False
    for j, part in enumerate(content):
        pparam = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad_request("Invalid content part: expected an object.", param=pparam)
        ptype = part.get("type")
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
            shown = _show(ptype)
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
    for j, part in enumerate(output):
        pparam = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad_request("Invalid output part: expected an object.", param=pparam)
        ptype = part.get("type")
        if isinstance(ptype, str) and ptype in _TEXT_PARTS:
            texts.append(_text_of(part, pparam))
        elif ptype == "input_image":
            texts.append("[image]")
        elif ptype == "input_file":
            texts.append("[file]")
        else:
            shown = _show(ptype)
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
        raise bad_request("Invalid type for 'encrypted_content': expected a string.", param=f"{param}.encrypted_content")
    if sealed and options.unseal is not None:
        failed = _UNSEAL_FAILED
        try:
            opened = options.unseal(sealed)
        except Exception as exc:  # an unseal hook must never turn a request into a 500
            opened = None
            failed = getattr(exc, "notice", None) or failed  # e.g. proxy.protocol.seal.SealExpired
        if isinstance(opened, str):
            return opened or plain
        if plain is None:
            _add_notice(notices, failed)
        return plain
    if sealed:
        _add_notice(notices, _NO_SEAL_KEY)
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


def _message_item(item: dict, param: str, systems: list[str], messages: list[dict], turn: "_Turn") -> None:
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
        shown = _show(role)
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
            turn.calls.append(_call_item(item, param, itype))
        elif itype in ("function_call_output", "custom_tool_call_output"):
            turn.flush_into(messages)
            call_id = _req_str(item, "call_id", param)
            if "output" not in item:
                raise bad_request("Missing required parameter: 'output'.", param=f"{param}.output")
            out = _tool_output(item["output"], f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": out})
        elif itype == "compaction" and is_sealed_here(item):  # made by /v1/responses/compact
            turn.flush_into(messages)
            messages.append(compaction_message(item, param, options.unseal))
        elif isinstance(itype, str) and itype in HOSTED_ITEM_TYPES:
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
            shown = _show(itype)
            raise bad_request(f"Unknown input item type '{shown}'.", param=f"{param}.type")
    turn.flush_into(messages)
    return systems, messages, config_effort


# --------------------------------------------------------------------------- top level


def _text_format(text: Any) -> tuple[dict | None, dict]:
    """-> (chat response_format or None, echoed text object)"""
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad_request("Invalid type for 'text': expected an object.", param="text")
    echo = dict(text)
    fmt = text.get("format")
    if fmt is None:
        echo["format"] = {"type": "text"}
        return None, echo
    if not isinstance(fmt, dict):
        raise bad_request("Invalid type for 'text.format': expected an object.", param="text.format")
    ftype = fmt.get("type")
    if ftype == "text":
        return None, echo
    if ftype == "json_object":
        return {"type": "json_object"}, echo
    if ftype == "json_schema":
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("Missing required parameter: 'text.format.name'.", param="text.format.name")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("Missing required parameter: 'text.format.schema'.", param="text.format.schema")
        js: dict[str, Any] = {"name": name, "schema": schema}
        strict = fmt.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise bad_request("Invalid type for 'text.format.strict'.", param="text.format.strict")
            js["strict"] = strict
        desc = fmt.get("description")
        if desc is not None:
            if not isinstance(desc, str):
                raise bad_request("Invalid type for 'text.format.description'.", param="text.format.description")
            js["description"] = desc
        return {"type": "json_schema", "json_schema": js}, echo
    shown = _show(ftype)
    raise bad_request(f"Unknown text format type '{shown}'.", param="text.format.type")


@dataclass(slots=True)
class _Scalars:
    """The request's plain fields, checked."""

    instructions: str | None
    stream: bool
    temperature: float | None
    top_p: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    max_out: int | None
    top_logprobs: int | None
    parallel: bool | None
    user: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None
    metadata: dict | None
    max_tool_calls: int | None
    include_encrypted: bool
    conversation: str | None


def _scalars(body: dict, options: TranslateOptions, notices: list[str]) -> _Scalars:
    instructions = _opt_str(body, "instructions")
    stream = bool(_opt_bool(body, "stream"))
    temperature = _opt_number(body, "temperature", 0, 2)
    top_p = _opt_number(body, "top_p", 0, 1)
    presence_penalty = _opt_number(body, "presence_penalty", -2, 2)
    frequency_penalty = _opt_number(body, "frequency_penalty", -2, 2)
    max_out = body.get("max_output_tokens")
    if max_out is not None and (not _is_int(max_out) or max_out < 1):
        raise bad_request("Invalid 'max_output_tokens': expected a positive integer.", param="max_output_tokens")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None and (not _is_int(top_logprobs) or not 0 <= top_logprobs <= 20):
        raise bad_request("Invalid 'top_logprobs': expected an integer between 0 and 20.", param="top_logprobs")
    parallel = _opt_bool(body, "parallel_tool_calls")
    user = _opt_str(body, "user")
    safety_identifier = _opt_str(body, "safety_identifier")
    prompt_cache_key = _opt_str(body, "prompt_cache_key")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("Invalid type for 'metadata': expected an object.", param="metadata")
    max_tool_calls = body.get("max_tool_calls")
    if max_tool_calls is not None and (not _is_int(max_tool_calls) or max_tool_calls < 0):
        raise bad_request("Invalid 'max_tool_calls': expected a non-negative integer.", param="max_tool_calls")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(x, str) for x in include)):
        raise bad_request("Invalid type for 'include': expected an array of strings.", param="include")
    include_encrypted = bool(include) and "reasoning.encrypted_content" in include
    if include_encrypted and options.unseal is None:  # no seal key: nothing to seal with
        notices.append(_NO_SEAL_INCLUDE)
    return _Scalars(instructions, stream, temperature, top_p, presence_penalty, frequency_penalty, max_out,
                    top_logprobs, parallel, user, safety_identifier, prompt_cache_key, metadata, max_tool_calls,
                    include_encrypted, _conversation_id(body.get("conversation")))


def _conversation_id(conv: Any) -> str | None:
    if conv is None or isinstance(conv, str):
        return conv
    if isinstance(conv, dict) and isinstance(conv.get("id"), str):
        return conv["id"]
    raise bad_request("Invalid 'conversation': expected a string or an object with an 'id'.", param="conversation")


def _reasoning_of(reasoning: Any) -> tuple[str | None, Any]:
    """-> (effort, summary) of the `reasoning` field."""
    if reasoning is None:
        return None, None
    if not isinstance(reasoning, dict):
        raise bad_request("Invalid type for 'reasoning': expected an object.", param="reasoning")
    effort = reasoning.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in REASONING_EFFORTS):
        raise bad_request(
            "Invalid 'reasoning.effort': expected one of none, minimal, low, medium, high, xhigh.",
            param="reasoning.effort",
        )
    summary = reasoning.get("summary")
    return effort, summary if isinstance(summary, str) else None


def _tools_of(body: dict, notices: list[str]) -> tuple[_Tools, Any, Any, frozenset[str] | None, list[dict]]:
    """-> (the tools, the tool_choice to echo, the chat tool_choice, the allowed upstream names
    or None, the chat tools to send)."""
    acc = _translate_tools(body.get("tools"))
    raw_choice = body.get("tool_choice")
    chat_choice = _translate_tool_choice(raw_choice, acc, notices)
    allowed_tools = None
    chat_tools = acc.chat_tools
    if isinstance(raw_choice, dict) and raw_choice.get("type") == "allowed_tools":
        # Only the allowed tools go upstream: chat completions has no allowed set, and the
        # model cannot call what it is not shown. The rewriter drops any other call that
        # still comes back (a hard limit in the Open Responses spec).
        allowed_tools = _allowed_tools(raw_choice, acc)
        raw_choice = {**raw_choice, "mode": chat_choice}  # echoed with its mode (required by the spec)
        chat_tools = [t for t in chat_tools if t["function"]["name"] in allowed_tools]
        if not chat_tools and chat_choice == "required":
            raise bad_request("tool_choice requires a call but allows no function or custom tool.",
                              param="tool_choice.tools")
    if acc.left_out:
        notices.append(hosted_tools_notice(acc.left_out))
    return acc, raw_choice, chat_choice, allowed_tools, chat_tools


def _messages_of(inp: Any, instructions: str | None, options: TranslateOptions,
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


def _chat_body(sc: _Scalars, upstream_model: str, messages: list[dict], effort: str | None,
               response_format: dict | None, chat_tools: list[dict], chat_choice: Any) -> dict[str, Any]:
    chat: dict[str, Any] = {"model": upstream_model, "messages": messages}
    if sc.max_out is not None:
        chat["max_tokens"] = sc.max_out
    if sc.temperature is not None:
        chat["temperature"] = sc.temperature
    if sc.top_p is not None:
        chat["top_p"] = sc.top_p
    if sc.presence_penalty is not None:
        chat["presence_penalty"] = sc.presence_penalty
    if sc.frequency_penalty is not None:
        chat["frequency_penalty"] = sc.frequency_penalty
    if effort is not None:
        chat["reasoning_effort"] = effort
        chat["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    if response_format is not None:
        chat["response_format"] = response_format
    chat_user = sc.user if sc.user is not None else sc.safety_identifier
    if chat_user is not None:
        chat["user"] = chat_user
    chat["stream"] = sc.stream
    if sc.stream:
        chat["stream_options"] = {"include_usage": True}
    if sc.top_logprobs:  # 0 asks for no alternatives: logprobs stay off upstream
        chat["logprobs"] = True
        chat["top_logprobs"] = sc.top_logprobs
    if chat_tools:
        chat["tools"] = chat_tools
        if chat_choice is not None:
            chat["tool_choice"] = chat_choice
        if sc.parallel is not None:
            chat["parallel_tool_calls"] = sc.parallel
    return chat


def _echo(sc: _Scalars, store: Any, sampling: dict, echo_tools: list, raw_choice: Any, text_echo: dict,
          effort: str | None, summary: Any) -> dict[str, Any]:
    """The request fields echoed in the Response object."""
    return {
        "instructions": sc.instructions,
        "tools": echo_tools,
        "tool_choice": raw_choice if raw_choice is not None else "auto",
        # The effective sampling values (the Open Responses spec requires numbers): the
        # client's, else the ones the model server applies when the request leaves them out.
        "temperature": sc.temperature if sc.temperature is not None else sampling["temperature"],
        "top_p": sc.top_p if sc.top_p is not None else sampling["top_p"],
        "presence_penalty": (sc.presence_penalty if sc.presence_penalty is not None
                             else sampling["presence_penalty"]),
        "frequency_penalty": (sc.frequency_penalty if sc.frequency_penalty is not None
                              else sampling["frequency_penalty"]),
        "max_output_tokens": sc.max_out,
        "parallel_tool_calls": sc.parallel if sc.parallel is not None else True,
        "metadata": sc.metadata if sc.metadata is not None else {},
        "store": store if isinstance(store, bool) else False,
        "text": text_echo,
        "reasoning": {"effort": effort, "summary": summary},
        "user": sc.user,
        "safety_identifier": sc.safety_identifier,
        "prompt_cache_key": sc.prompt_cache_key,
        "top_logprobs": sc.top_logprobs if sc.top_logprobs is not None else sampling["top_logprobs"],
        "service_tier": "default",
        "truncation": "disabled",
        "background": False,
        "max_tool_calls": sc.max_tool_calls,
    }


def translate_request(body: Any, options: TranslateOptions | None = None) -> Translation:
    """Validate a Responses request body and build the chat-completions body. Raises APIError(400)."""
    if options is None:
        options = TranslateOptions()
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")

    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise bad_request("Missing required parameter: 'model' must be a non-empty string.", param="model")
    # A name nobody serves goes on as sent: routing answers 404 naming the client's string.
    upstream_model = resolve_model(model, options.served) if options.served is not None else model
    if upstream_model is None:
        upstream_model = model

    if "input" not in body or body["input"] is None:
        raise bad_request("Missing required parameter: 'input'.", param="input")

    check_stateless(body, items=False)  # _translate_input refuses an item_reference where it stands
    notices: list[str] = []
    sc = _scalars(body, options, notices)
    effort, summary = _reasoning_of(body.get("reasoning"))
    response_format, text_echo = _text_format(body.get("text"))
    acc, raw_choice, chat_choice, allowed_tools, chat_tools = _tools_of(body, notices)
    messages, config_effort = _messages_of(body["input"], sc.instructions, options, notices)
    if effort is None and config_effort is not None:
        effort = config_effort

    chat = _chat_body(sc, upstream_model, messages, effort, response_format, chat_tools, chat_choice)
    sampling = DEFAULT_SAMPLING
    if options.sampling_defaults and upstream_model in options.sampling_defaults:
        sampling = {**DEFAULT_SAMPLING, **options.sampling_defaults[upstream_model]}
    echo = _echo(sc, body.get("store"), sampling, acc.echo_tools, raw_choice, text_echo, effort, summary)
    return Translation(
        chat=chat,
        model=model,
        upstream_model=upstream_model,
        stream=sc.stream,
        tools=acc.origins,
        echo=echo,
        notices=notices,
        include_encrypted_reasoning=sc.include_encrypted,
        prompt_cache_key=sc.prompt_cache_key,
        conversation=sc.conversation,
        max_output_tokens=sc.max_out,
        allowed_tools=allowed_tools,
    )


def set_output_cap(t: Translation, cap: int) -> None:
    """Set the output cap (e.g. lowered to what the balance covers): chat max_tokens and the echo."""
    if not _is_int(cap) or cap < 1:
        raise ValueError(f"output cap must be a positive integer, got {cap!r}")
    t.chat["max_tokens"] = cap
    t.echo["max_output_tokens"] = cap
    t.max_output_tokens = cap
