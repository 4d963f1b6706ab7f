"""The request's `tools` and `tool_choice` -> chat-completions tools (pure). Namespace tools are
flattened to upstream function names "{namespace}__{name}"; custom tools become a function with one
required string parameter `input`; hosted tools are left out (proxy.policy.rules)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.errors import bad_request
from proxy.policy.rules import hosted_tools_notice, leave_out
from proxy.protocol.translate_options import show


@dataclass(frozen=True)
class ToolOrigin:
    kind: str  # "function" | "custom"
    name: str  # the name the client knows
    namespace: str | None = None  # set when the tool came from a {"type":"namespace"} tool


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


def _leaf_tool(acc: _Tools, tool: dict, param: str, namespace: str | None) -> dict:
    """Register one function or custom tool (top level or inside a namespace); -> its echo."""
    kind = tool["type"]  # one of _LEAF_TOOLS: the caller checked
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
                        f"Invalid tool type '{show(stype)}' inside namespace '{ns}': only function and custom tools.",
                        param=f"{sparam}.type",
                    )
                echo_inner.append(_leaf_tool(acc, sub, sparam, ns))
            echo_ns = dict(tool)
            echo_ns["tools"] = echo_inner
            acc.echo_tools.append(echo_ns)
        elif not leave_out(ttype, f"{param}.type", acc.left_out):
            shown = show(ttype)
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
    shown = show(ctype)
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
            raise bad_request(f"Unknown allowed tool type '{show(etype)}'.", param=f"{param}.type")
    return frozenset(allowed)



def tools_of(body: dict, notices: list[str]) -> tuple[_Tools, Any, Any, frozenset[str] | None, list[dict]]:
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
