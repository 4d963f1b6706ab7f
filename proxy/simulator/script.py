"""The pure half of the upstream simulator: tokenizer, prefix cache, scripts and answers.

No I/O and no aiohttp here; `proxy.simulator.server` turns a `Generation` into vLLM or SGLang
bytes. Everything is deterministic: the same prompt gives the same default answer in
every run (the hash is sha256, never Python's salted `hash`).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

# A token is a run of word characters or one other non-space character.
TOKEN_RE = re.compile(r"\w+|[^\w\s]")
# A streamed piece is one token with the whitespace in front of it (so pieces join back).
PIECE_RE = re.compile(r"\s*(?:\w+|[^\w\s])|\s+")

BLOCK_SIZE = 16  # vLLM's default KV block size: cached_tokens is a multiple of it
CACHE_BLOCKS = 1 << 16  # prefix-cache capacity, in blocks (LRU)

CONTENT_KEYS = ("reasoning", "text", "tool_calls", "text_words")

WORDS = (
    "the weather today looks calm and clear with light wind from the west sun "
    "rain cloud river mountain city morning evening quiet bright warm cold soft "
    "answer question simple short story about a small model that speaks plainly "
    "every token counts here we go again slowly carefully"
).split()
THINK_WORDS = "let me think check consider the question first then answer briefly".split()


# --------------------------------------------------------------------------- tokenizer


def tokenize(text: str) -> list[str]:
    return TOKEN_RE.findall(text)


def token_id(token: str) -> int:
    """A stable small integer for a token string (the /tokenize endpoints print these)."""
    return int.from_bytes(hashlib.blake2s(token.encode(), digest_size=4).digest(), "big") % 150000 + 100


def split_pieces(text: str, chunk_chars: int | None = None) -> list[str]:
    """Streamed pieces of `text`: one word token (with leading spaces) each, or fixed-size slices."""
    if not text:
        return []
    if chunk_chars and chunk_chars > 0:
        return [text[i : i + chunk_chars] for i in range(0, len(text), chunk_chars)]
    return PIECE_RE.findall(text)


def content_text(content: Any) -> str:
    """The text of a message `content`: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    out.append(part["text"])
                elif part.get("type"):
                    out.append(f"<{part['type']}>")
            elif isinstance(part, str):
                out.append(part)
        return "\n".join(out)
    return json.dumps(content, ensure_ascii=False)


def render_prompt(messages: list, tools: Any = None, add_generation_prompt: bool = True,
                  reasoning_keys: tuple[str, ...] = ("reasoning_content", "reasoning")) -> str:
    """The flat text the simulator "templates" a chat into: tools, then role + content per message.

    Appending messages to a conversation only appends to this text, so the prefix cache sees
    a growing common prefix exactly like a real chat template.
    """
    out = []
    if tools:
        out.append("tools: " + json.dumps(tools, ensure_ascii=False))
    for m in messages:
        if not isinstance(m, dict):
            out.append(content_text(m))
            continue
        out.append(f"{m.get('role', '')}:")
        for key in (*reasoning_keys, "content"):
            t = content_text(m.get(key))
            if t:
                out.append(t)
        if m.get("tool_calls"):
            out.append(json.dumps(m["tool_calls"], ensure_ascii=False))
    if add_generation_prompt:
        out.append("assistant:")
    return "\n".join(out)


# --------------------------------------------------------------------------- prefix cache


class PrefixCache:
    """vLLM-style automatic prefix caching over full blocks of BLOCK_SIZE tokens.

    Each full block is keyed by a hash chained over every block before it, so a hit means
    the whole prefix up to that block was seen before. `lookup_insert` returns
    (cached_tokens, created_cache_tokens) and records the prompt's blocks.
    """

    def __init__(self, capacity: int = CACHE_BLOCKS, block_size: int = BLOCK_SIZE):
        self.capacity = capacity
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def lookup_insert(self, tokens: list[str]) -> tuple[int, int]:
        bs = self.block_size
        hashes, h = [], 0
        for b in range(len(tokens) // bs):
            h = hash((h, tuple(tokens[b * bs : (b + 1) * bs])))
            hashes.append(h)
        # The last prompt token is always recomputed, so a hit covers at most len-1 tokens.
        eligible = max(0, (len(tokens) - 1) // bs)
        hit = 0
        for h in hashes[:eligible]:
            if h not in self._blocks:
                break
            hit += 1
        created = 0
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
                created += 1
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return hit * bs, created * bs

    def clear(self) -> None:
        self._blocks.clear()


# --------------------------------------------------------------------------- scripts


def find_directive(messages: Any) -> dict | None:
    """The `SIM:{...}` object in the text of the last user or tool message, if any."""
    if not isinstance(messages, list):
        return None
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") in ("user", "tool"):
            text = content_text(m.get("content"))
            at = text.find("SIM:")
            if at < 0:
                return None
            pos = at + 4
            while pos < len(text) and text[pos].isspace():
                pos += 1
            try:
                obj, _ = json.JSONDecoder().raw_decode(text, pos)
            except ValueError:
                return None
            return obj if isinstance(obj, dict) else None
    return None


def example_value(schema: Any, depth: int = 0) -> Any:
    """A value satisfying a JSON schema's type: strings "x", numbers 1, booleans true..."""
    if not isinstance(schema, dict) or depth > 8:
        return "x"
    if schema.get("enum"):
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "null")
    if t is None:
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return example_value(schema[key][0], depth + 1)
        t = "object" if "properties" in schema else "string"
    if t == "string":
        return "x"
    if t in ("integer", "number"):
        return 1
    if t == "boolean":
        return True
    if t == "null":
        return None
    if t == "array":
        return []
    props = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
    required = schema["required"] if isinstance(schema.get("required"), list) else []
    return {k: example_value(props.get(k), depth + 1) for k in required if isinstance(k, str)}


def _function_tools(tools: Any) -> list[dict]:
    out = []
    for t in tools if isinstance(tools, list) else []:
        if isinstance(t, dict):
            fn = t["function"] if isinstance(t.get("function"), dict) else t
            if isinstance(fn.get("name"), str):
                out.append(fn)
    return out


def _stream_bytes(seed: int, prompt: str):
    """An endless deterministic byte stream from the prompt."""
    counter = 0
    while True:
        yield from hashlib.sha256(f"{seed}\x00{counter}\x00{prompt}".encode()).digest()
        counter += 1


@dataclass
class Call:
    id: str
    name: str
    arguments: str


@dataclass
class Plan:
    """What the model "wants" to say before max_tokens cuts it."""

    reasoning: str = ""
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    finish: str | None = None  # an explicit finish reason (script) or the default's


def default_plan(body: dict, prompt: str, seed: int, tool_id) -> Plan:
    """The deterministic answer to a request without a script."""
    rnd = _stream_bytes(seed, prompt)
    plan = Plan()
    kwargs = body.get("chat_template_kwargs")
    thinking = not (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False)
    if thinking:
        n = 3 + next(rnd) % 4
        plan.reasoning = " ".join(THINK_WORDS[next(rnd) % len(THINK_WORDS)] for _ in range(n)).capitalize() + "."
    words = [WORDS[next(rnd) % len(WORDS)] for _ in range(12)]
    plan.text = " ".join(words).capitalize() + "."

    tools = _function_tools(body.get("tools"))
    choice = body.get("tool_choice")
    target, finish = None, None
    if tools and choice == "required":
        target, finish = tools[0], "tool_calls"
    elif tools and isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        target = next((t for t in tools if t["name"] == name), None)
        finish = "stop"  # vLLM really answers a named tool_choice with finish_reason "stop"
    if target is not None:
        args = example_value(target.get("parameters") or {"type": "object"})
        plan.text = ""
        plan.calls = [Call(tool_id(), target["name"], json.dumps(args, ensure_ascii=False))]
        plan.finish = finish
    return plan


def script_plan(script: dict, default: Plan, tool_id) -> Plan:
    """A script's answer: its content fields replace the default's (missing ones are empty)."""
    if not any(k in script for k in CONTENT_KEYS):
        plan = default
    else:
        plan = Plan(reasoning=str(script.get("reasoning") or ""), text=str(script.get("text") or ""))
        words = script.get("text_words")
        if isinstance(words, int) and words > 0:  # a long answer without a long script
            plan.text += " ".join(WORDS[i % len(WORDS)] for i in range(words))
        for c in script.get("tool_calls") or []:
            args = c.get("arguments", "{}")
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            plan.calls.append(Call(str(c.get("id") or tool_id()), str(c.get("name", "")), args))
    if script.get("finish"):
        plan.finish = str(script["finish"])
    return plan


# --------------------------------------------------------------------------- generation


@dataclass
class Delta:
    kind: str  # "reasoning" | "content" | "call" (a new tool call: id + name) | "args"
    text: str = ""
    index: int = 0  # tool call index
    call: Call | None = None
    tokens: int = 1  # output tokens this delta stands for


@dataclass
class Generation:
    deltas: list[Delta]
    finish: str
    completion_tokens: int
    reasoning_tokens: int

    @property
    def truncated(self) -> bool:
        return self.finish == "length"

    def reasoning(self) -> str:
        return "".join(d.text for d in self.deltas if d.kind == "reasoning")

    def text(self) -> str:
        return "".join(d.text for d in self.deltas if d.kind == "content")

    def calls(self) -> list[Call]:
        out: list[Call] = []
        for d in self.deltas:
            if d.kind == "call" and d.call is not None:
                out.append(Call(d.call.id, d.call.name, ""))
            elif d.kind == "args" and out:
                out[-1].arguments += d.text
        return out


def generate(plan: Plan, max_tokens: int | None, chunk_chars: int | None = None) -> Generation:
    """Cut a plan into deltas (one output token each), stopping at max_tokens with "length"."""
    wanted: list[Delta] = [Delta("reasoning", p) for p in split_pieces(plan.reasoning, chunk_chars)]
    wanted += [Delta("content", p) for p in split_pieces(plan.text, chunk_chars)]
    for i, call in enumerate(plan.calls):
        wanted.append(Delta("call", index=i, call=call, tokens=0))
        wanted += [Delta("args", p, index=i) for p in split_pieces(call.arguments, chunk_chars)]
    total = sum(d.tokens for d in wanted)
    deltas, used = [], 0
    cut = max_tokens is not None and total >= max_tokens
    limit = max_tokens or 0  # read only when cut
    for d in wanted:
        if cut and used + d.tokens > limit:
            break
        if cut and d.tokens == 0 and used >= limit:
            break
        deltas.append(d)
        used += d.tokens
    if cut:
        finish = "length"
    else:
        finish = plan.finish or ("tool_calls" if plan.calls else "stop")
    reasoning = sum(d.tokens for d in deltas if d.kind == "reasoning")
    return Generation(deltas, finish, used, reasoning)


def new_tool_id(dialect: str) -> str:
    if dialect == "sglang":
        return "call_" + secrets.token_hex(12)
    return "chatcmpl-tool-" + secrets.token_hex(8)
