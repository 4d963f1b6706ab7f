"""The other APIs of the model server, passed through: the body parsed once into what its server does.

/v1/chat/completions, /v1/completions, /v1/embeddings and Anthropic's /v1/messages (+
/v1/messages/count_tokens) keep their own wire format, but the edge owns every field that
costs: `build` reads each field of the client's body by the rules of
proxy.protocol.passthrough_fields (what vLLM and SGLang do with it) and rebuilds the body that
goes upstream from them, so what a worker runs is what the balance priced:

  * the output cap as the server takes it (vLLM: `max_completion_tokens`, else `max_tokens`;
    a completion without one gets vLLM's and SGLang's 16), written to every cap field the
    server reads, and lowered there when the balance or the context window lowers it;
  * how many answers it makes (`choices`): `n`, `best_of`, a beam's width, a batch of prompts,
    each bounded (endpoints.max_choices, max_batch_inputs) and multiplied into the hold;
  * every text the template renders (roles, names, tools, documents, template arguments) in
    the prompt's bound;
  * logprobs bounded (endpoints.max_top_logprobs), `min_tokens` kept within the cap;
  * extensions whose work nothing bounds refused with a 400 naming them, unless the operator
    allows them (endpoints.allowed_extensions); unknown fields not forwarded, and named.

`Passthrough` stands where a Responses request's Translation stands on the request's context,
with the fields the phases after it read (the balance, the context check, affinity, the access
line):

  chat     a chat-shaped VIEW of the prompt (messages, tools, max_tokens): what the prompt's
           bound (proxy.protocol.prompt.prompt_bound) and the token counts (proxy.upstream.tokens)
           read. Every text the model reads is in it, so its bytes stay an upper bound of the
           prompt's tokens (a byte-level BPE token covers at least one byte; a token id written
           as JSON digits takes at least one byte too).
  body     what goes upstream.

Pure: no I/O. Refusals are APIError(400) like the translation's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from proxy.errors import bad_request
from proxy.protocol.models import resolve_model
from proxy.protocol.passthrough_fields import EXTENSION, FIELDS, RENDERED, SILENT
from proxy.protocol.prompt import PromptBound, prompt_bound
from proxy.protocol.translate_options import check_model, is_int, output_cap_of

# family -> the worker's path
UPSTREAM_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "messages": "/v1/messages",
    "messages_count": "/v1/messages/count_tokens",
}
ANTHROPIC = frozenset({"messages", "messages_count"})
COMPLETION_DEFAULT_CAP = 16  # vLLM's CompletionRequest.max_tokens default (SGLang's too)


class Limits(NamedTuple):
    """config `endpoints`: the bounds of what one pass-through request may ask for."""

    max_choices: int = 16  # n, best_of, a beam's width
    max_batch_inputs: int = 256  # prompts of one completion, inputs of one embedding request
    max_top_logprobs: int = 20  # vLLM's own default bound (--max-logprobs)
    allowed_extensions: frozenset[str] = frozenset()


DEFAULT_LIMITS = Limits()


class Passthrough(NamedTuple):
    """One pass-through request: what goes upstream (`body`) and what billing reads (`chat`)."""

    chat: dict  # the chat-shaped view of the prompt (module docstring); chat["max_tokens"]: the cap sent
    body: dict  # the upstream body (model resolved, only fields with a rule)
    model: str  # as the client sent it
    upstream_model: str
    stream: bool
    family: str  # chat | completions | embeddings | messages | messages_count
    cap_fields: tuple[str, ...]  # the body's output-cap fields, all set to the cap sent
    max_output_tokens: int | None  # the cap asked for (the client's, else the server's default; None: the window)
    usage_added: bool = False  # stream_options.include_usage added by the edge: its usage chunk is not passed on
    reserved_output: int | None = None  # the cap (per answer) the hold was sized for (the balance)
    media: bool = False  # the prompt carries images or other media (no byte bound)
    # What the affinity key reads of any request (proxy.protocol.upstream_request): no
    # pass-through family names a cache key or a conversation the edge keys workers by.
    prompt_cache_key: str | None = None
    conversation: str | None = None
    # prompt_bound(view), computed once at build: the balance and the context check both read it
    # (with_cap and with_max_tokens copy chat with the same messages and tools).
    bound: PromptBound | None = None
    choices: int = 1  # answers generated, each up to the cap: the hold's output is cap x choices
    notices: tuple[str, ...] = ()  # the fields not forwarded (named in x-token-notice)
    prompts: int = 1  # a completion's batch: each prompt has the window to itself

    @property
    def path(self) -> str:
        return UPSTREAM_PATHS[self.family]

    def _with(self, body: dict, chat: dict, max_output_tokens: int | None, reserved: int | None) -> Passthrough:
        return self._replace(body=body, chat=chat, max_output_tokens=max_output_tokens, reserved_output=reserved)

    def _capped_body(self, cap: int) -> dict:
        body = dict(self.body)
        for name in self.cap_fields:
            body[name] = cap
        least = body.get("min_tokens")
        if type(least) is int and least > cap:
            body["min_tokens"] = cap  # vLLM refuses min_tokens above max_tokens
        return body

    def with_cap(self, cap: int, *, lowered: bool = True) -> Passthrough:
        """As Translation.with_cap: `cap` is the most output per answer billed; lowered: also sent upstream."""
        if not is_int(cap) or cap < 1:
            raise ValueError(f"output cap must be a positive integer, got {cap!r}")
        if not lowered or not self.cap_fields:
            return self._with(self.body, self.chat, self.max_output_tokens, cap)
        return self._with(self._capped_body(cap), {**self.chat, "max_tokens": cap}, cap, cap)

    def with_max_tokens(self, max_tokens: int) -> Passthrough:
        """The context check's clamp: sent upstream; the reserved cap stays."""
        if not self.cap_fields:
            return self
        return self._with(self._capped_body(max_tokens), {**self.chat, "max_tokens": max_tokens},
                          self.max_output_tokens, self.reserved_output)

    def prompt_bound(self) -> PromptBound:
        bound = self.bound if self.bound is not None else prompt_bound(self.chat)
        return bound if bound.media or not self.media else bound._replace(media=True)

    @property
    def output_cap(self) -> int | None:
        """The most output one answer may have: the cap sent, within the cap held for."""
        return output_cap_of(self.chat, self.reserved_output)


def _positive(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise bad_request(f"'{name}' must be a positive integer.", param=name)
    return int(value)


def _bounded(body: dict, name: str, low: int, high: int, why: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or not low <= value <= high:
        raise bad_request(f"'{name}' must be an integer from {low} to {high} {why}.", param=name)
    return int(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean.", param=name)
    return bool(value)


def _not_asked(value: Any) -> bool:
    """A field left at the server's default: nothing to refuse (SDKs send `echo: false`)."""
    return value is None or value is False or (type(value) is int and value == 0) or value in ("", [], {})


def _fields(family: str, body: dict, sent: dict, limits: Limits) -> tuple[list[Any], list[str]]:
    """Copy each field with a rule into `sent`; -> (the rendered fields' values, the unknown names)."""
    table, own = FIELDS[family]
    rendered: list[Any] = []
    unknown: list[str] = []
    for name, value in body.items():
        if name in own:
            continue
        rule = table.get(name)
        if rule is None:
            unknown.append(name)
        elif rule == SILENT:
            continue
        elif rule == EXTENSION and name not in limits.allowed_extensions:
            if _not_asked(value):
                continue
            raise bad_request(f"'{name}' changes the work a model server does in a way this proxy cannot bound, "
                              "and is not accepted here (its operator may allow it: endpoints.allowed_extensions).",
                              param=name, code="unsupported_parameter")
        else:
            sent[name] = value
            if rule == RENDERED and value is not None:
                rendered.append(value)
    return rendered, unknown


def _rendered_message(rendered: list[Any]) -> dict:
    # Tools have their own place in the view; documents, template arguments and a suffix are
    # counted as one more message of their JSON (its overhead only adds to the bound).
    return {"role": "system", "content": orjson.dumps(rendered).decode()}


def _text_messages(texts: list[str]) -> list[dict]:
    return [{"role": "user", "content": t} for t in texts]


def _prompt_texts(value: Any, param: str) -> list[str]:
    """A completion prompt or embedding input (a string, strings, token ids, lists of token ids)
    as one text per prompt, whose bytes bound its tokens."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(is_int(v) for v in value):
            return [orjson.dumps(value).decode()]  # one token per id, each id at least one byte
        if all(isinstance(v, list) and v and all(is_int(x) for x in v) for v in value):
            return [orjson.dumps(v).decode() for v in value]
    raise bad_request(f"'{param}' must be a string, a list of strings or a list of token ids.", param=param)


def _batch(texts: list[str], param: str, limits: Limits) -> list[str]:
    if len(texts) > limits.max_batch_inputs:
        raise bad_request(f"'{param}' holds {len(texts)} inputs; this proxy takes at most {limits.max_batch_inputs} "
                          "in one request (endpoints.max_batch_inputs).", param=param)
    return texts


def _chat_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list.", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request("Each message must be an object with a string 'role'.", param=f"messages[{i}]")
    return messages


def _anthropic_view(body: dict) -> tuple[list, bool]:
    """Anthropic messages (and system) as chat messages for the bounds; whether media is in them."""
    out: list[dict] = []
    media = False
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": system if isinstance(system, str) else orjson.dumps(system).decode()})
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list.", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request("Each message must be an object.", param=f"messages[{i}]")
        role = m.get("role")
        if role is not None and not isinstance(role, str):
            raise bad_request("'role' must be a string.", param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for block in content:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind in ("image", "document"):
                    media = True
                    source = block.get("source")
                    if isinstance(source, dict) and source.get("type") == "url":
                        parts.append({"type": "image_url", "image_url": {"url": source.get("url")}})
                elif kind == "text" and isinstance(block.get("text"), str):
                    parts.append({"type": "text", "text": block["text"]})
                else:  # tool_use, tool_result, thinking: every byte of them may reach the template
                    parts.append({"type": "text", "text": orjson.dumps(block).decode()})
            content = parts
        elif content is not None and not isinstance(content, str):
            content = orjson.dumps(content).decode()
        out.append({"role": role or "user", "content": content})
    return out, media


def _choices(body: dict, limits: Limits, best_of: bool) -> int:
    """Answers per prompt: n, best_of (generated, the best n returned), a beam's width (n)."""
    why = f"through this proxy (endpoints.max_choices: {limits.max_choices})"
    n = _bounded(body, "n", 1, limits.max_choices, why) or 1
    _flag(body, "use_beam_search")
    most = _bounded(body, "best_of", 1, limits.max_choices, why) if best_of else None
    if most is not None and most < n:
        raise bad_request("'best_of' must be at least 'n'.", param="best_of")
    return max(n, most or 1)


def _least_tokens(body: dict, cap: int | None) -> None:
    least = body.get("min_tokens")
    if least is None:
        return
    if not is_int(least) or least < 0:
        raise bad_request("'min_tokens' must be a non-negative integer.", param="min_tokens")
    if cap is not None and least > cap:
        raise bad_request(f"'min_tokens' ({least}) must not be more than the output cap ({cap}).", param="min_tokens")


def _chat(body: dict, sent: dict, limits: Limits) -> tuple[dict, int | None, int, tuple[str, ...]]:
    messages = _chat_messages(body.get("messages"))
    choices = _choices(body, limits, best_of=False)
    # vLLM: max_completion_tokens when set, else max_tokens (serving.py, get_max_tokens); both are
    # sent as the one cap, so no server reads another.
    asked = _positive(body, "max_completion_tokens")
    old = _positive(body, "max_tokens")
    cap = asked if asked is not None else old
    logprobs = _flag(body, "logprobs")
    top = _bounded(body, "top_logprobs", 0, limits.max_top_logprobs, "(endpoints.max_top_logprobs)")
    _least_tokens(body, cap)
    for name in ("n", "use_beam_search", "min_tokens", "top_logprobs"):
        if body.get(name) is not None:
            sent[name] = body[name]
    if body.get("logprobs") is not None:
        sent["logprobs"] = logprobs
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    fields = ("max_tokens", "max_completion_tokens")
    if cap is not None:
        sent["max_tokens"] = sent["max_completion_tokens"] = cap
    return {"messages": messages, "tools": body.get("tools")}, cap, choices, fields


def _completions(body: dict, sent: dict, limits: Limits) -> tuple[dict, int | None, int, tuple[str, ...], int]:
    prompts = _batch(_prompt_texts(body.get("prompt"), "prompt"), "prompt", limits)
    choices = _choices(body, limits, best_of=True) * len(prompts)
    # absent: the server's default; null: the window, as the client asked
    cap = _positive(body, "max_tokens") if "max_tokens" in body else COMPLETION_DEFAULT_CAP
    _bounded(body, "logprobs", 0, limits.max_top_logprobs, "(endpoints.max_top_logprobs)")
    _least_tokens(body, cap)
    for name in ("n", "best_of", "use_beam_search", "logprobs", "min_tokens"):
        if body.get(name) is not None:
            sent[name] = body[name]
    sent["prompt"] = body["prompt"]
    sent["max_tokens"] = cap  # null (the window, as the client asked) is sent as null
    return {"messages": _text_messages(prompts)}, cap, choices, ("max_tokens",), len(prompts)


def _stream_usage(body: dict, sent: dict) -> bool:
    """The usage an OpenAI stream must report for its bill: asked for when the client did not
    (then the edge keeps it to itself: True), and only at the end (continuous_usage_stats would
    put it on every chunk the client sees)."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", param="stream_options")
    if options and options.get("include_usage"):
        sent["stream_options"] = options
        return False
    sent["stream_options"] = {**(options or {}), "include_usage": True, "continuous_usage_stats": False}
    return True


def build(family: str, body: dict, served: Any, limits: Limits = DEFAULT_LIMITS) -> Passthrough:
    """The Passthrough of a client's body (APIError 400 when it cannot be priced as sent)."""
    model = check_model(body)
    upstream_model = (resolve_model(model, served) if served is not None else model) or model
    stream = _flag(body, "stream")
    sent: dict[str, Any] = {"model": upstream_model}
    rendered, unknown = _fields(family, body, sent, limits)
    usage_added = False
    media = False
    choices = prompts = 1
    cap_fields: tuple[str, ...] = ()
    if family == "chat":
        view, cap, choices, cap_fields = _chat(body, sent, limits)
        sent["messages"] = view["messages"]
    elif family == "completions":
        view, cap, choices, cap_fields, prompts = _completions(body, sent, limits)
    elif family == "embeddings":
        if stream:
            raise bad_request("Embeddings are not streamed.", param="stream")
        texts = _batch(_prompt_texts(body.get("input"), "input"), "input", limits)
        sent["input"] = body["input"]
        cap = 1  # nothing is generated: the hold is the input (+ one token's price)
        view = {"messages": _text_messages(texts)}
    elif family in ANTHROPIC:
        messages, media = _anthropic_view(body)
        sent["messages"] = body["messages"]
        view = {"messages": messages, "tools": body.get("tools")}
        rendered = [r for r in rendered if r is not body.get("system") and r is not body.get("tools")]
        if family == "messages":
            cap = _positive(body, "max_tokens")
            if cap is None:
                raise bad_request("max_tokens: Field required", param="max_tokens")
            sent["max_tokens"] = cap
            cap_fields = ("max_tokens",)
        else:
            cap, stream = None, False
    else:  # pragma: no cover - the route table names only the families above
        raise ValueError(family)
    if stream:
        sent["stream"] = True
        if family in ("chat", "completions"):
            usage_added = _stream_usage(body, sent)
    rendered = [r for r in rendered if r is not view.get("tools")]
    if rendered:
        view["messages"] = [*view["messages"], _rendered_message(rendered)]
    if cap is not None and family != "embeddings":
        view["max_tokens"] = cap
    if view.get("tools") is None:
        view.pop("tools", None)
    notices = (f"unknown field(s) ignored: {', '.join(sorted(unknown)[:20])}",) if unknown else ()
    return Passthrough(view, sent, model, upstream_model, stream, family, cap_fields,
                       cap if family != "embeddings" else 1, usage_added, None, media, bound=prompt_bound(view),
                       choices=choices, notices=notices, prompts=prompts)
