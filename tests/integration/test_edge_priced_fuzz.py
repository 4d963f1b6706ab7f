"""The money invariants over every pass-through endpoint with hostile bodies: random mixes of the
fields that cost (two caps, n, best_of, beam search, batches of prompts and inputs, roles, names,
documents, template arguments, logprobs, ignore_eos, min_tokens, extensions, unknown fields)
against the fake upstream that does what vLLM does with each (tests/support/vllm_rules_upstream.py).

For every body: a 4xx in the endpoint's envelope with nothing sent upstream and nothing billed,
or an answer whose bill is exactly the work the worker reported (usage x price, the usage the
client sees), each debit within its own hold; and after all of them, balance drop == debits,
no hold left."""

from __future__ import annotations

import random

import orjson
import pytest

from middlewares.balance import wait_for_settlements
from tests.conftest import free_port
from tests.integration.test_money import record_holds
from tests.support.vllm_rules_upstream import VLLMRules

MODEL = "tiny-model"
PRICES = {"prices": {"default": {"input": 1_000_000, "output": 1_000_000}}}
BALANCE = 3_000_000


def _maybe(rng: random.Random, body: dict, name: str, *values) -> None:
    if rng.random() < 0.35:
        body[name] = rng.choice(values)


def _common(rng: random.Random, body: dict) -> None:
    _maybe(rng, body, "stream", True, False, None)
    _maybe(rng, body, "ignore_eos", True, False)
    _maybe(rng, body, "min_tokens", 0, 3, 50, -1)
    _maybe(rng, body, "temperature", 0.0, 1.5)
    _maybe(rng, body, "colour", "red")  # unknown: never forwarded
    _maybe(rng, body, rng.choice(["prompt_logprobs", "priority", "request_id", "echo", "vllm_xargs"]),
           5, True, "x", {"a": 1}, None)


def _chat(rng: random.Random) -> tuple[str, dict]:
    role = rng.choice(["user", "system", "assistant", "tool", "ipython", " ".join(["role"] * rng.randint(1, 3000))])
    msgs = [{"role": role, "content": "hello " * rng.randint(0, 200)}]
    if rng.random() < 0.2:
        msgs[0]["name"] = "n " * rng.randint(1, 500)
    body: dict = {"model": MODEL, "messages": msgs}
    _maybe(rng, body, "max_tokens", 1, 5, 40, 700, None, 0, "ten")
    _maybe(rng, body, "max_completion_tokens", 1, 7, 300, 2000, None)
    _maybe(rng, body, "n", 1, 2, 4, 17, 0)
    _maybe(rng, body, "use_beam_search", True, False)
    _maybe(rng, body, "logprobs", True, False)
    _maybe(rng, body, "top_logprobs", 0, 5, 20, 21)
    _maybe(rng, body, "documents", [{"text": "doc " * rng.randint(1, 2000)}])
    _maybe(rng, body, "chat_template_kwargs", {"enable_thinking": True, "pad": "k " * rng.randint(1, 1000)})
    _maybe(rng, body, "stream_options", {"include_usage": True}, {"continuous_usage_stats": True}, None)
    _common(rng, body)
    return "/v1/chat/completions", body


def _completions(rng: random.Random) -> tuple[str, dict]:
    prompt = rng.choice(["once upon " * rng.randint(1, 100), [f"p{i} x" for i in range(rng.randint(1, 40))],
                         list(range(rng.randint(1, 50))), [[1, 2, 3]] * rng.randint(1, 10)])
    body: dict = {"model": MODEL, "prompt": prompt}
    _maybe(rng, body, "max_tokens", 1, 16, 200, 3000, None)
    _maybe(rng, body, "n", 1, 3, 17)
    _maybe(rng, body, "best_of", 1, 4, 2)
    _maybe(rng, body, "logprobs", 0, 5, 20, 21)
    _maybe(rng, body, "suffix", "s " * rng.randint(1, 300))
    _common(rng, body)
    return "/v1/completions", body


def _messages(rng: random.Random) -> tuple[str, dict]:
    body: dict = {"model": MODEL, "messages": [{"role": rng.choice(["user", "assistant", "x" * 2000]),
                                                "content": "hi " * rng.randint(0, 300)}],
                  "max_tokens": rng.choice([1, 12, 500, 4000])}
    _maybe(rng, body, "system", "sys " * rng.randint(1, 500), [{"type": "text", "text": "s " * 100}])
    _maybe(rng, body, "stream", True, False)
    _maybe(rng, body, "ignore_eos", True)  # not an Anthropic field: unknown, not forwarded
    _maybe(rng, body, "chat_template_kwargs", {"pad": "k " * rng.randint(1, 500)})
    _maybe(rng, body, "kv_transfer_params", {"x": 1})
    return "/v1/messages", body


def _embeddings(rng: random.Random) -> tuple[str, dict]:
    body: dict = {"model": MODEL, "input": rng.choice(["text " * rng.randint(1, 300),
                                                       [f"in {i}" for i in range(rng.randint(1, 40))],
                                                       [[1, 2, 3, 4]] * rng.randint(1, 5)])}
    _maybe(rng, body, "dimensions", 2, 8)
    _maybe(rng, body, "priority", 3)
    _maybe(rng, body, "stream", True)
    _maybe(rng, body, "messages", [{"role": "user", "content": "not an embedding input here"}])  # unknown: dropped
    return "/v1/embeddings", body


@pytest.fixture
async def rules():
    server = VLLMRules(words=25)
    await server.start(free_port())
    yield server
    await server.stop()


@pytest.mark.parametrize("seed", range(4))
async def test_hostile_bodies_are_billed_exactly_the_work_within_their_holds(make_proxy, rules, http, monkeypatch,
                                                                             seed):
    holds = record_holds(monkeypatch)
    proxy = await make_proxy({**PRICES, "endpoints": {"max_choices": 8, "max_batch_inputs": 32}},
                             workers=[{"name": "v", "url": rules.url, "dialect": "vllm", "models": [MODEL]}])
    secret, record = await proxy.ledger.create_key("fuzz", balance_micros=BALANCE)
    rng = random.Random(seed)
    answered = refused = 0
    for _ in range(30):
        path, body = rng.choice([_chat, _chat, _completions, _messages, _embeddings])(rng)
        sent_before, generated_before, prompt_before = len(rules.requests), rules.generated, rules.prompt_tokens
        headers = {"x-api-key": secret} if path == "/v1/messages" else {"Authorization": f"Bearer {secret}"}
        async with http.post(proxy.url + path, json=body, headers=headers) as resp:
            raw = await resp.read()
        await wait_for_settlements(proxy.app)
        rows = await proxy.ledger.list_usage(record.key_id, limit=1000)
        if 400 <= resp.status < 500:
            refused += 1
            error = orjson.loads(raw)
            assert ("error" in error and error.get("type") == "error") if path == "/v1/messages" \
                else set(error["error"]) == {"message", "type", "param", "code"}, raw[:300]
            assert len(rules.requests) == sent_before, (body, raw[:300])  # nothing reached the worker
            assert len(rows) == answered  # nothing billed
            continue
        # 502: an answer past the read limit (16 MiB; a window's worth of ignore_eos x answers):
        # the work was done, and is billed all the same, from the usage at its end
        too_large = resp.status == 502 and b"larger than" in raw
        assert resp.status == 200 or too_large, (resp.status, raw[:300], body)
        answered += 1
        sent = rules.requests[-1]
        assert "colour" not in sent and "ignore_eos" not in sent or path != "/v1/messages"
        row = max(rows, key=lambda r: r.created_at)
        assert row.output_tokens == rules.generated - generated_before, (body, row)
        assert row.input_tokens == rules.prompt_tokens - prompt_before, (body, row)
        assert row.cost_micros == row.input_tokens + row.output_tokens <= holds[row.request_id], (body, row)
        if not body.get("stream") and path != "/v1/embeddings" and not too_large:
            usage = orjson.loads(raw)["usage"]
            shown = usage.get("completion_tokens", usage.get("output_tokens"))
            assert shown == row.output_tokens
    key = await proxy.ledger.get_key(record.key_id)
    rows = await proxy.ledger.list_usage(record.key_id, limit=1000)
    assert BALANCE - key.balance_micros == sum(r.debited_micros for r in rows)
    assert await proxy.ledger.holds(record.key_id) == []
    assert answered >= 5 and refused >= 3, (answered, refused)
