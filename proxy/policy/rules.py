"""One home for the request rules that two layers enforce: the stateless guard and hosted tools.

The `stateless` and `tools` policies apply these first, in the prepare phase (with the
operator's settings); the translation applies them again with the defaults, so a deployment
with those policies off refuses or leaves out the same things with the same words.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Protocol

from proxy.errors import APIError


class StatelessSettings(Protocol):
    """What the rules read of config.yaml `stateless` (proxy.config.sections.Stateless): the policy
    sits below the configuration, which checks its names (proxy/config/cross_checks.py)."""

    @property
    def enabled(self) -> bool: ...

    @property
    def previous_response_id(self) -> str: ...

__all__ = [
    "CORE_TOOL_TYPES",
    "HOSTED_TOOL_TYPES",
    "REFUSED_TOOL_TYPES",
    "STATELESS_MODES",
    "apply_stateless",
    "check_stateless",
    "previous_response_mode",
    "item_reference_at",
    "item_reference_refusal",
    "tool_type_refusal",
    "leave_out",
    "hosted_tools_notice",
]

# Tool types the OpenAI platform runs itself: left out (with a notice), never forwarded.
HOSTED_TOOL_TYPES: frozenset[str] = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "computer_use",
        "computer_use_preview",
        "computer",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)
# Tool types refused outright (the client would expect a result we cannot produce).
REFUSED_TOOL_TYPES: frozenset[str] = frozenset({"image_generation"})
_REFUSED_CODES = {"image_generation": "image_generation_unsupported"}


# --------------------------------------------------------------------------- stateless guard


def _stateless_refusal(message: str, param: str) -> APIError:
    return APIError(400, message, code="stateless_only", param=param)


def item_reference_refusal(param: str) -> APIError:
    return _stateless_refusal("item_reference points at stored state: send the item itself.", param)


def item_reference_at(items: list) -> int | None:
    """The index of the first item_reference item, if any."""
    # Long conversations have hundreds of items: look through their types in C first
    # (dict.get over the list); only a hit, or an item that is not an object, walks them.
    try:
        if "item_reference" not in map(dict.get, items, repeat("type")):
            return None
    except TypeError:  # an item that is not an object: the translation refuses it later
        pass
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            return i
    return None


def check_stateless(body: dict[str, Any], previous_response_id: str = "refuse", items: bool = True) -> None:
    """Refuse what needs stored state (APIError 400 `stateless_only`). With
    previous_response_id="ignore" that field is let through (the caller leaves it out:
    `without_previous_response`). `items=False` leaves the item_reference scan to a caller
    that walks the items anyway."""
    if body.get("previous_response_id") is not None and previous_response_id == "refuse":
        raise _stateless_refusal("previous_response_id is not supported: this endpoint is stateless; "
                                 "send the whole conversation in input.", "previous_response_id")
    if body.get("background") is True:
        raise _stateless_refusal("background mode needs stored state: stream the response or wait for it.",
                                 "background")
    if body.get("prompt") is not None:
        raise _stateless_refusal("Stored prompts are not supported: send instructions and input.", "prompt")
    if items:
        inp = body.get("input")
        if isinstance(inp, list):
            at = item_reference_at(inp)
            if at is not None:
                raise item_reference_refusal(f"input[{at}]")


def without_previous_response(body: dict[str, Any]) -> dict[str, Any]:
    """`body` without previous_response_id (a new dict; the same one when it has none)."""
    if "previous_response_id" not in body:
        return body
    return {k: v for k, v in body.items() if k != "previous_response_id"}


STATELESS_MODES = ("refuse", "ignore")
CORE_TOOL_TYPES = frozenset({"function", "custom", "namespace"})  # translated, never dropped or refused


def previous_response_mode(section: StatelessSettings) -> str:
    """What the operator's `stateless` section (config.stateless) means for previous_response_id:
    "ignore" only when the policy is enabled and says so; otherwise "refuse" (a deployment with
    the policy off still has the translation refuse it). Every endpoint that takes a Responses
    body (the prepare phase's policy, /v1/responses/compact) asks this."""
    if not section.enabled:
        return "refuse"
    return "ignore" if section.previous_response_id == "ignore" else "refuse"


def apply_stateless(body: dict[str, Any], mode: str) -> dict[str, Any]:
    """The stateless guard with `mode` (see `previous_response_mode`): refuses what needs stored
    state; with "ignore", returns the body without previous_response_id."""
    check_stateless(body, mode)
    return without_previous_response(body) if mode == "ignore" else body


# --------------------------------------------------------------------------- hosted tools


def tool_type_refusal(ttype: str, param: str) -> APIError:
    return APIError(400, f"Tool type '{ttype}' is not supported by this endpoint.", param=param,
                    code=_REFUSED_CODES.get(ttype, "unsupported_tool"))


def leave_out(ttype: Any, param: str, left_out: list[str],
              drop: frozenset[str] = HOSTED_TOOL_TYPES, refuse: frozenset[str] = REFUSED_TOOL_TYPES) -> bool:
    """True when a tool of type `ttype` is left out (its type noted once in `left_out`);
    raises the refusal for a refused type; False for any other type."""
    if not isinstance(ttype, str):
        return False
    if ttype in refuse:
        raise tool_type_refusal(ttype, param)
    if ttype in drop:
        if ttype not in left_out:
            left_out.append(ttype)
        return True
    return False


def hosted_tools_notice(left_out: list[str]) -> str:
    return f"tools left out: {', '.join(left_out)}"
