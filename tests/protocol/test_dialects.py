"""What each model server expects of a replayed conversation and of the thinking switch
(proxy/protocol/dialects.py): vLLM 0.32 reads an assistant's reasoning from `reasoning` (its /tokenize
ignores `reasoning_content`), SGLang from `reasoning_content`; the chat-template kwarg is
named per worker (`thinking_switch`)."""

from __future__ import annotations

import copy

import aiohttp
import pytest

from proxy.config.load import Config, ConfigError
from proxy.protocol.dialects import chat_for, messages_for
from proxy.simulator.server import Simulator
from tests.conftest import only

MODEL = "tiny-org/tiny-model"
REPLAY = [
    {"type": "message", "role": "user", "content": "What is 17 * 23? Show the steps."},
    {"type": "reasoning", "summary": [],
     "content": [{"type": "reasoning_text", "text": "17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391. " * 8}]},
    {"type": "message", "role": "assistant", "content": "391"},
    {"type": "message", "role": "user", "content": "And 17 * 24?"},
]


def test_vllm_reads_reasoning_sglang_reasoning_content():
    chat = {"messages": [{"role": "user", "content": "u"},
                         {"role": "assistant", "content": "a", "reasoning_content": "r"}], "model": "m"}
    before = copy.deepcopy(chat)
    vllm = chat_for(chat, "vllm")
    assert vllm["messages"][1] == {"role": "assistant", "content": "a", "reasoning": "r"}
    assert vllm["messages"][0] is chat["messages"][0]
    assert chat == before  # never mutated: the translation is shared by every attempt
    assert chat_for(chat, "sglang") is chat
    plain = {"messages": [{"role": "user", "content": "u"}]}
    assert chat_for(plain, "vllm") is plain  # nothing to adapt: no copy
    assert messages_for(plain["messages"], "vllm") is plain["messages"]


@pytest.mark.parametrize("switch, want", [
    ("enable_thinking", {"enable_thinking": False}),
    ("thinking", {"thinking": False}),
    ("none", None),
])
def test_thinking_switch_is_named_per_worker(switch, want):
    chat = {"messages": [], "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False}}
    out = chat_for(chat, "sglang", switch)
    assert out.get("chat_template_kwargs") == want
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}


def test_bad_thinking_switch_stops_start_up():
    with pytest.raises(ConfigError, match=r"workers\[0\]\.thinking_switch"):
        Config.from_dict({"workers": [{"name": "a", "url": "http://127.0.0.1:1", "thinking_switch": "think"}]})


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_input_tokens_of_a_replay_counts_its_reasoning(make_proxy, dialect):
    """input_tokens (the worker's /tokenize) must agree with what the chat endpoint bills for
    the same replayed conversation, reasoning included (vLLM 0.32: 56 vs 93 before)."""
    async with Simulator(dialect=dialect) as sim:
        proxy = await make_proxy(only(), workers=[{"name": "w", "url": sim.url, "dialect": dialect,
                                                              "models": [MODEL]}])
        client = proxy.openai()
        counted = await client.responses.input_tokens.count(model=MODEL, input=REPLAY)
        sim.script({"text": "408"})
        answered = await client.responses.create(model=MODEL, input=REPLAY)
        assert counted.input_tokens == answered.usage.input_tokens
        without = await client.responses.input_tokens.count(model=MODEL, input=[REPLAY[0], REPLAY[2], REPLAY[3]])
        assert counted.input_tokens > without.input_tokens + 50  # the reasoning is in the count


async def test_the_worker_receives_its_dialects_fields(make_proxy):
    async with Simulator(dialect="vllm") as sim:
        proxy = await make_proxy(only(), workers=[{"name": "w", "url": sim.url, "dialect": "vllm",
                                                              "models": [MODEL], "thinking_switch": "thinking"}])
        sim.script({"text": "ok"})
        await proxy.openai().responses.create(model=MODEL, input=REPLAY, reasoning={"effort": "none"})
        async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/requests") as r:
            sent = (await r.json())[-1]
    assistant = [m for m in sent["messages"] if m["role"] == "assistant"][0]
    assert "reasoning" in assistant and "reasoning_content" not in assistant
    assert sent["chat_template_kwargs"] == {"thinking": False}
