"""Sealed reasoning: AES-GCM with key ids, rotation, and ciphertexts the proxy cannot open
(rotated-out keys, tampering, another provider's) dropped with a notice, never a 500."""

from __future__ import annotations

import base64
import os

import aiohttp
import orjson
import pytest

from proxy.config import settings as config_settings
from proxy.config.load import Config, ConfigError
from proxy.config.cross_checks import sealer_from_config
from proxy.protocol.seal import PREFIX, Sealer
from tests.support.sdk_check import check_sequence, parse_sse, validate_response
from tests.conftest import only

PIPELINE = only("stateless", "tools", "notices")
CIPHER_ONLY = {"reasoning_in_clear": False}  # responses section: with a seal, send only the ciphertext
NOTICE = "reasoning item dropped: encrypted_content could not be opened"
THOUGHT = "First I look at the weather tool, then I answer in one line."
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Weather for a city", "strict": False,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# What an OpenAI reasoning item's encrypted_content looks like: not ours.
FOREIGN = "gAAAAABo" + base64.urlsafe_b64encode(os.urandom(180)).decode()


def key() -> str:
    return base64.urlsafe_b64encode(os.urandom(32)).decode()


def raw(k: str) -> bytes:
    return base64.urlsafe_b64decode(k)


# --------------------------------------------------------------------------- the Sealer itself


def test_seal_round_trip_and_format():
    sealer = Sealer({"k1": raw(key())}, "k1")
    token = sealer.seal(THOUGHT)
    assert token.startswith(f"{PREFIX}.k1.")
    assert THOUGHT not in token
    assert sealer.unseal(token) == THOUGHT
    assert sealer.seal(THOUGHT) != token  # a fresh nonce every time
    assert sealer.unseal(sealer.seal("")) == ""
    assert sealer.unseal(sealer.seal("ünïcødé ✓")) == "ünïcødé ✓"


def test_rotation_opens_old_tokens_while_the_key_is_kept():
    k1, k2 = raw(key()), raw(key())
    old = Sealer({"k1": k1}, "k1").seal(THOUGHT)
    rotated = Sealer({"k1": k1, "k2": k2}, "k2")
    assert rotated.unseal(old) == THOUGHT
    new = rotated.seal(THOUGHT)
    assert new.startswith(f"{PREFIX}.k2.")
    assert Sealer({"k2": k2}, "k2").unseal(old) is None  # k1 removed: cannot open
    assert Sealer({"k2": k2}, "k2").unseal(new) == THOUGHT


def test_a_key_id_cannot_be_swapped():
    k1, k2 = raw(key()), raw(key())
    sealer = Sealer({"k1": k1, "k2": k2}, "k1")
    token = sealer.seal(THOUGHT)
    swapped = token.replace(f"{PREFIX}.k1.", f"{PREFIX}.k2.", 1)
    assert sealer.unseal(swapped) is None


@pytest.mark.parametrize("mangle", [
    lambda t: t[:-2] + ("AA" if not t.endswith("AA") else "BB"),  # tampered tag
    lambda t: t[:12] + ("x" if t[12] != "x" else "y") + t[13:],    # tampered nonce / body
    lambda t: t[: len(t) // 2],                                     # truncated
    lambda t: t.replace(f"{PREFIX}.", "rp9.", 1),                   # another version
    lambda t: t + "!!!",                                            # not base64
    lambda t: FOREIGN,                                              # another provider's
    lambda t: "",
    lambda t: "rp1.k1.",
    lambda t: "rp1.nokey.AAAA",
])
def test_what_cannot_be_opened_opens_to_none(mangle):
    sealer = Sealer({"k1": raw(key())}, "k1")
    assert sealer.unseal(mangle(sealer.seal(THOUGHT))) is None


@pytest.mark.parametrize("value", [None, 42, ["rp1.k1.x"], {"a": 1}])
def test_non_strings_open_to_none(value):
    assert Sealer({"k1": raw(key())}, "k1").unseal(value) is None


def _sealer(section: dict):
    return sealer_from_config(config_settings.of("reasoning_seal", section))


def test_config(monkeypatch):
    monkeypatch.delenv("RESPONSES_PROXY_SEAL_KEY", raising=False)
    assert _sealer({}) is None
    assert _sealer({"keys": {}, "active": None}) is None
    k1, k2 = key(), key()
    sealer = _sealer({"keys": {"k1": k1, "k2": k2}, "active": "k2"})
    assert sealer.active == "k2"
    assert _sealer({"keys": {"k1": k1}}).active == "k1"  # the first key by default
    with pytest.raises(ConfigError, match="'k9' is not among the configured keys"):
        _sealer({"keys": {"k1": k1}, "active": "k9"})
    with pytest.raises(ConfigError, match="must be 32 bytes"):
        _sealer({"keys": {"k1": base64.urlsafe_b64encode(b"short").decode()}})
    with pytest.raises(ConfigError, match="is not base64"):
        _sealer({"keys": {"k1": "not base64 at all ***"}})
    with pytest.raises(ConfigError, match="may not contain '.'"):
        _sealer({"keys": {"a.b": k1}})
    with pytest.raises(ConfigError, match=r"reasoning_seal\.keys\.k1 must be 32 bytes"):  # refused at load too
        Config.from_dict({"reasoning_seal": {"keys": {"k1": base64.urlsafe_b64encode(b"short").decode()}}})


def test_env_key(monkeypatch):
    k = key()
    monkeypatch.setenv("RESPONSES_PROXY_SEAL_KEY", k)
    sealer = _sealer({})
    assert sealer is not None and sealer.active == "env"
    assert Sealer({"env": raw(k)}, "env").unseal(sealer.seal(THOUGHT)) == THOUGHT


# --------------------------------------------------------------------------- through the proxy


async def post(proxy, body: dict) -> tuple[int, dict, dict | list]:
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json=body,
                             headers={"Authorization": f"Bearer {proxy.api_key}"}) as resp:
            data = await resp.read()
            parsed = parse_sse(data) if body.get("stream") and resp.status == 200 else orjson.loads(data)
            return resp.status, dict(resp.headers), parsed


def first_turn_body(stream: bool) -> dict:
    return {"model": "tiny-org/tiny-model", "input": "Weather in Paris?", "tools": [WEATHER], "stream": stream,
            "include": ["reasoning.encrypted_content"]}


async def sealed_first_turn(sim, proxy, stream: bool) -> list[dict]:
    """One turn that reasons and calls a tool; returns its output items."""
    sim.script({"reasoning": THOUGHT, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})
    status, _, data = await post(proxy, first_turn_body(stream))
    assert status == 200
    response = check_sequence(data) if stream else validate_response(data).model_dump(mode="json")
    output = data[-1]["response"]["output"] if stream else data["output"]
    assert response["status"] == "completed"
    return output


def follow_up(output: list[dict]) -> dict:
    call = next(i for i in output if i["type"] == "function_call")
    return {"model": "tiny-org/tiny-model", "tools": [WEATHER], "include": ["reasoning.encrypted_content"], "input": [
        {"role": "user", "content": "Weather in Paris?"}, *output,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_sealed_reasoning_round_trip(sim, make_proxy, stream):
    proxy = await make_proxy({**PIPELINE, "responses": CIPHER_ONLY,
                              "reasoning_seal": {"keys": {"k1": key()}, "active": "k1"}})
    output = await sealed_first_turn(sim, proxy, stream)
    reasoning = next(i for i in output if i["type"] == "reasoning")
    assert reasoning["encrypted_content"].startswith(f"{PREFIX}.k1.")
    assert THOUGHT not in orjson.dumps(output).decode(), "the client only sees the ciphertext"

    sim.script({"text": "Sunny."})
    status, headers, data = await post(proxy, follow_up(output))
    assert status == 200, data
    assistant = sim.requests[-1]["messages"][1]
    assert assistant["role"] == "assistant" and assistant["reasoning"] == THOUGHT
    assert NOTICE not in headers.get("x-token-notice", "")


async def test_without_include_no_ciphertext_is_produced(sim, make_proxy):
    proxy = await make_proxy({**PIPELINE, "reasoning_seal": {"keys": {"k1": key()}}})
    sim.script({"reasoning": THOUGHT, "text": "ok"})
    body = first_turn_body(False)
    del body["include"]
    status, _, data = await post(proxy, body)
    assert status == 200
    reasoning = next(i for i in data["output"] if i["type"] == "reasoning")
    assert not reasoning.get("encrypted_content")


async def test_rotation_through_the_proxy(sim, make_proxy):
    k1, k2 = key(), key()
    first = await make_proxy({**PIPELINE, "responses": CIPHER_ONLY,
                              "reasoning_seal": {"keys": {"k1": k1}, "active": "k1"}})
    output = await sealed_first_turn(sim, first, False)

    # k2 active, k1 still configured: the old ciphertext opens.
    rotated = await make_proxy({**PIPELINE, "responses": CIPHER_ONLY,
                                "reasoning_seal": {"keys": {"k1": k1, "k2": k2}, "active": "k2"}})
    sim.script({"reasoning": "again", "text": "Sunny."})
    status, headers, data = await post(rotated, follow_up(output))
    assert status == 200, data
    assert sim.requests[-1]["messages"][1]["reasoning"] == THOUGHT
    assert NOTICE not in headers.get("x-token-notice", "")
    new = next(i for i in data["output"] if i["type"] == "reasoning")
    assert new["encrypted_content"].startswith(f"{PREFIX}.k2.")

    # k1 removed: dropped with a notice; the call and its output still go through.
    retired = await make_proxy({**PIPELINE, "responses": CIPHER_ONLY,
                                "reasoning_seal": {"keys": {"k2": k2}, "active": "k2"}})
    sim.script({"text": "Sunny."})
    status, headers, data = await post(retired, follow_up(output))
    assert status == 200, data
    assistant = sim.requests[-1]["messages"][1]
    assert "reasoning" not in assistant
    assert assistant["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sim.requests[-1]["messages"][2]["role"] == "tool"
    assert NOTICE in headers["x-token-notice"]


@pytest.mark.parametrize("case", ["tampered", "foreign", "garbage", "other_key_id"])
@pytest.mark.parametrize("stream", [False, True])
async def test_unopenable_ciphertext_is_dropped_with_a_notice(sim, make_proxy, case, stream):
    proxy = await make_proxy({**PIPELINE, "responses": CIPHER_ONLY,
                              "reasoning_seal": {"keys": {"k1": key()}, "active": "k1"}})
    output = await sealed_first_turn(sim, proxy, False)
    reasoning = next(i for i in output if i["type"] == "reasoning")
    token = reasoning["encrypted_content"]
    reasoning["encrypted_content"] = {
        "tampered": token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB"),
        "foreign": FOREIGN,
        "garbage": "\x00not-a-token\u2603",
        "other_key_id": token.replace(f"{PREFIX}.k1.", f"{PREFIX}.k7.", 1),
    }[case]
    sim.script({"text": "Sunny."})
    body = {**follow_up(output), "stream": stream}
    status, headers, data = await post(proxy, body)
    assert status == 200, data
    if stream:
        assert check_sequence(data)["status"] == "completed"
    assert "reasoning" not in sim.requests[-1]["messages"][1]
    assert NOTICE in headers["x-token-notice"]


async def test_ciphertext_without_a_configured_key_is_dropped_not_a_500(sim, make_proxy, monkeypatch):
    monkeypatch.delenv("RESPONSES_PROXY_SEAL_KEY", raising=False)
    sealed = await make_proxy({**PIPELINE, "responses": CIPHER_ONLY,
                               "reasoning_seal": {"keys": {"k1": key()}}})
    output = await sealed_first_turn(sim, sealed, False)
    keyless = await make_proxy(PIPELINE)
    sim.script({"text": "Sunny."})
    status, _, data = await post(keyless, follow_up(output))
    assert status == 200, data
    assert "reasoning" not in sim.requests[-1]["messages"][1]


async def test_keyless_proxy_replays_the_reasoning_text(sim, make_proxy, monkeypatch):
    monkeypatch.delenv("RESPONSES_PROXY_SEAL_KEY", raising=False)
    proxy = await make_proxy(PIPELINE)
    output = await sealed_first_turn(sim, proxy, True)
    reasoning = next(i for i in output if i["type"] == "reasoning")
    assert not reasoning.get("encrypted_content")
    assert reasoning["summary"][0]["text"] == THOUGHT
    sim.script({"text": "Sunny."})
    status, _, _ = await post(proxy, follow_up(output))
    assert status == 200
    assert sim.requests[-1]["messages"][1]["reasoning"] == THOUGHT


async def test_seal_key_from_the_environment(sim, make_proxy, monkeypatch):
    monkeypatch.setenv("RESPONSES_PROXY_SEAL_KEY", key())
    proxy = await make_proxy(PIPELINE)
    output = await sealed_first_turn(sim, proxy, False)
    reasoning = next(i for i in output if i["type"] == "reasoning")
    assert reasoning["encrypted_content"].startswith(f"{PREFIX}.env.")
    sim.script({"text": "Sunny."})
    status, _, _ = await post(proxy, follow_up(output))
    assert status == 200
    assert sim.requests[-1]["messages"][1]["reasoning"] == THOUGHT


async def test_default_sends_the_summary_too_and_the_ciphertext_wins(sim, make_proxy):
    """responses.reasoning_in_clear defaults to true: the summary carries the text beside the
    ciphertext. On replay the opened ciphertext is what the model gets, not the client's copy."""
    proxy = await make_proxy({**PIPELINE, "reasoning_seal": {"keys": {"k1": key()}, "active": "k1"}})
    output = await sealed_first_turn(sim, proxy, True)
    reasoning = next(i for i in output if i["type"] == "reasoning")
    assert reasoning["summary"][0]["text"] == THOUGHT
    assert reasoning["encrypted_content"].startswith(f"{PREFIX}.k1.")
    reasoning["summary"][0]["text"] = "edited by the client"
    sim.script({"text": "Sunny."})
    status, headers, _ = await post(proxy, follow_up(output))
    assert status == 200
    assert sim.requests[-1]["messages"][1]["reasoning"] == THOUGHT
    # A ciphertext that cannot be opened falls back to the summary text, silently: not a 500.
    reasoning["encrypted_content"] = FOREIGN
    sim.script({"text": "Sunny."})
    status, headers, _ = await post(proxy, follow_up(output))
    assert status == 200
    assert sim.requests[-1]["messages"][1]["reasoning"] == "edited by the client"
