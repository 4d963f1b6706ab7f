"""The prompt's one bound (proxy.protocol.prompt.prompt_bound) and the one token counter
(proxy.upstream.tokens.TokenCounter): the bound is at least the prompt's tokens, the balance
and the context check hold and judge by the same number, the counter says None when it
cannot count."""

from __future__ import annotations

import json
from types import SimpleNamespace

import aiohttp
import orjson
from hypothesis import HealthCheck, given, settings, strategies as st

from proxy.protocol.prompt import (
    PER_MESSAGE_OVERHEAD,
    TEMPLATE_OVERHEAD,
    TOOLS_OVERHEAD,
    prompt_bound,
    prompt_bytes,
)
from proxy.protocol.translate import translate_request
from proxy.simulator.script import render_prompt, tokenize as sim_tokenize
from proxy.upstream.routing import check_context_window
from proxy.upstream.tokens import TokenCounter
from proxy.upstream.workers import Worker, WorkerPool

MODEL = "tiny-org/tiny-model"
PRICES = {"default": {"input": 1_000_000, "cached_input": 100_000, "output": 1_000_000}}  # 1 micro a token

# --------------------------------------------------------------------------- a byte-level stand-in

# A ChatML template with Hermes tool calls (Qwen 2.5's) on a tokenizer that is byte-level on
# every text the client sent (digits and punctuation reach one token per byte): the template's
# markup tokens (special tokens, role names) one token each, its other characters one per byte.
_TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\n<tools>", "\n</tools>\n\nFor "
    "each function call, return a json object with function name and arguments within <tool_call>"
    "</tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call>")
_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _tojson(value) -> str:
    return json.dumps(value, ensure_ascii=False)  # transformers' tojson: ", " and ": "


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else p.get("text", "") for p in content)
    return content or ""


def byte_level_count(chat: dict) -> int:
    """The prompt's tokens on the stand-in: markup tokens + UTF-8 bytes of everything else."""
    markup, text = 0, []
    messages = chat["messages"]
    system = _text(messages[0]["content"]) if messages and messages[0]["role"] == "system" else _DEFAULT_SYSTEM
    markup += 2  # <|im_start|>system
    text.append("\n" + system)
    if chat.get("tools"):
        text.append(_TOOLS_PREAMBLE[0] + "".join("\n" + _tojson(t) for t in chat["tools"]) + _TOOLS_PREAMBLE[1])
    markup += 1  # <|im_end|>
    text.append("\n")
    for m in messages[1:] if messages and messages[0]["role"] == "system" else messages:
        markup += 3  # <|im_start|>, the role, <|im_end|>
        text.append("\n")
        if m["role"] == "tool":
            markup += 2  # <tool_response>, </tool_response>
            text.append("\n" + _text(m["content"]) + "\n")
        else:
            if m.get("reasoning_content"):
                markup += 2  # <think>, </think>
                text.append("\n" + m["reasoning_content"] + "\n\n\n")
            text.append(_text(m.get("content")))
            for call in m.get("tool_calls") or ():
                markup += 2  # <tool_call>, </tool_call>
                function = call["function"]
                rendered = {"name": function["name"], "arguments": json.loads(function["arguments"])}
                text.append("\n\n" + _tojson(rendered) + "\n")
        text.append("\n")
    markup += 2  # the generation prompt: <|im_start|>assistant
    text.append("\n")
    return markup + len("".join(text).encode())


# Integers within 64 bits: a body's JSON is parsed by orjson, which reads a larger one as a float.
_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
                     max_leaves=20)
_name = st.from_regex(r"[a-z_]{1,12}", fullmatch=True)


@st.composite
def _call(draw) -> dict:
    arguments = draw(st.dictionaries(st.text(max_size=8), _json, max_size=5))
    compact = draw(st.booleans())
    raw = json.dumps(arguments, separators=(",", ":") if compact else None, ensure_ascii=draw(st.booleans()))
    return {"id": "call_" + draw(_name), "type": "function", "function": {"name": draw(_name), "arguments": raw}}


@st.composite
def _message(draw) -> dict:
    role = draw(st.sampled_from(["user", "assistant", "tool"]))
    text = draw(st.text(max_size=200))
    if role == "tool":
        return {"role": "tool", "tool_call_id": "call_" + draw(_name), "content": text}
    content = draw(st.sampled_from(["str", "parts"]))
    message: dict = {"role": role, "content": text if content == "str" else [{"type": "text", "text": text}]}
    if role == "assistant":
        if draw(st.booleans()):
            message["reasoning_content"] = draw(st.text(max_size=100))
        message["tool_calls"] = draw(st.lists(_call(), max_size=4))
    return message


@st.composite
def _chat(draw) -> dict:
    messages = draw(st.lists(_message(), min_size=1, max_size=6))
    if draw(st.booleans()):
        messages.insert(0, {"role": "system", "content": draw(st.text(max_size=100))})
    chat: dict = {"model": MODEL, "messages": messages}
    tools = draw(st.lists(st.builds(lambda name, params: {"type": "function", "function": {
        "name": name, "description": "d", "parameters": {"type": "object", "properties": params}}},
        _name, st.dictionaries(_name, _json, max_size=4)), max_size=4))
    if tools:
        chat["tools"] = tools
    return chat


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_chat())
def test_the_bound_is_at_least_the_prompts_tokens(chat):
    bound = prompt_bound(chat)
    assert not bound.media
    assert bound.tokens >= byte_level_count(chat)
    assert bound.tokens >= len(sim_tokenize(render_prompt(chat["messages"], chat.get("tools"))))  # the simulator's
    # bytes_per_token below 1 only makes it more generous
    assert prompt_bound(chat, bytes_per_token=0.5).tokens >= bound.tokens


def test_the_bound_is_the_text_and_the_templates_overheads_once():
    chat = {"messages": [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "ok"}]}
    assert prompt_bound(chat) == (6 + 2 + TEMPLATE_OVERHEAD + 2 * PER_MESSAGE_OVERHEAD, 8, False)
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = prompt_bound({**chat, "tools": tools})
    assert with_tools.tokens == prompt_bound(chat).tokens + prompt_bytes({"tools": tools})[0] + TOOLS_OVERHEAD
    assert prompt_bound(chat, (100, False), bytes_per_token=0.25).tokens == 400 + TEMPLATE_OVERHEAD + 32
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    assert prompt_bound({"messages": [image]}).media  # no byte count bounds an image's tokens


# --------------------------------------------------------------------------- one bound, two uses


async def test_the_balance_and_the_context_check_use_the_same_bound(make_proxy, http):
    body = {"model": MODEL, "instructions": "Be brief.", "input": "Tell me a story about rivers, 1,2,3."}
    t = translate_request(body)
    bound = t.prompt_bound().tokens
    assert bound == prompt_bound(t.chat).tokens

    # The balance (bytes_per_token 1): a key holding the bound + 5 is served with 5 output tokens.
    p = await make_proxy({"prices": PRICES})
    secret, _ = await p.ledger.create_key("tight", balance_micros=bound + 5)
    async with http.post(p.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {secret}"}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["x-token-notice"] == "max_output_tokens lowered to 5 to fit the balance"

    # The context check: SGLang's cap lowered, without asking the worker, to the room the bound leaves.
    worker = SimpleNamespace(max_model_len={MODEL: 10_000}, dialect="sglang", name="w")
    decision, sent = await check_context_window(None, worker, t.with_max_tokens(20_000), None,  # type: ignore[arg-type]
                                                bytes_per_token_floor=16)
    assert decision == "clamped" and sent.chat["max_tokens"] == 10_000 - bound


# --------------------------------------------------------------------------- the counter


async def test_the_counter_counts_on_a_worker_or_any_serving_one(sim):
    t = translate_request({"model": MODEL, "input": "hello there, how are you?"})
    w = Worker(name="s", url=sim.url, dialect="vllm", models=(MODEL,))
    async with aiohttp.ClientSession() as session:
        async with session.post(sim.url + "/tokenize", json={"model": MODEL, "messages": t.chat["messages"]}) as r:
            expected = (await r.json())["count"]
        counter = TokenCounter(session, WorkerPool([w]))
        assert await counter.prompt(t, w) == expected
        assert await counter.prompt(t, "s") == expected  # the worker that served it, by name
        assert await counter.prompt(t) == expected  # any available worker serving the model
        assert await counter.prompt(t, "gone") is None
        assert await counter.prompt(t._replace(upstream_model="other")) is None  # nobody serves it
        assert await counter.text(w, MODEL, "hello there, you") == 4  # hello , there , you: no template
        assert await counter.prompt(t, w) <= prompt_bound(t.chat).tokens
        dead = Worker(name="d", url="http://127.0.0.1:9", dialect="vllm", models=(MODEL,))
        assert await counter.prompt(t, dead) is None and await counter.text(dead, MODEL, "x") is None
    assert await TokenCounter(None).prompt(t, w) is None  # no session (yet, or any more)
    assert await counter.prompt(t, w) is None  # a closed session: None, not an error


def test_media_parts_count_their_size_as_sent():
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 1000}}
    size, media = prompt_bytes({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]})
    assert media and size == 2 + len(orjson.dumps(part))
