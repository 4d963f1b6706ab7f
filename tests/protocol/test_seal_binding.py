"""Sealed reasoning is bound to the API key it was made for (AES-GCM associated data) and
expires after reasoning_seal.ttl_s; a proxy without seal keys says, in x-token-notice, that
it ignores encrypted_content and returns none.

Real simulator, real proxy with static keys, real HTTP between.
"""

from __future__ import annotations

import base64
import os
import time
from types import SimpleNamespace
from unittest import mock

import aiohttp
import orjson
import pytest

from proxy.config.load import Config, ConfigError
from proxy.protocol.seal import ANONYMOUS, PREFIX, Sealer, SealExpired
from tests.protocol.test_seal import THOUGHT, WEATHER, first_turn_body, follow_up
from tests.conftest import only

ALICE, BOB = "sk-test-alice-0123456789abcdef", "sk-test-bob-0123456789abcdef"
SEAL_KEY = base64.urlsafe_b64encode(os.urandom(32)).decode()
NOT_OPENED = "reasoning item dropped: encrypted_content could not be opened"
EXPIRED = "reasoning item dropped: encrypted_content expired"


def keyed(**seal) -> dict:
    return {**only("stateless", "auth", "tools", "notices"),
            "auth": {"demo_key": False, "static_keys": [{"name": "alice", "key": ALICE}, {"name": "bob", "key": BOB}]},
            "responses": {"reasoning_in_clear": False},
            "reasoning_seal": {"keys": {"k1": SEAL_KEY}, "active": "k1", **seal}}


async def post(proxy, body: dict, key: str | None) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json=body, headers=headers) as resp:
            return resp.status, dict(resp.headers), orjson.loads(await resp.read())


async def first_turn(sim, proxy, key: str | None) -> list[dict]:
    sim.script({"reasoning": THOUGHT, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})
    status, _, data = await post(proxy, first_turn_body(False), key)
    assert status == 200, data
    reasoning = next(i for i in data["output"] if i["type"] == "reasoning")
    assert reasoning["encrypted_content"].startswith(f"{PREFIX}.k1.")
    return data["output"]


def replayed(sim) -> str | None:
    return sim.requests[-1]["messages"][1].get("reasoning")


async def test_a_ciphertext_made_for_one_key_does_not_open_for_another(sim, make_proxy):
    proxy = await make_proxy(keyed())
    output = await first_turn(sim, proxy, ALICE)

    sim.script({"text": "Sunny."})
    status, headers, data = await post(proxy, follow_up(output), BOB)
    assert status == 200, data
    assert replayed(sim) is None  # Bob's request does not carry Alice's reasoning upstream
    assert NOT_OPENED in headers["x-token-notice"]

    sim.script({"text": "Sunny."})
    status, headers, data = await post(proxy, follow_up(output), ALICE)
    assert status == 200, data
    assert replayed(sim) == THOUGHT
    assert NOT_OPENED not in headers.get("x-token-notice", "")


async def test_an_unauthenticated_proxys_ciphertext_does_not_open_for_a_key(sim, make_proxy):
    # The same seal key on a proxy without auth: its ciphertexts are bound to "anonymous".
    open_proxy = await make_proxy({**keyed(), **only("stateless", "tools", "notices")})
    output = await first_turn(sim, open_proxy, None)
    keyed_proxy = await make_proxy(keyed())
    sim.script({"text": "Sunny."})
    status, headers, _ = await post(keyed_proxy, follow_up(output), ALICE)
    assert status == 200 and replayed(sim) is None
    assert NOT_OPENED in headers["x-token-notice"]


async def test_an_expired_ciphertext_is_dropped_with_a_notice(sim, make_proxy):
    proxy = await make_proxy(keyed(ttl_s=3600))
    output = await first_turn(sim, proxy, ALICE)
    reasoning = next(i for i in output if i["type"] == "reasoning")
    two_hours_ago = SimpleNamespace(time=lambda: time.time() - 7200)
    with mock.patch("proxy.protocol.seal.time", two_hours_ago):
        reasoning["encrypted_content"] = Sealer({"k1": base64.urlsafe_b64decode(SEAL_KEY)}, "k1").seal(
            THOUGHT, "static:alice")
    sim.script({"text": "Sunny."})
    status, headers, data = await post(proxy, follow_up(output), ALICE)
    assert status == 200, data
    assert replayed(sim) is None
    assert EXPIRED in headers["x-token-notice"] and "3600s" in headers["x-token-notice"]


def test_sealer_binding_and_expiry():
    sealer = Sealer({"k1": os.urandom(32)}, "k1", ttl_s=60)
    token = sealer.seal(THOUGHT, "static:alice")
    assert sealer.unseal(token, "static:alice") == THOUGHT
    assert sealer.unseal(token, "static:bob") is None
    assert sealer.unseal(token) is None and sealer.unseal(token, ANONYMOUS) is None
    with mock.patch("proxy.protocol.seal.time", SimpleNamespace(time=lambda: time.time() + 61)):
        with pytest.raises(SealExpired):
            sealer.unseal(token, "static:alice")
    seal, unseal = sealer.bound("key_1")
    assert unseal(seal(THOUGHT)) == THOUGHT and sealer.unseal(seal(THOUGHT), "key_2") is None


@pytest.mark.parametrize("ttl", [0, -5, "week", True])
def test_bad_ttl_stops_start_up(ttl):
    with pytest.raises(ConfigError, match="reasoning_seal.ttl_s must be a number > 0"):
        Config.from_dict({"reasoning_seal": {"keys": {"k1": SEAL_KEY}, "ttl_s": ttl}})


async def test_without_a_seal_key_encrypted_content_is_named_in_the_notice(sim, make_proxy, monkeypatch):
    monkeypatch.delenv("RESPONSES_PROXY_SEAL_KEY", raising=False)
    proxy = await make_proxy(only("stateless", "tools", "notices"))
    sim.script({"reasoning": THOUGHT, "text": "ok"})
    status, headers, _ = await post(proxy, first_turn_body(False), None)
    assert status == 200
    assert "reasoning.encrypted_content not returned: no reasoning seal key" in headers["x-token-notice"]
    body = {"model": "tiny-org/tiny-model", "tools": [WEATHER], "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAB-from-elsewhere"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "user", "content": "and?"}]}
    sim.script({"text": "Sunny."})
    status, headers, data = await post(proxy, body, None)
    assert status == 200, data
    assert "encrypted_content ignored: no reasoning seal key is configured" in headers["x-token-notice"]
