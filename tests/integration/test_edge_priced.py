"""Priced is what runs: the attacks on the pass-through endpoints, each against a fake upstream
that does what vLLM 0.32 does with the field (tests/support/vllm_rules_upstream.py), judged by what it
generated. Every request's bill is the worker's work (x the price), never more than its hold,
and a body field the edge did not price never reaches the worker.
"""

from __future__ import annotations

import orjson
import pytest

from middlewares.balance import wait_for_settlements
from tests.conftest import free_port
from tests.integration.test_money import record_holds
from tests.support.vllm_rules_upstream import VLLMRules

MODEL = "tiny-model"
PRICES = {"prices": {"default": {"input": 1_000_000, "output": 1_000_000}}}  # 1 micro per token
MSGS = [{"role": "user", "content": "Hi there"}]


@pytest.fixture
async def rules():
    server = VLLMRules()
    await server.start(free_port())
    yield server
    await server.stop()


@pytest.fixture
def holds(monkeypatch) -> dict[str, int]:
    return record_holds(monkeypatch)


async def _proxy(make_proxy, rules, extra: dict | None = None, workers: int = 1):
    ws = [{"name": f"w{i}", "url": rules.url, "dialect": "vllm", "models": [MODEL],
           "timeouts": {"connect": 2, "first_byte": 30, "idle": 30, "total": 60}} for i in range(workers)]
    return await make_proxy({**PRICES, **(extra or {})}, workers=ws)


async def _rows(proxy, key_id: str) -> list:
    await wait_for_settlements(proxy.app)
    return [r for r in await proxy.ledger.list_usage() if r.key_id == key_id]


async def _audit(proxy, key_id: str, balance: int, holds: dict[str, int]) -> list:
    """balance drop == debits <= holds; nothing left held."""
    rows = await _rows(proxy, key_id)
    key = await proxy.ledger.get_key(key_id)
    assert sum(r.debited_micros for r in rows) == balance - key.balance_micros
    assert key.balance_micros >= 0
    for row in rows:
        assert row.cost_micros <= holds[row.request_id], (row, holds[row.request_id])
    assert await proxy.ledger.holds(key_id) == []
    return rows


async def _post(http, proxy, secret: str, path: str, body: dict) -> tuple[int, bytes, dict]:
    async with http.post(proxy.url + path, json=body, headers={"Authorization": f"Bearer {secret}"}) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


@pytest.mark.parametrize("stream", [False, True])
async def test_two_caps_are_one_cap_sent_as_both_fields(make_proxy, rules, http, holds, stream):
    """max_tokens 5 + max_completion_tokens 2000: vLLM generates 2000; the edge holds, sends and bills 2000."""
    rules.words = 5000
    proxy = await _proxy(make_proxy, rules)
    secret, record = await proxy.ledger.create_key("k", balance_micros=1_000_000)
    status, raw, _ = await _post(http, proxy, secret, "/v1/chat/completions",
                                 {"model": MODEL, "messages": MSGS, "max_tokens": 5, "max_completion_tokens": 2000,
                                  "stream": stream})
    assert status == 200, raw[:300]
    sent = rules.requests[-1]
    assert sent["max_tokens"] == sent["max_completion_tokens"] == 2000
    rows = await _audit(proxy, record.key_id, 1_000_000, holds)
    assert [r.output_tokens for r in rows] == [rules.generated] == [2000]


@pytest.mark.parametrize("stream", [False, True])
async def test_two_caps_on_a_low_balance_are_both_lowered(make_proxy, rules, http, holds, stream):
    rules.words = 5000
    proxy = await _proxy(make_proxy, rules)
    secret, record = await proxy.ledger.create_key("k", balance_micros=1_000)
    status, raw, headers = await _post(http, proxy, secret, "/v1/chat/completions",
                                       {"model": MODEL, "messages": MSGS, "max_tokens": 5,
                                        "max_completion_tokens": 2000, "stream": stream})
    assert status == 200, raw[:300]
    sent = rules.requests[-1]
    assert sent["max_tokens"] == sent["max_completion_tokens"] < 1_000
    assert "lowered" in headers.get("x-token-notice", "")
    rows = await _audit(proxy, record.key_id, 1_000, holds)
    assert rows[0].output_tokens == rules.generated == sent["max_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_batch_of_prompts_is_held_and_billed_for_every_answer(make_proxy, rules, http, holds, stream):
    rules.words = 1000
    proxy = await _proxy(make_proxy, rules)
    secret, record = await proxy.ledger.create_key("k", balance_micros=1_000_000)
    status, raw, _ = await _post(http, proxy, secret, "/v1/completions",
                                 {"model": MODEL, "prompt": [f"prompt number {i}" for i in range(64)],
                                  "max_tokens": 100, "stream": stream})
    assert status == 200, raw[:300]
    rows = await _audit(proxy, record.key_id, 1_000_000, holds)
    assert rules.generated == 6400 and rows[0].output_tokens == 6400
    assert rows[0].input_tokens == rules.prompt_tokens


async def test_a_batch_on_a_low_balance_gets_a_cap_per_answer_the_balance_covers(make_proxy, rules, http, holds):
    rules.words = 1000
    proxy = await _proxy(make_proxy, rules)
    secret, record = await proxy.ledger.create_key("k", balance_micros=3_000)
    status, raw, _ = await _post(http, proxy, secret, "/v1/completions",
                                 {"model": MODEL, "prompt": [f"p {i}" for i in range(10)], "max_tokens": 1000,
                                  "n": 2})
    assert status == 200, raw[:300]
    cap = rules.requests[-1]["max_tokens"]
    assert 1 <= cap < 150
    rows = await _audit(proxy, record.key_id, 3_000, holds)
    assert rules.generated == 20 * cap == rows[0].output_tokens


async def test_choices_and_batches_above_their_bounds_are_refused(make_proxy, rules, http):
    proxy = await _proxy(make_proxy, rules, {"endpoints": {"max_choices": 4, "max_batch_inputs": 8}})
    for path, body, param in (
            ("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "n": 5}, "n"),
            ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 9}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": "a", "best_of": 5}, "best_of"),
            ("/v1/embeddings", {"model": MODEL, "input": ["a"] * 9}, "input")):
        status, raw, _ = await _post(http, proxy, proxy.api_key, path, body)
        assert status == 400 and orjson.loads(raw)["error"]["param"] == param, raw
    assert rules.requests == []


async def test_an_answer_too_large_to_read_is_billed_and_not_retried(make_proxy, rules, http, holds, monkeypatch):
    """logprobs x top_logprobs x ignore_eos make an answer past the read limit: the worker did the
    work, so it is billed (its cap, within the hold), and no second worker is asked to do it again."""
    from proxy.upstream import exchange as upstream_open

    monkeypatch.setattr(upstream_open, "MAX_JSON_BODY", 1024 * 1024)
    proxy = await _proxy(make_proxy, rules, workers=2)
    secret, record = await proxy.ledger.create_key("k", balance_micros=1_000_000)
    status, raw, _ = await _post(http, proxy, secret, "/v1/chat/completions",
                                 {"model": MODEL, "messages": MSGS, "logprobs": True, "top_logprobs": 20,
                                  "ignore_eos": True, "max_tokens": 2000})
    assert status == 502, raw[:300]
    assert len(rules.requests) == 1  # not retried on the second worker
    rows = await _audit(proxy, record.key_id, 1_000_000, holds)
    assert rows[0].output_tokens == rules.generated == 2000 and rows[0].cost_micros > 2000


async def test_a_role_is_prompt(make_proxy, rules, http, holds):
    """vLLM renders any role string: a 90,000-word role is 90,000 prompt tokens, billed as such."""
    proxy = await _proxy(make_proxy, rules)
    secret, record = await proxy.ledger.create_key("k", balance_micros=10_000_000)
    role = " ".join(["r"] * 90_000)
    status, raw, _ = await _post(http, proxy, secret, "/v1/chat/completions",
                                 {"model": MODEL, "messages": [{"role": role, "content": "hi"}], "max_tokens": 5})
    assert status == 200, raw[:300]
    rows = await _audit(proxy, record.key_id, 10_000_000, holds)
    assert rows[0].input_tokens == rules.prompt_tokens > 90_000


async def test_documents_and_template_arguments_are_prompt(make_proxy, rules, http, holds):
    proxy = await _proxy(make_proxy, rules)
    secret, record = await proxy.ledger.create_key("k", balance_micros=10_000_000)
    docs = [{"title": "t", "text": " ".join(["d"] * 20_000)}]
    status, raw, _ = await _post(http, proxy, secret, "/v1/chat/completions",
                                 {"model": MODEL, "messages": MSGS, "documents": docs, "max_tokens": 5,
                                  "chat_template_kwargs": {"note": " ".join(["k"] * 5_000)}})
    assert status == 200, raw[:300]
    rows = await _audit(proxy, record.key_id, 10_000_000, holds)
    assert rows[0].input_tokens == rules.prompt_tokens > 25_000


@pytest.mark.parametrize("field,value", [("prompt_logprobs", 20), ("chat_template", "{% for i in range(9) %}x{% endfor %}"),
                                         ("priority", -100), ("request_id", "someone-elses"),
                                         ("kv_transfer_params", {"do_remote_prefill": True}), ("echo", True)])
async def test_extensions_no_hold_bounds_are_refused_naming_them(make_proxy, rules, http, field, value):
    proxy = await _proxy(make_proxy, rules)
    status, raw, _ = await _post(http, proxy, proxy.api_key, "/v1/chat/completions",
                                 {"model": MODEL, "messages": MSGS, field: value})
    error = orjson.loads(raw)["error"]
    assert status == 400 and error["param"] == field and "allowed_extensions" in error["message"]
    assert rules.requests == []


async def test_an_operator_may_allow_an_extension(make_proxy, rules, http):
    proxy = await _proxy(make_proxy, rules, {"endpoints": {"allowed_extensions": ["priority"]}})
    status, raw, _ = await _post(http, proxy, proxy.api_key, "/v1/chat/completions",
                                 {"model": MODEL, "messages": MSGS, "priority": -5, "max_tokens": 3})
    assert status == 200, raw
    assert rules.requests[-1]["priority"] == -5


async def test_unknown_fields_are_not_forwarded_and_are_named(make_proxy, rules, http):
    proxy = await _proxy(make_proxy, rules)
    status, raw, headers = await _post(http, proxy, proxy.api_key, "/v1/chat/completions",
                                       {"model": MODEL, "messages": MSGS, "max_tokens": 3, "colour": "red",
                                        "store": True, "temperature": 0.2})
    assert status == 200, raw
    sent = rules.requests[-1]
    assert "colour" not in sent and "store" not in sent and sent["temperature"] == 0.2
    assert "unknown field(s) ignored: colour" in headers["x-token-notice"]


async def test_a_completion_without_a_cap_gets_vllms_default_not_the_balance(make_proxy, rules, http, holds):
    """vLLM's CompletionRequest.max_tokens is 16: on a low balance the edge sends 16, not what the
    balance covers, and says nothing was lowered."""
    rules.words = 1000
    proxy = await _proxy(make_proxy, rules)
    secret, record = await proxy.ledger.create_key("k", balance_micros=2_000)
    status, raw, headers = await _post(http, proxy, secret, "/v1/completions", {"model": MODEL, "prompt": "Once"})
    assert status == 200, raw
    assert rules.requests[-1]["max_tokens"] == 16 and "lowered" not in headers.get("x-token-notice", "")
    rows = await _audit(proxy, record.key_id, 2_000, holds)
    assert rows[0].output_tokens == rules.generated == 16


async def test_stream_usage_with_spaces_is_billed(make_proxy, rules, http, holds):
    rules.usage_spaces = True
    proxy = await _proxy(make_proxy, rules)
    secret, record = await proxy.ledger.create_key("k", balance_micros=100_000)
    status, raw, _ = await _post(http, proxy, secret, "/v1/chat/completions",
                                 {"model": MODEL, "messages": MSGS, "max_tokens": 50, "stream": True})
    assert status == 200 and b'"usage"' not in raw  # the client did not ask for it
    rows = await _audit(proxy, record.key_id, 100_000, holds)
    assert rows[0].output_tokens == rules.generated == 30 and rows[0].input_tokens == rules.prompt_tokens


async def test_continuous_usage_without_include_usage_shows_no_usage(make_proxy, rules, http):
    proxy = await _proxy(make_proxy, rules)
    status, raw, _ = await _post(http, proxy, proxy.api_key, "/v1/chat/completions",
                                 {"model": MODEL, "messages": MSGS, "max_tokens": 5, "stream": True,
                                  "stream_options": {"continuous_usage_stats": True}})
    assert status == 200 and b'"usage"' not in raw
    assert rules.requests[-1]["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_thinking_messages_stream_is_billed_as_vllm_reports(make_proxy, rules, http, holds, stream):
    """vLLM closes a thinking block with a signature_delta: no token; within max_tokens, never cut."""
    proxy = await _proxy(make_proxy, rules)
    secret, record = await proxy.ledger.create_key("k", balance_micros=100_000)
    async with http.post(proxy.url + "/v1/messages", headers={"x-api-key": secret},
                         json={"model": MODEL, "messages": MSGS, "max_tokens": 12, "stream": stream,
                               "thinking": {"type": "enabled", "budget_tokens": 6}, "ignore_eos": True}) as resp:
        raw = await resp.read()
    assert resp.status == 200, raw
    assert b"event: error" not in raw and (not stream or raw.count(b'"text_delta"') == 6)
    rows = await _audit(proxy, record.key_id, 100_000, holds)
    assert rows[0].output_tokens == rules.generated == 12 and rows[0].status == "completed"


async def test_done_inside_model_text_does_not_end_the_stream(make_proxy, sim, http):
    proxy = await make_proxy(PRICES)
    text = "a data: [DONE]\n\n b " + "word " * 20
    # one delta holding the whole text, the chunks after it paced into reads of their own
    sim.script({"text": text, "chunk_chars": 15, "delay": 0.005})
    status, raw, _ = await _post(http, proxy, proxy.api_key, "/v1/chat/completions",
                                 {"model": "tiny-org/tiny-model", "messages": MSGS, "stream": True, "max_tokens": 200})
    chunks = [orjson.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    got = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert got == text and any(c["choices"][0].get("finish_reason") for c in chunks if c.get("choices"))
    assert raw.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("usage", [None, {"prompt_tokens": -1, "completion_tokens": -3},
                                   {"prompt_tokens": 2**62, "completion_tokens": 2**62},
                                   {"prompt_tokens": "5", "completion_tokens": "lots"},
                                   {"prompt_tokens": 5.5, "completion_tokens": 30.5}],
                         ids=["missing", "negative", "huge", "string", "float"])
async def test_a_json_answer_with_unreadable_usage_is_counted(make_proxy, sim, http, holds, usage):
    """As /v1/responses counts it: the worker's tokenizer on the prompt and on what was written."""
    proxy = await make_proxy(PRICES)
    secret, record = await proxy.ledger.create_key("k", balance_micros=100_000)
    words = " ".join(f"w{i}" for i in range(30))
    sim.script({"text": words, **({"usage": False} if usage is None else {"usage_override": usage})})
    status, raw, _ = await _post(http, proxy, secret, "/v1/chat/completions",
                                 {"model": "tiny-org/tiny-model", "messages": MSGS, "max_tokens": 200})
    assert status == 200, raw
    rows = await _audit(proxy, record.key_id, 100_000, holds)
    assert rows[0].output_tokens >= 30 and rows[0].input_tokens > 0


async def test_a_failed_pass_through_stream_ends_in_the_openai_error_shape(make_proxy, sim, http):
    proxy = await make_proxy(PRICES, workers=[{"name": "sim", "url": sim.url, "dialect": "vllm",
                                               "models": ["tiny-org/tiny-model"], "timeouts": {"idle": 0.5}}])
    sim.script({"text_words": 10, "drop_after": 2})
    status, raw, _ = await _post(http, proxy, proxy.api_key, "/v1/chat/completions",
                                 {"model": "tiny-org/tiny-model", "messages": MSGS, "stream": True})
    error = next(orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b'data: {"error"'))["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["code"], str)


async def test_a_responses_answer_too_large_to_read_is_billed_and_not_retried(make_proxy, rules, http, holds,
                                                                              monkeypatch):
    """The same opening serves /v1/responses: its answer past the read limit is billed too."""
    from proxy.upstream import exchange as upstream_open

    monkeypatch.setattr(upstream_open, "MAX_JSON_BODY", 64 * 1024)
    rules.words = 100_000
    proxy = await _proxy(make_proxy, rules, workers=2)
    secret, record = await proxy.ledger.create_key("k", balance_micros=1_000_000)
    status, raw, _ = await _post(http, proxy, secret, "/v1/responses",
                                 {"model": MODEL, "input": "Hi", "max_output_tokens": 30_000})
    assert status == 502, raw[:300]
    assert len(rules.requests) == 1
    rows = await _audit(proxy, record.key_id, 1_000_000, holds)
    assert rows[0].output_tokens == rules.generated == 30_000


async def test_the_fingerprint_stays_on_the_chunk_vllm_puts_it_on(make_proxy, sim, http):
    """Asked no usage, vLLM stamps system_fingerprint on the terminal chunk; the edge asks for the
    usage chunk (which then carries it) and keeps that chunk to itself: the fingerprint goes back
    on the terminal chunk, where the client would have found it, and nowhere else."""
    proxy = await make_proxy(PRICES)
    sim.script({"text": "one two three"})
    status, raw, _ = await _post(http, proxy, proxy.api_key, "/v1/chat/completions",
                                 {"model": "tiny-org/tiny-model", "messages": MSGS, "stream": True, "max_tokens": 20})
    chunks = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert status == 200 and all(c["choices"] and "usage" not in c for c in chunks)
    stamped = [c for c in chunks if "system_fingerprint" in c]
    assert len(stamped) == 1 and stamped[0] is chunks[-1] and chunks[-1]["choices"][0]["finish_reason"]
    assert stamped[0]["system_fingerprint"] == sim.state.fingerprint


async def test_a_batch_whose_prompts_each_fit_the_window_is_not_refused_for_their_sum(make_proxy, http):
    from proxy.simulator.server import Simulator

    async with Simulator(max_model_len=512) as small:
        proxy = await make_proxy(PRICES, workers=[{"name": "small", "url": small.url, "dialect": "vllm",
                                                   "models": ["tiny-org/tiny-model"]}])
        prompts = ["word " * 100] * 8  # 100 tokens each, 800 together: each fits a 512 window
        status, raw, _ = await _post(http, proxy, proxy.api_key, "/v1/completions",
                                     {"model": "tiny-org/tiny-model", "prompt": prompts, "max_tokens": 10})
        assert status == 200, raw[:300]


@pytest.mark.parametrize("path,extra", [("/v1/responses", {"input": "Hi"}), ("/v1/chat/completions", {"messages": MSGS}),
                                        ("/v1/completions", {"prompt": "Hi"}), ("/v1/embeddings", {"input": "Hi"}),
                                        ("/v1/messages", {"messages": MSGS, "max_tokens": 5})])
@pytest.mark.parametrize("model", ["A" * 4_000_000 + "/tiny-model", "\u0000/tiny-model", "tiny\nmodel",
                                   "é" * 129 + "/tiny-model"], ids=["4MB", "nul", "newline", "257-bytes"])
async def test_a_model_alias_is_bounded_printable_text(make_proxy, rules, http, path, extra, model):
    """It is stored in every usage row and access line: at most 256 bytes of printable UTF-8."""
    proxy = await _proxy(make_proxy, rules)
    secret, record = await proxy.ledger.create_key("k", balance_micros=100_000)
    status, raw, _ = await _post(http, proxy, secret, path, {"model": model, **extra})
    assert status == 400, raw[:300]
    error = orjson.loads(raw)["error"]
    assert (error.get("param") == "model") if path != "/v1/messages" else "model" in error["message"], error
    assert len(raw) < 2000 and rules.requests == []
    assert await _rows(proxy, record.key_id) == []
