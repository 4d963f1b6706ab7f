"""The pass-through endpoints (proxy/http/passthrough_handler.py) in front of real vLLM 0.32 (CPU): a chat
completions stream, an embeddings call on a tiny BERT served by a second vLLM (`--runner pooling`)
and an Anthropic /v1/messages stream (vLLM's own), each billed exactly the upstream's usage x price
(the ledger's usage row, read by the request id the proxy answered with).

The tiny chat model answers every unconstrained prompt with reasoning "Let me think about it",
then "Hello! I am a tiny test model." (scripts/vllm_tier/build_tiny_model.py).
"""
from __future__ import annotations

import json
import uuid

import anthropic
import openai
import pytest
import requests

import servers
from proxy.ledger.pricing import Price, cost_micros
from tests.vllm.conftest import MODEL, PRICES, SCRIPTED_CONTENT

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PRICE = Price(PRICES["input"], PRICES["cached_input"], PRICES["output"])


def _openai(billed) -> openai.OpenAI:
    return openai.OpenAI(base_url=billed.info.base_url, api_key=billed.key, max_retries=0, timeout=300.0)


def _row(billed, request_id: str, endpoint: str) -> dict:
    rows = billed.rows(request_id)
    assert len(rows) == 1, (request_id, rows)
    row = rows[0]
    assert row["endpoint"] == endpoint and row["status"] == "completed", row
    assert row["debited_micros"] == row["cost_micros"], row
    return row


def _prompt(text: str) -> list[dict]:
    # A fresh prefix per run, so the figures do not depend on what an earlier test left cached.
    return [{"role": "user", "content": f"[{uuid.uuid4().hex}] {text}"}]


def test_chat_completions_stream_billed_exactly(proxy_billed):
    client = _openai(proxy_billed)
    messages = _prompt("Say hello.")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=64, stream=True, stream_options={"include_usage": True})
    request_id = raw.headers["x-request-id"]
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == SCRIPTED_CONTENT
    usage = chunks[-1].usage  # asked for: vLLM's usage chunk, passed on as it came
    assert usage is not None and not chunks[-1].choices
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
    row = _row(proxy_billed, request_id, "/v1/chat/completions")
    assert (row["input_tokens"], row["cached_tokens"], row["output_tokens"]) == \
        (usage.prompt_tokens, cached, usage.completion_tokens)
    assert row["cost_micros"] == cost_micros(PRICE, usage.prompt_tokens, cached, usage.completion_tokens)
    assert row["worker"] == "vllm-a" and row["served_model"] == MODEL

    # Not asked for: the proxy asks vLLM for the usage itself and keeps the usage chunk to itself;
    # the same prompt (the model is deterministic) is billed the same tokens.
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=64,
                                                           stream=True)
    again = list(raw.parse())
    assert all(c.usage is None for c in again) and all(c.choices for c in again)
    assert "".join(c.choices[0].delta.content or "" for c in again) == SCRIPTED_CONTENT
    second = _row(proxy_billed, raw.headers["x-request-id"], "/v1/chat/completions")
    assert (second["input_tokens"], second["output_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert 0 <= second["cached_tokens"] <= second["input_tokens"]
    assert second["cost_micros"] == cost_micros(PRICE, second["input_tokens"], second["cached_tokens"],
                                                second["output_tokens"])


def test_embeddings_billed_exactly(proxy_billed):
    inputs = ["hello world", "the weather in paris today", "one two three"]
    raw = _openai(proxy_billed).embeddings.with_raw_response.create(model=servers.EMBED_MODEL, input=inputs)
    answer = raw.parse()
    assert [d.index for d in answer.data] == [0, 1, 2]
    assert all(len(d.embedding) == 64 for d in answer.data)  # the tiny BERT's hidden size
    assert answer.model == servers.EMBED_MODEL
    # vLLM's own count: each input with its [CLS] and [SEP], as its /tokenize counts them
    worker = proxy_billed.info.workers["vllm-embed"].url
    counts = [servers.http_post_json(worker + "/tokenize", {"model": servers.EMBED_MODEL, "prompt": t})[1]["count"]
              for t in inputs]
    assert answer.usage.prompt_tokens == sum(counts)
    row = _row(proxy_billed, raw.headers["x-request-id"], "/v1/embeddings")
    assert (row["input_tokens"], row["cached_tokens"], row["output_tokens"]) == (answer.usage.prompt_tokens, 0, 0)
    assert row["cost_micros"] == cost_micros(PRICE, answer.usage.prompt_tokens, 0, 0)
    assert row["worker"] == "vllm-embed" and row["served_model"] == servers.EMBED_MODEL


def test_messages_stream_billed_exactly(proxy_billed):
    """vLLM's native /v1/messages, through the anthropic SDK's messages.stream with x-api-key."""
    client = anthropic.Anthropic(base_url=proxy_billed.info.url, api_key=proxy_billed.key, max_retries=0,
                                 timeout=300.0)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=_prompt("Say hello.")) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
        request_id = stream.response.headers["x-request-id"]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "".join(b.text for b in final.content if b.type == "text") == SCRIPTED_CONTENT
    assert final.stop_reason == "end_turn"
    u = final.usage  # message_start's and message_delta's, as vLLM sent them
    read, made = u.cache_read_input_tokens or 0, u.cache_creation_input_tokens or 0
    row = _row(proxy_billed, request_id, "/v1/messages")
    assert (row["input_tokens"], row["cached_tokens"], row["output_tokens"]) == \
        (u.input_tokens + read + made, read, u.output_tokens)
    assert row["cost_micros"] == cost_micros(PRICE, u.input_tokens + read + made, read, u.output_tokens)


def test_messages_stream_events_are_vllms_bytes(proxy_billed):
    """The event stream as vLLM wrote it: every event an Anthropic one, message_start's usage
    and message_delta's, and the row billed from them."""
    body = {"model": MODEL, "max_tokens": 64, "stream": True, "messages": _prompt("Say hello.")}
    with requests.post(proxy_billed.info.url + "/v1/messages", json=body, timeout=300.0, stream=True,
                       headers={"x-api-key": proxy_billed.key, "anthropic-version": "2023-06-01"}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(resp.iter_content(chunk_size=None))
        request_id = resp.headers["x-request-id"]
    events = [block.split(b"\n") for block in raw.strip().split(b"\n\n")]
    kinds = [e[0].removeprefix(b"event: ").decode() for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    data = [json.loads(e[1].removeprefix(b"data: ")) for e in events]
    assert [d["type"] for d in data] == kinds
    start, delta = data[0]["message"]["usage"], data[-2]["usage"]
    row = _row(proxy_billed, request_id, "/v1/messages")
    inp = delta.get("input_tokens", start["input_tokens"])
    read, made = delta.get("cache_read_input_tokens") or 0, delta.get("cache_creation_input_tokens") or 0
    assert (row["input_tokens"], row["output_tokens"]) == (inp + read + made, delta["output_tokens"])
    assert row["cost_micros"] == cost_micros(PRICE, inp + read + made, read, delta["output_tokens"])


def _billed_as_reported(billed, request_id: str, endpoint: str, prompt: int, cached: int, output: int) -> dict:
    row = _row(billed, request_id, endpoint)
    assert (row["input_tokens"], row["cached_tokens"], row["output_tokens"]) == (prompt, cached, output), row
    assert row["cost_micros"] == cost_micros(PRICE, prompt, cached, output)
    return row


def _cached(usage) -> int:
    return (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0


def test_two_caps_are_billed_as_vllm_takes_them(proxy_billed):
    """max_tokens 5 beside max_completion_tokens 64: vLLM reads max_completion_tokens; the edge
    holds for it and sends it as both, and bills what vLLM generated, past the 5."""
    raw = _openai(proxy_billed).chat.completions.with_raw_response.create(
        model=MODEL, messages=_prompt("Say hello."), max_tokens=5, max_completion_tokens=64)
    answer = raw.parse()
    u = answer.usage
    assert u.completion_tokens > 5 and answer.choices[0].finish_reason == "stop"
    _billed_as_reported(proxy_billed, raw.headers["x-request-id"], "/v1/chat/completions", u.prompt_tokens,
                        _cached(u), u.completion_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_a_completions_batch_is_billed_every_answer(proxy_billed, stream):
    prompts = [f"[{uuid.uuid4().hex}] Once upon a time {i}" for i in range(4)]
    client = _openai(proxy_billed)
    if not stream:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompts, max_tokens=12, seed=1)
        answer = raw.parse()
        assert len(answer.choices) == 4
        u = answer.usage
    else:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompts, max_tokens=12, seed=1,
                                                          stream=True, stream_options={"include_usage": True})
        chunks = list(raw.parse())
        assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2, 3}
        u = chunks[-1].usage
    assert u.completion_tokens > 12  # more than one answer's cap: every prompt was answered
    _billed_as_reported(proxy_billed, raw.headers["x-request-id"], "/v1/completions", u.prompt_tokens, _cached(u),
                        u.completion_tokens)


def test_logprobs_with_top_logprobs_are_billed_as_reported(proxy_billed):
    raw = _openai(proxy_billed).chat.completions.with_raw_response.create(
        model=MODEL, messages=_prompt("Say hello."), max_tokens=16, logprobs=True, top_logprobs=5)
    answer = raw.parse()
    assert answer.choices[0].logprobs is not None and answer.choices[0].logprobs.content
    assert len(answer.choices[0].logprobs.content[0].top_logprobs) == 5
    u = answer.usage
    _billed_as_reported(proxy_billed, raw.headers["x-request-id"], "/v1/chat/completions", u.prompt_tokens,
                        _cached(u), u.completion_tokens)


def test_a_thinking_messages_stream_is_whole_and_billed_as_reported(proxy_billed):
    """vLLM 0.32 streams the reasoning as thinking deltas closed by a signature_delta (no token):
    the stream is never cut for it, and is billed vLLM's usage."""
    client = anthropic.Anthropic(base_url=proxy_billed.info.url, api_key=proxy_billed.key, max_retries=0,
                                 timeout=300.0)
    with client.messages.stream(model=MODEL, max_tokens=2048, messages=_prompt("Say hello."),
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:  # vLLM: >= 1024
        events = [event for event in stream]
        final = stream.get_final_message()
        request_id = stream.response.headers["x-request-id"]
    assert [e.type for e in events][-1] == "message_stop"
    assert any(b.type == "thinking" for b in final.content), final.content
    assert "".join(b.text for b in final.content if b.type == "text") == SCRIPTED_CONTENT
    u = final.usage
    read, made = u.cache_read_input_tokens or 0, u.cache_creation_input_tokens or 0
    _billed_as_reported(proxy_billed, request_id, "/v1/messages", u.input_tokens + read + made, read, u.output_tokens)
