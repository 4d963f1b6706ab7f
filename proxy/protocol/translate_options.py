"""The request's plain fields and options (sampling, limits, text format, reasoning), checked,
and the chat body and Response echo built from them; the small validators every part of the
translation shares. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from proxy.errors import bad_request

REASONING_EFFORTS: frozenset[str] = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})

NO_SEAL_INCLUDE = "reasoning.encrypted_content not returned: no reasoning seal key is configured on this proxy"
STORE_NOTICE = "store: true accepted, nothing is stored (this endpoint is stateless)"
_UNKNOWN_SHOWN = 10  # names in the unknown-fields notice; the rest are counted

# Every field of a Responses request body that some client may send and this proxy knows: the
# 000 and 004 docs' fields, the openai SDK's ResponseCreateParams (3.x) and the Open Responses
# spec's CreateResponseBody, /v1/responses/input_tokens' `personality`, Codex's
# `client_metadata`, and the WebSocket's `generate`. Known is not the same as honoured: the
# ones this proxy does not act on are documented as accepted and ignored (README, "Open
# Responses"). Any other field is accepted too, and named in a notice (`field_notices`).
KNOWN_FIELDS: frozenset[str] = frozenset({
    "model", "input", "instructions", "max_output_tokens", "stream", "stream_options", "temperature", "top_p",
    "presence_penalty", "frequency_penalty", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "max_tool_calls", "provider", "reasoning", "text", "include", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "user", "safety_identifier", "metadata", "conversation", "store",
    "previous_response_id", "background", "background_options", "prompt", "truncation", "service_tier",
    "context_management", "moderation", "image", "access_programs", "personality", "client_metadata", "generate",
})


@dataclass
class TranslateOptions:
    unseal: Callable[[str], str | None] | None = None  # encrypted_content -> text, None = cannot open
    served: Callable[[str], bool] | None = None  # is this model name served? None: every name is
    sampling_defaults: dict[str, dict[str, float]] | None = None  # served model -> its server's defaults
    # How a compaction_trigger's summary is asked for (proxy.protocol.compaction.SummaryAsk);
    # None: the proxy has no seal key, and a compaction_trigger is refused (501).
    compaction: Any = None


# --------------------------------------------------------------------------- small validators


MAX_MODEL_BYTES = 256  # a model alias: stored in every usage row and access line, so bounded


def check_model(body: dict) -> str:
    """The request's `model`: a non-empty string of at most MAX_MODEL_BYTES bytes of printable
    UTF-8 (no NUL or control character: every ledger and log stores it as sent)."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise bad_request("Missing required parameter: 'model' must be a non-empty string.", param="model")
    if len(model) > MAX_MODEL_BYTES or (not model.isascii() and len(model.encode()) > MAX_MODEL_BYTES):
        raise bad_request(f"'model' must be at most {MAX_MODEL_BYTES} bytes.", param="model")
    if not model.isprintable():
        raise bad_request("'model' must be printable text (no control characters).", param="model")
    return model


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def output_cap_of(chat: dict, reserved: int | None) -> int | None:
    """The most output one answer may have (and be billed for): the chat body's max_tokens as
    sent upstream, or the cap reserved for when none was sent, whichever is lower. Both
    requests a worker answers (a translation, a pass-through) bound their output so."""
    sent = chat.get("max_tokens")
    sent = sent if type(sent) is int and sent >= 1 else None
    if reserved is None:
        return sent
    return reserved if sent is None or reserved < sent else sent


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is None or isinstance(v, str):
        return v
    raise bad_request(f"Invalid type for '{key}': expected a string.", param=key)


def opt_bool(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is None or isinstance(v, bool):
        return v
    raise bad_request(f"Invalid type for '{key}': expected a boolean.", param=key)


def opt_number(body: dict, key: str, lo: float, hi: float) -> float | int | None:
    v = body.get(key)
    if v is None:
        return None
    if not is_num(v) or not (lo <= v <= hi):
        raise bad_request(f"Invalid '{key}': expected a number between {lo:g} and {hi:g}.", param=key)
    return v


def show(v: Any) -> str:
    """A short printable form of any JSON value, for error messages."""
    if isinstance(v, str):
        return v[:64]
    if v is None or isinstance(v, (bool, float)) or (isinstance(v, int) and v.bit_length() < 200):
        return repr(v)[:64]
    return type(v).__name__


def add_notice(notices: list[str], text: str) -> None:
    if text not in notices:
        notices.append(text)


def field_notices(body: dict, notices: list[str]) -> None:
    """Say what is accepted without effect that a client could believe had one: fields this
    proxy does not know (named, never refused: the spec lets a request carry extensions), and
    `store: true` (nothing is stored)."""
    unknown = [name for name in body if name not in KNOWN_FIELDS]
    if unknown:
        shown = ", ".join(show(name) for name in unknown[:_UNKNOWN_SHOWN])
        more = len(unknown) - _UNKNOWN_SHOWN
        add_notice(notices, f"unknown field(s) ignored: {shown}" + (f" and {more} more" if more > 0 else ""))
    if body.get("store") is True:
        add_notice(notices, STORE_NOTICE)


# --------------------------------------------------------------------------- tools


# --------------------------------------------------------------------------- plain fields


def text_format(text: Any) -> tuple[dict | None, dict]:
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
        # The Open Responses type requires both in the echo: null and OpenAI's default (false) when not sent.
        echo["format"] = {**fmt, "description": desc, "strict": strict if strict is not None else False}
        return {"type": "json_schema", "json_schema": js}, echo
    shown = show(ftype)
    raise bad_request(f"Unknown text format type '{shown}'.", param="text.format.type")


class Scalars(NamedTuple):
    """The request's plain fields, checked (a NamedTuple: made once per request, read, dropped)."""

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


def scalars(body: dict, options: TranslateOptions, notices: list[str]) -> Scalars:
    instructions = opt_str(body, "instructions")
    stream = bool(opt_bool(body, "stream"))
    temperature = opt_number(body, "temperature", 0, 2)
    top_p = opt_number(body, "top_p", 0, 1)
    presence_penalty = opt_number(body, "presence_penalty", -2, 2)
    frequency_penalty = opt_number(body, "frequency_penalty", -2, 2)
    max_out = body.get("max_output_tokens")
    if max_out is not None and (not is_int(max_out) or max_out < 1):
        raise bad_request("Invalid 'max_output_tokens': expected a positive integer.", param="max_output_tokens")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None and (not is_int(top_logprobs) or not 0 <= top_logprobs <= 20):
        raise bad_request("Invalid 'top_logprobs': expected an integer between 0 and 20.", param="top_logprobs")
    parallel = opt_bool(body, "parallel_tool_calls")
    user = opt_str(body, "user")
    safety_identifier = opt_str(body, "safety_identifier")
    prompt_cache_key = opt_str(body, "prompt_cache_key")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("Invalid type for 'metadata': expected an object.", param="metadata")
    max_tool_calls = body.get("max_tool_calls")
    if max_tool_calls is not None and (not is_int(max_tool_calls) or max_tool_calls < 0):
        raise bad_request("Invalid 'max_tool_calls': expected a non-negative integer.", param="max_tool_calls")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(x, str) for x in include)):
        raise bad_request("Invalid type for 'include': expected an array of strings.", param="include")
    include_encrypted = include is not None and "reasoning.encrypted_content" in include
    if include_encrypted and options.unseal is None:  # no seal key: nothing to seal with
        notices.append(NO_SEAL_INCLUDE)
    return Scalars(instructions, stream, temperature, top_p, presence_penalty, frequency_penalty, max_out,
                    top_logprobs, parallel, user, safety_identifier, prompt_cache_key, metadata, max_tool_calls,
                    include_encrypted, _conversation_id(body.get("conversation")))


def _conversation_id(conv: Any) -> str | None:
    if conv is None or isinstance(conv, str):
        return conv
    if isinstance(conv, dict) and isinstance(conv.get("id"), str):
        return conv["id"]
    raise bad_request("Invalid 'conversation': expected a string or an object with an 'id'.", param="conversation")


def reasoning_of(reasoning: Any) -> tuple[str | None, Any]:
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



def chat_body(sc: Scalars, upstream_model: str, messages: list[dict], effort: str | None,
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
        # Usage on every chunk (vLLM and SGLang both read continuous_usage_stats): the prompt's
        # count from the first chunk and the output so far, so a stream the worker cuts, or the
        # client leaves, is billed what the worker reported, never the hold's upper bound.
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
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


def echo_fields(sc: Scalars, store: Any, sampling: dict, echo_tools: list, raw_choice: Any, text_echo: dict,
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
