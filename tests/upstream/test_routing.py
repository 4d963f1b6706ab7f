"""The per-request routing shortcuts: the pool's cached routes (rebuilt whenever a worker's
health, ejection, dialect or models change), the request-key hash, the prompt-size walk.

Pure: no server, no event loop beyond what check_context_window needs.
"""

from __future__ import annotations

import random
import zlib
from types import SimpleNamespace

import orjson
import pytest

from proxy.config import settings as config_settings
from proxy.errors import APIError
from proxy.upstream.affinity import AffinityKey, key_point, request_key
from proxy.protocol.prompt import prompt_bytes
from proxy.upstream.routing import choose, parse_provider, select
from proxy.upstream.workers import Worker, WorkerPool


def _pool(n: int, **kw) -> WorkerPool:
    return WorkerPool([Worker(name=f"w{i}", url=f"http://w{i}", models=("m",)) for i in range(n)], **kw)


AFFINITY = config_settings.of("routing.affinity")
KEYS = [AffinityKey("prompt_cache_key", key_point(f"key-{i}".encode(), b"k\x00"), AFFINITY.epsilon, AFFINITY.vnodes)
        for i in range(200)]


def _chosen(pool: WorkerPool, **kw) -> set[str]:
    return {select(pool, "m", None, affinity=k, **kw).name for k in KEYS}


# --------------------------------------------------------------------------- cached routes follow the workers


@pytest.mark.parametrize("change, undo", [
    (("healthy", False), ("healthy", True)),
    (("ejected", True), ("ejected", False)),
    (("dialect", "detect"), ("dialect", "vllm")),
    (("models", ("other",)), ("models", ("m",))),
])
def test_a_routing_field_change_is_seen_on_the_next_request(change, undo):
    pool = _pool(3)
    assert _chosen(pool) == {"w0", "w1", "w2"}
    setattr(pool.workers[1], *change)
    assert _chosen(pool) == {"w0", "w2"}
    setattr(pool.workers[1], *undo)
    assert _chosen(pool) == {"w0", "w1", "w2"}


def test_a_change_in_one_pool_leaves_another_pools_routes_alone():
    """Each pool (each app) has its own routing epoch: one app's health changes do not throw
    away another app's cached routes."""
    one, two = _pool(2), _pool(2)
    route = two.route("m")
    one.workers[0].healthy = False
    assert [w.name for w in one.route("m").available] == ["w1"]
    assert two.route("m") is route


def test_a_worker_in_two_pools_moves_both_epochs():
    shared = Worker(name="w", url="http://w", models=("m",))
    one, two = WorkerPool([shared]), WorkerPool([shared])
    assert one.route("m").available == two.route("m").available == [shared]
    shared.healthy = False
    assert one.route("m").available == two.route("m").available == []


def test_ejection_and_readmission_through_choose():
    pool = _pool(2, outlier=config_settings.of(
        "health.outlier", {"consecutive_failures": 1, "base_ejection_s": 3600, "max_ejection_s": 3600}))
    assert pool.record_failure(pool.workers[0], "status 500")
    assert {choose(pool, "m", affinity=k).name for k in KEYS} == {"w1"}
    pool.workers[0].ejected_until = 0.0  # the ejection time is over: the next choice re-admits it
    assert {choose(pool, "m", affinity=k).name for k in KEYS} == {"w0", "w1"}
    assert not pool.workers[0].ejected


def test_the_plain_path_chooses_as_the_general_path():
    """No provider object and nothing excluded takes the cached route; an empty provider object
    takes the general path: the same worker, for every key and every load."""
    rnd = random.Random(7)
    pool = _pool(4)
    pool.workers[3].healthy = False
    for _ in range(50):
        for w in pool.workers:
            w.in_flight = rnd.randint(0, 6)
            w.capacity = rnd.choice([4, 8, 256])
        for key in KEYS[:40]:
            try:
                plain = select(pool, "m", None, affinity=key).name
            except APIError as exc:
                plain = exc.code
            try:
                general = select(pool, "m", parse_provider({}), affinity=key).name
            except APIError as exc:
                general = exc.code
            assert plain == general


def test_errors_are_unchanged_and_unknown_models_are_not_cached():
    pool = _pool(2)
    with pytest.raises(APIError) as info:
        select(pool, "nope", None)
    assert info.value.status == 404 and info.value.code == "model_not_found"
    assert "nope" not in pool._routes
    for w in pool.workers:
        w.in_flight = w.capacity
    with pytest.raises(APIError) as info:
        select(pool, "m", None, affinity=KEYS[0])
    assert info.value.status == 429 and info.value.code == "capacity_exhausted"
    for w in pool.workers:
        w.in_flight, w.healthy = 0, False
    with pytest.raises(APIError) as info:
        select(pool, "m", None, affinity=KEYS[0])
    assert info.value.status == 503 and info.value.code == "no_worker_available"


# --------------------------------------------------------------------------- the request key


def test_key_point_is_stable_across_processes():
    # CRC-32, not hash(): the same key lands on the same worker in every process of every run.
    assert key_point(b"thread-1", b"k\x00") == key_point(b"k\x00thread-1") == zlib.crc32(b"k\x00thread-1") << 32
    assert key_point(b"k\x00thread-1") == 0xF046F7A100000000


def test_request_key_sources():
    section = config_settings.of("routing.affinity", {"enabled": True, "epsilon": 0.25, "vnodes": 160,
                                                      "hash_messages": True})
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    t = SimpleNamespace(prompt_cache_key="thread-1", conversation=None, chat=chat)
    assert request_key(t, section) == AffinityKey("prompt_cache_key", key_point(b"k\x00thread-1"), 0.25, 160)
    t.prompt_cache_key, t.conversation = None, "conv_1"
    assert request_key(t, section).point == key_point(b"c\x00conv_1")
    t.conversation = None
    assert request_key(t, section).point == key_point(b'm\x00["Be brief.","Hi"]')


# --------------------------------------------------------------------------- prompt size


def test_prompt_bytes_counts_utf8_and_finds_media():
    chat = {"messages": [
        {"role": "system", "content": "héllo"},  # 6 bytes
        {"role": "user", "content": [{"type": "text", "text": "日本"}, "ab"]},  # 6 + 2
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},  # 12, +1 a colon (tojson), +8 markup
        {"role": "tool", "tool_call_id": "c1", "content": "😀"},  # 2 + 4
    ]}
    assert prompt_bytes(chat) == (6 + 8 + 21 + 6, False)
    image = {"type": "image_url", "image_url": {"url": "x"}}
    chat["messages"].append({"role": "user", "content": [image]})
    assert prompt_bytes(chat) == (41 + len(orjson.dumps(image)), True)  # a media part: its size as sent
