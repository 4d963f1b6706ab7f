"""Two real vLLM workers behind one proxy: prompt-cache affinity (against a second proxy with
affinity off on the same workers), then failover when one dies.

Runs after test_responses.py (file order); the failover test kills worker vllm-b, so it stays last.
"""
from __future__ import annotations

import time
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


def _system_prompt(salt: str) -> str:
    # ~620 tokens of the tiny model's BPE (a rule is ~24 tokens, the salt ~40), distinct per conversation
    # from its first block on, so no conversation finds another's prefix.
    return f"Session {salt}. " + " ".join(
        f"Rule {i}: answer questions about the weather in city number {i} politely." for i in range(24))


def _turn(salt: str, turn: int) -> str:
    # ~150 tokens per user turn (a note is ~18 tokens): six turns stay near 1,550 tokens, under the
    # 2,048 window, and every turn adds more than one 128-token block.
    return f"Turn {turn} of {salt[:6]}. " + " ".join(
        f"Note {j}: the temperature in city {j + turn} is {turn * 7 + j} degrees today." for j in range(7))


def _conversations(proxy, n_conv: int = 3, turns: int = 6) -> list[list[tuple[int, int, float]]]:
    """n_conv conversations interleaved turn by turn, each turn re-sending the whole history,
    streamed. Per conversation: [(input_tokens, cached_tokens, seconds to the first delta)]."""
    client = proxy.client()
    run = uuid.uuid4().hex
    convs = [{"key": f"thread-{run}-{c}", "system": _system_prompt(f"{run}-{c}"), "history": [], "turns": []}
             for c in range(n_conv)]
    try:
        for turn in range(turns):
            for conv in convs:
                conv["history"].append({"role": "user", "content": _turn(conv["key"], turn)})
                started = time.perf_counter()
                ttft = None
                final = None
                stream = client.responses.create(model=MODEL, instructions=conv["system"], input=list(conv["history"]),
                                                 max_output_tokens=8, prompt_cache_key=conv["key"], stream=True)
                for event in stream:
                    if ttft is None and event.type.endswith(".delta"):
                        ttft = time.perf_counter() - started
                    if event.type in ("response.completed", "response.incomplete"):
                        final = event.response
                assert final is not None and final.usage is not None
                conv["turns"].append((final.usage.input_tokens, final.usage.input_tokens_details.cached_tokens,
                                      ttft if ttft is not None else time.perf_counter() - started))
                conv["history"].append({"role": "assistant", "content": final.output_text or f"Noted {turn}."})
    finally:
        client.close()
    assert max(t[0] for conv in convs for t in conv["turns"]) < servers.MAX_MODEL_LEN
    return [conv["turns"] for conv in convs]


def test_affinity_cached_ratio_and_ttft_against_no_affinity(proxy_pair, proxy_pair_no_affinity):
    """Three 6-turn conversations, interleaved, over the same two vLLM workers: through the proxy
    with affinity every turn after the first finds its history in its worker's prefix cache; through
    a proxy without (least loaded, ties take turns: each conversation alternates between the
    workers) a turn only finds the history of two turns back, on the other worker."""
    on = _conversations(proxy_pair)
    off = _conversations(proxy_pair_no_affinity)

    def ratio(convs):
        return sum(c for conv in convs for _, c, _ in conv[1:]) / sum(i for conv in convs for i, _, _ in conv[1:])

    def uncached(convs):
        return sum(i - c for conv in convs for i, c, _ in conv[1:])

    def mean_ttft(convs):
        samples = [t for conv in convs for _, _, t in conv[1:]]
        return sum(samples) / len(samples) * 1000

    ratio_on, ratio_off = ratio(on), ratio(off)
    print(f"\nreal vLLM, 2 workers, 3 interleaved 6-turn conversations (turns 2-6), prompt "
          f"{on[0][0][0]}..{on[0][-1][0]} tokens:\n"
          f"  affinity on : cached/input {ratio_on:.1%}, recomputed {uncached(on)} tokens, "
          f"mean TTFT {mean_ttft(on):.1f} ms\n"
          f"  affinity off: cached/input {ratio_off:.1%}, recomputed {uncached(off)} tokens, "
          f"mean TTFT {mean_ttft(off):.1f} ms\n"
          f"  per turn on : {[[c for _, c, _ in conv] for conv in on]}\n"
          f"  per turn off: {[[c for _, c, _ in conv] for conv in off]}")
    for conv in on:  # from turn 2 on, most of each prompt is cached
        assert all(c / i > 0.6 for i, c, _ in conv[1:]), conv
    assert ratio_on > 0.7
    # Without affinity turn 2 always lands on the other worker: nothing of its history is there.
    assert all(conv[1][1] == 0 for conv in off), off
    assert ratio_on - ratio_off > 0.15, (ratio_on, ratio_off)
    assert uncached(off) > 1.5 * uncached(on)


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
