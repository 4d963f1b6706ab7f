"""Hosted tools: left out (and named in x-token-notice) or refused, before translation.

    tools:
      drop: null      # tool types left out; null: proxy.policy.rules.HOSTED_TOOL_TYPES
      refuse: null    # tool types refused with 400; null: REFUSED_TOOL_TYPES (image_generation)

The OpenAI platform runs web_search, file_search, mcp... itself; a chat-completions
model server cannot, so those tools are removed from `tools` and the request goes on
without them ("tools left out: web_search, mcp"). A `tool_choice` naming a removed tool
becomes "auto". A refused type is a 400 (`image_generation_unsupported` for
image_generation, else `unsupported_tool`); any other type that is not function, custom
or namespace is a 400 naming it. Duplicate names after namespace flattening are refused
by the translation itself (400 `duplicate_tool_name`).

It is a body check of the prepare phase (middlewares/__init__.py): it runs on the parsed
body before the one translation, so nothing translated ever sees a tool it removed. It
returns an edited copy; the body it was given is left as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.errors import bad_request
from proxy.policy.rules import (
    CORE_TOOL_TYPES as _CORE,
    HOSTED_TOOL_TYPES,
    REFUSED_TOOL_TYPES,
    hosted_tools_notice,
    leave_out,
)
from proxy.runtime.reload import RELOADERS
from proxy.state import RequestContext

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.load import Config
    from proxy.config.sections import Tools


def _show(value: Any) -> str:
    return value[:64] if isinstance(value, str) else type(value).__name__


def _names(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict):
        return entry.get("type") if isinstance(entry.get("type"), str) else None
    return None


def create(section: Tools, app: web.Application):
    """config.yaml `tools` (config.tools; checked at load, proxy.config.cross_checks): null is the built-in list."""
    drop = HOSTED_TOOL_TYPES if section.drop is None else frozenset(section.drop)
    refuse = REFUSED_TOOL_TYPES if section.refuse is None else frozenset(section.refuse)
    reloaders = app.get(RELOADERS)
    if reloaders is not None:
        def reload(new: Config) -> Callable[[], None]:
            lists = new.tools

            def commit() -> None:
                nonlocal drop, refuse
                drop = HOSTED_TOOL_TYPES if lists.drop is None else frozenset(lists.drop)
                refuse = REFUSED_TOOL_TYPES if lists.refuse is None else frozenset(lists.refuse)
            return commit
        reloaders.on("tools", reload)

    def edit(body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """-> (a copy of body without the dropped tools, the dropped types in first-seen order)."""
        body = dict(body)
        left_out: list[str] = []
        tools = body.get("tools")
        if isinstance(tools, list):
            kept, unknown_types = [], []
            for i, tool in enumerate(tools):
                ttype = tool.get("type") if isinstance(tool, dict) else None
                if not isinstance(ttype, str) or ttype in _CORE:
                    kept.append(tool)  # translation validates these (and refuses a non-object)
                elif not leave_out(ttype, f"tools[{i}].type", left_out, drop, refuse):
                    unknown_types.append(_show(ttype))
            if unknown_types:
                shown = ", ".join(dict.fromkeys(unknown_types))
                raise bad_request(f"Unknown tool type(s): {shown}.", param="tools", code="unsupported_tool")
            if left_out:
                body["tools"] = kept
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            ctype = choice.get("type")
            if leave_out(ctype, "tool_choice", left_out, drop, refuse):
                body["tool_choice"] = "auto"
            elif ctype == "allowed_tools" and isinstance(choice.get("tools"), list):
                allowed = choice["tools"]
                remaining = [t for t in allowed if _names(t) not in drop]
                if len(remaining) != len(allowed):
                    for t in allowed:
                        name = _names(t)
                        if name is not None and name in drop and name not in left_out:
                            left_out.append(name)
                    if remaining:
                        body["tool_choice"] = {**choice, "tools": remaining}
                    else:
                        body["tool_choice"] = "auto"
        return body, left_out

    def tools(ctx: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
        if not body.get("tools") and not isinstance(body.get("tool_choice"), dict):
            return body  # nothing edit() would touch
        edited, left_out = edit(body)
        if left_out:
            ctx.notices.append(hosted_tools_notice(left_out))
        return edited

    return tools
