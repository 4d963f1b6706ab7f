"""Two real vLLM workers behind one proxy: prompt-cache affinity, then failover when one dies.

Runs after test_responses.py (file order); the failover test kills worker vllm-b, so it stays last.
"""
from __future__ import annotations

import uuid

import pytest

import servers
from tests.vllm.conftest import MODEL, SCRIPTED_CONTENT

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _served_counts(proxy_pair) -> dict[str, float]:
    """Finished requests per worker, read from each vLLM's /metrics."""
    counts = {}
    for name, proc in proxy_pair.workers.items():
        if not proc.alive():
            continue
        status, body = servers.http_get(proc.url + "/metrics", timeout=10)
        assert status == 200
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith("vllm:request_success_total"):
                total += float(line.rsplit(" ", 1)[1])
        counts[name] = total
    return counts


def test_pair_serves_requests(proxy_pair):
    client = proxy_pair.client()
    before = _served_counts(proxy_pair)
    for i in range(4):
        resp = client.responses.create(model=MODEL, input=f"Question {i}?", max_output_tokens=32)
        assert resp.status == "completed"
        assert SCRIPTED_CONTENT in resp.output_text
    after = _served_counts(proxy_pair)
    served = {name: after[name] - before[name] for name in after}
    assert sum(served.values()) == 4, served
    print(f"requests per worker: {served}")


def test_prompt_cache_key_affinity(proxy_pair):
    """The same prompt_cache_key goes back to the worker that holds the prefix: every repeat is cached."""
    client = proxy_pair.client()
    salt = uuid.uuid4().hex
    instructions = f"Session {salt}. " + " ".join(
        f"Rule {i}: answer questions about the weather in city number {i} politely." for i in range(40))
    key = f"conv-{salt}"
    first = client.responses.create(model=MODEL, instructions=instructions, input="hi", max_output_tokens=8,
                                    prompt_cache_key=key)
    assert first.usage.input_tokens > 256
    cached = []
    for _ in range(4):
        resp = client.responses.create(model=MODEL, instructions=instructions, input="hi", max_output_tokens=8,
                                       prompt_cache_key=key)
        cached.append(resp.usage.input_tokens_details.cached_tokens)
    assert all(c > 0 for c in cached), f"cached_tokens per repeat: {cached} (repeats left the worker)"


def test_failover_when_a_worker_is_killed(proxy_pair):
    client = proxy_pair.client()
    resp = client.responses.create(model=MODEL, input="before", max_output_tokens=32)
    assert resp.status == "completed"

    victim = proxy_pair.workers["vllm-b"]
    servers.kill_hard(victim)
    assert not victim.alive()

    # Right away (before any health check noticed), then for a while: every request succeeds.
    for i in range(6):
        resp = client.responses.create(model=MODEL, input=f"after {i}", max_output_tokens=32)
        assert resp.status == "completed", resp.model_dump_json(indent=1)
        assert SCRIPTED_CONTENT in resp.output_text
    with client.responses.stream(model=MODEL, input="streamed after", max_output_tokens=32) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed"
    counted = client.responses.input_tokens.count(model=MODEL, input="still counting?")
    assert counted.input_tokens > 0
    status, _ = servers.http_get(proxy_pair.url + "/healthz")
    assert status == 200
