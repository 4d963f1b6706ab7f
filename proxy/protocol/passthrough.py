"""The other APIs of the model server, passed through: what the edge reads of a body it does not translate.

/v1/chat/completions, /v1/completions, /v1/embeddings and Anthropic's /v1/messages (+
/v1/messages/count_tokens) go upstream as the client sent them: the model name resolved
(proxy.upstream.models.resolve_model), and nothing else rewritten but what billing needs
(`stream_options.include_usage` on an OpenAI stream when the client did not ask, the output cap
when the balance lowers it). `Passthrough` stands where a Responses request's Translation stands
on the request's context, with the same fields the phases after it read (the balance, the
context check, affinity, the access line):

  chat     a chat-shaped VIEW of the prompt (messages, tools, max_tokens): what the prompt's
           bound (proxy.protocol.prompt.prompt_bound: the balance's hold, the context check)
           and the token counts (proxy.upstream.tokens) read. For chat it
           is the body itself; for a completion prompt, embedding inputs and Anthropic messages it
           is built from them (every text the model reads is in it, so its bytes stay an upper
           bound of the prompt's tokens: a byte-level BPE token covers at least one byte, and a
           token id written as JSON digits takes at least one byte too).
  body     what goes upstream, byte for byte what the client sent when nothing was changed.

Pure: no I/O. Refusals are APIError(400) like the translation's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from proxy.errors import bad_request
from proxy.protocol.prompt import PromptBound, prompt_bound
from proxy.protocol.translate_options import is_int
from proxy.upstream.models import resolve_model

# family -> the worker's path
UPSTREAM_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "messages": "/v1/messages",
    "messages_count": "/v1/messages/count_tokens",
}
ANTHROPIC = frozenset({"messages", "messages_count"})


class Passthrough(NamedTuple):
    """One pass-through request: what goes upstream (`body`) and what billing reads (`chat`)."""

    chat: dict  # the chat-shaped view of the prompt (module docstring); chat["max_tokens"]: the cap sent
    body: dict  # the upstream body (model resolved)
    model: str  # as the client sent it
    upstream_model: str
    stream: bool
    family: str  # chat | completions | embeddings | messages | messages_count
    cap_fields: tuple[str, ...]  # the body's output-cap fields, set when the cap is lowered
    max_output_tokens: int | None  # the client's own cap (None: none asked)
    usage_added: bool = False  # stream_options.include_usage added by the edge: its usage chunk is not passed on
    reserved_output: int | None = None  # the cap the hold was sized for (the balance)
    media: bool = False  # the prompt carries images or other media (no byte bound)
    # The fields of a Translation no pass-through family has (read by shared code with getattr or not at all).
    prompt_cache_key: str | None = None
    conversation: str | None = None
    echo: dict = {}  # noqa: RUF012 - never written: the empty value shared code reads
    tools: dict = {}  # noqa: RUF012 - never written, as echo
    include_encrypted_reasoning: bool = False
    allowed_tools: frozenset[str] | None = None
    compaction: Any = None
    # prompt_bound(view), computed once at build: the balance and the context check both read it
    # (with_cap and with_max_tokens copy chat with the same messages and tools).
    bound: PromptBound | None = None

    @property
    def path(self) -> str:
        return UPSTREAM_PATHS[self.family]

    def _with(self, body: dict, chat: dict, max_output_tokens: int | None, reserved: int | None) -> Passthrough:
        return self._replace(body=body, chat=chat, max_output_tokens=max_output_tokens, reserved_output=reserved)

    def _capped_body(self, cap: int) -> dict:
        body = dict(self.body)
        for name in self.cap_fields:
            if name in self.body or name == self.cap_fields[0]:
                body[name] = cap
        return body

    def with_cap(self, cap: int, *, lowered: bool = True) -> Passthrough:
        """As Translation.with_cap: `cap` is the most output billed; lowered: also sent upstream."""
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
        sent = self.chat.get("max_tokens")
        sent = sent if type(sent) is int and sent >= 1 else None
        reserved = self.reserved_output
        if reserved is None:
            return sent
        return reserved if sent is None or reserved < sent else sent


def _cap(body: dict, names: tuple[str, ...]) -> int | None:
    """The lowest of the body's output caps; 400 for one that is not a positive integer."""
    found = None
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            raise bad_request(f"'{name}' must be a positive integer.", param=name)
        found = value if found is None else min(found, value)
    return found


def _one_choice(body: dict) -> None:
    # The hold is sized for one answer: n (and best_of) above 1 would generate several under one cap.
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and value != 1:
            raise bad_request(f"'{name}' other than 1 is not supported through this proxy: send one request "
                              "per answer.", param=name)


def _text_messages(texts: list[str]) -> list[dict]:
    return [{"role": "user", "content": t} for t in texts]


def _prompt_texts(value: Any, param: str) -> list[str]:
    """A completion prompt or embedding input (a string, strings, token ids, lists of token ids)
    as texts whose bytes bound its tokens."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(is_int(v) for v in value) or all(isinstance(v, list) and all(is_int(x) for x in v) for v in value):
            return [orjson.dumps(value).decode()]  # one token per id, each id at least one byte
    raise bad_request(f"'{param}' must be a string, a list of strings or a list of token ids.", param=param)


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
    for m in messages:
        if not isinstance(m, dict):
            raise bad_request("Each message must be an object.", param="messages")
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
        out.append({"role": str(m.get("role") or "user"), "content": content})
    return out, media


def build(family: str, body: dict, served: Any) -> Passthrough:
    """The Passthrough of a client's body (APIError 400 when it cannot be billed as sent)."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise bad_request("Missing required parameter: 'model' must be a non-empty string.", param="model")
    upstream_model = (resolve_model(model, served) if served is not None else model) or model
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")
    stream = bool(stream)
    sent = dict(body)
    sent["model"] = upstream_model
    usage_added = False
    media = False
    if family == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list.", param="messages")
        _one_choice(body)
        cap_fields: tuple[str, ...] = (
            ("max_completion_tokens", "max_tokens") if "max_completion_tokens" in body else ("max_tokens",))
        cap = _cap(body, ("max_tokens", "max_completion_tokens"))
        view: dict[str, Any] = {"messages": messages, "tools": body.get("tools")}
    elif family == "completions":
        if body.get("echo"):
            raise bad_request("'echo' is not supported through this proxy.", param="echo")
        _one_choice(body)
        cap_fields = ("max_tokens",)
        cap = _cap(body, ("max_tokens",))
        view = {"messages": _text_messages(_prompt_texts(body.get("prompt"), "prompt"))}
        if body.get("suffix") is not None:
            view["messages"].append({"role": "user", "content": str(body["suffix"])})
    elif family == "embeddings":
        if stream:
            raise bad_request("Embeddings are not streamed.", param="stream")
        cap_fields, cap = (), 1  # nothing is generated: the hold is the input (+ one token's price)
        view = {"messages": _text_messages(_prompt_texts(body.get("input"), "input"))}
    elif family in ANTHROPIC:
        messages, media = _anthropic_view(body)
        tools = body.get("tools")
        if family == "messages":
            cap_fields = ("max_tokens",)
            cap = _cap(body, ("max_tokens",))
            if cap is None:
                raise bad_request("max_tokens: Field required", param="max_tokens")
        else:
            cap_fields, cap, stream = (), None, False
        view = {"messages": messages, "tools": tools}
    else:  # pragma: no cover - the route table names only the families above
        raise ValueError(family)
    if stream and family in ("chat", "completions"):
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object.", param="stream_options")
        if not (options or {}).get("include_usage"):
            sent["stream_options"] = {**(options or {}), "include_usage": True}
            usage_added = True
    if cap is not None and family != "embeddings":
        view["max_tokens"] = cap
    if view.get("tools") is None:
        view.pop("tools", None)
    return Passthrough(view, sent, model, upstream_model, stream, family, cap_fields,
                       cap if family != "embeddings" else 1, usage_added, None, media, bound=prompt_bound(view))
