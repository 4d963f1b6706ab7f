"""Responses request body -> chat-completions request body (pure: dicts in, dicts out).

`translate_request(body)` is the entry point: it validates a Responses API request and builds the
body that vLLM and SGLang accept on /v1/chat/completions, plus everything the response side needs
(the tool name map, the fields echoed in the Response object, notices), as one frozen
`Translation`. Every refusal is an `APIError(400)` whose `param` is the path of the offending
value (`input[3].content[0].text`); no JSON value can make it raise anything else.

The parts: `translate_options` (plain fields, sampling, text format, the chat body and the echo),
`translate_tools` (tools and tool_choice), `translate_input` (input items -> messages).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from proxy.errors import APIError, bad_request
from proxy.policy.rules import HOSTED_TOOL_TYPES, REFUSED_TOOL_TYPES, check_stateless
from proxy.protocol.compaction import SummaryAsk, summary_chat, take_trigger
from proxy.protocol.models import DEFAULT_SAMPLING, resolve_model
from proxy.protocol.prompt import PromptBound, prompt_bound
from proxy.protocol.translate_input import HOSTED_ITEM_TYPES, NO_SEAL_KEY, UNSEAL_FAILED, messages_of
from proxy.protocol.translate_options import (
    KNOWN_FIELDS,
    NO_SEAL_INCLUDE,
    REASONING_EFFORTS,
    STORE_NOTICE,
    TranslateOptions,
    chat_body,
    check_model,
    echo_fields,
    field_notices,
    is_int,
    output_cap_of,
    reasoning_of,
    scalars,
    text_format,
)
from proxy.protocol.translate_tools import ToolOrigin, tools_of

__all__ = [
    "ToolOrigin",
    "Translation",
    "TranslateOptions",
    "translate_request",
    "HOSTED_TOOL_TYPES",
    "REFUSED_TOOL_TYPES",
    "HOSTED_ITEM_TYPES",
    "REASONING_EFFORTS",
    "NO_SEAL_INCLUDE",
    "KNOWN_FIELDS",
    "STORE_NOTICE",
    "NO_SEAL_KEY",
    "UNSEAL_FAILED",
]


class Translation(NamedTuple):
    """One request, translated once. Frozen: a later phase that changes what is sent (the
    balance's output cap, the context check's clamp) makes a new one (`with_cap`,
    `with_max_tokens`), so what an earlier phase looked at never changes under it. `chat` and
    `echo` are never edited in place either: the copies get copies. A NamedTuple, not a frozen
    dataclass: the same immutability, built by one C call instead of an object.__setattr__
    per field (it is built twice for every billed request)."""

    chat: dict  # the chat-completions request body; chat["model"] is upstream_model
    model: str  # the model exactly as the client sent it
    upstream_model: str  # the served name `model` means (proxy.protocol.models.resolve_model)
    stream: bool
    tools: dict[str, ToolOrigin]  # upstream function name -> what the client knows it as
    echo: dict  # Response fields echoed back
    notices: tuple[str, ...]
    include_encrypted_reasoning: bool
    prompt_cache_key: str | None
    conversation: str | None
    max_output_tokens: int | None
    allowed_tools: frozenset[str] | None = None  # tool_choice allowed_tools: upstream names, else None
    # The most output tokens the client may be sent and billed, when the balance reserved for
    # a number (None: max_tokens as sent, if any). The rewriter stops there.
    reserved_output: int | None = None
    # (chat's messages, its tools, prompt_bound(chat)), computed once: the balance and the
    # context check both read it. It stands while chat holds those same two objects: the copies
    # share them (chat is never edited in place), a _replace() with other messages does not.
    prompt: tuple[Any, Any, PromptBound] | None = None
    # A compaction_trigger's request (proxy.protocol.compaction): how its summary is asked for;
    # chat is then the summary's (non-stream), answered by proxy.http.compaction_trigger.
    compaction: SummaryAsk | None = None
    choices: int = 1  # answers generated, each up to the cap (a pass-through's n; one here)

    def with_cap(self, cap: int, *, lowered: bool = True) -> Translation:
        """This request with its output held to `cap` tokens (reserved_output). lowered: the cap
        is also sent upstream as max_tokens and echoed as max_output_tokens (the balance lowered
        the client's cap to what it covers); else it is only the bound the hold was sized for."""
        if not is_int(cap) or cap < 1:
            raise ValueError(f"output cap must be a positive integer, got {cap!r}")
        if not lowered:
            return self._copy(self.chat, self.echo, self.max_output_tokens, cap)
        return self._copy({**self.chat, "max_tokens": cap}, {**self.echo, "max_output_tokens": cap}, cap, cap)

    def with_max_tokens(self, max_tokens: int) -> Translation:
        """This request with `max_tokens` sent upstream (the context check lowers it to the room
        the model's window leaves); the echo and the reserved cap stay as they are."""
        return self._copy({**self.chat, "max_tokens": max_tokens}, self.echo, self.max_output_tokens,
                          self.reserved_output)

    def _copy(self, chat: dict, echo: dict, max_output_tokens: int | None,
              reserved_output: int | None) -> Translation:
        # Every field by position (_replace() builds keyword arguments and walks the fields).
        return Translation(chat, self.model, self.upstream_model, self.stream, self.tools, echo, self.notices,
                           self.include_encrypted_reasoning, self.prompt_cache_key, self.conversation,
                           max_output_tokens, self.allowed_tools, reserved_output, self.prompt, self.compaction)

    def prompt_bound(self) -> PromptBound:
        """The prompt's upper bound of tokens, its bytes and whether it carries media
        (proxy.protocol.prompt): the one computed with the translation, while it stands."""
        chat, found = self.chat, self.prompt
        if found is not None and found[0] is chat.get("messages") and found[1] is chat.get("tools"):
            return found[2]
        return prompt_bound(chat)

    @property
    def output_cap(self) -> int | None:
        """The most output deltas the client may be sent (and billed): the max_tokens sent
        upstream, or the cap reserved for when none was sent, whichever is lower."""
        return output_cap_of(self.chat, self.reserved_output)


def translate_request(body: Any, options: TranslateOptions | None = None) -> Translation:
    """Validate a Responses request body and build the chat-completions body. Raises APIError(400)."""
    if options is None:
        options = TranslateOptions()
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")

    model = check_model(body)
    # A name nobody serves goes on as sent: routing answers 404 naming the client's string.
    upstream_model = resolve_model(model, options.served) if options.served is not None else model
    if upstream_model is None:
        upstream_model = model

    if "input" not in body or body["input"] is None:
        raise bad_request("Missing required parameter: 'input'.", param="input")

    check_stateless(body, items=False)  # _translate_input refuses an item_reference where it stands
    items, trigger = take_trigger(body["input"])
    ask = options.compaction if trigger else None
    if trigger and ask is None:
        raise APIError(501, "Compaction needs a sealing key: the operator has not configured reasoning_seal.keys.",
                       code="compaction_unavailable")
    notices: list[str] = []
    field_notices(body, notices)
    sc = scalars(body, options, notices)
    effort, summary = reasoning_of(body.get("reasoning"))
    response_format, text_echo = text_format(body.get("text"))
    acc, raw_choice, chat_choice, allowed_tools, chat_tools = tools_of(body, notices)
    messages, config_effort = messages_of(items, sc.instructions, options, notices)
    if effort is None and config_effort is not None:
        effort = config_effort

    sent = sc
    if ask is not None:  # the request is the summary's (proxy.protocol.compaction)
        messages = summary_chat(messages, ask)
        # The proxy's own cap unless the client set one; upstream as JSON, read whole by the handler.
        sent = sc._replace(stream=False, max_out=sc.max_out or ask.max_tokens, parallel=None, top_logprobs=None)
        # Thinking off (proxy.protocol.dialects puts the switch where the worker's template reads
        # it); the tools stay in the prompt (its cached prefix), never called.
        chat = chat_body(sent, upstream_model, messages, "none", None, chat_tools, "none" if chat_tools else None)
        allowed_tools = None
    else:
        chat = chat_body(sc, upstream_model, messages, effort, response_format, chat_tools, chat_choice)
    sampling = DEFAULT_SAMPLING
    if options.sampling_defaults and upstream_model in options.sampling_defaults:
        sampling = {**DEFAULT_SAMPLING, **options.sampling_defaults[upstream_model]}
    echo = echo_fields(sc, body.get("store"), sampling, acc.echo_tools, raw_choice, text_echo, effort, summary)
    return Translation(
        chat=chat,
        model=model,
        upstream_model=upstream_model,
        stream=sent.stream,
        tools=acc.origins,
        echo=echo,
        notices=tuple(notices),
        include_encrypted_reasoning=sc.include_encrypted,
        prompt_cache_key=sc.prompt_cache_key,
        conversation=sc.conversation,
        max_output_tokens=sent.max_out,
        allowed_tools=allowed_tools,
        prompt=(chat.get("messages"), chat.get("tools"), prompt_bound(chat)),
        compaction=ask,
    )

