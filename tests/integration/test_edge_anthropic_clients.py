"""What Anthropic's clients read on /v1/messages: refusals they must not retry say so
(x-should-retry: false), a refusal before the body was read closes the connection (a pooled
connection is never left behind an unread body), an overloaded worker stays 529, every answer on
those routes is in Anthropic's envelope, and x-api-key is the key there."""

from __future__ import annotations

import asyncio

import anthropic
import orjson
import pytest

from proxy.ledger import KeyLimits

MODEL = "tiny-org/tiny-model"
BODY = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}


def _port(proxy) -> int:
    return int(proxy.url.rsplit(":", 1)[1])


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/responses"])
async def test_a_401_before_the_body_arrived_closes_the_connection(make_proxy, path):
    proxy = await make_proxy()
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(proxy))
    body = orjson.dumps(BODY)
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nx-api-key: sk-wrong\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " + str(len(body) + 1000).encode()
                 + b"\r\n\r\n" + body[:10])
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    writer.close()
    assert head.startswith(b"HTTP/1.1 401"), head
    assert b"connection: close" in head.lower(), head
    if path == "/v1/messages":
        assert b"x-should-retry: false" in head.lower(), head


@pytest.mark.parametrize("status", [400, 401, 402, 403, 404])
async def test_refusals_a_retry_cannot_fix_say_so(make_proxy, http, status):
    proxy = await make_proxy({"prices": {"default": {"input": 1_000_000, "output": 1_000_000}}})
    limits = KeyLimits(allowed_models=["nothing-served"]) if status == 403 else None
    secret, record = await proxy.ledger.create_key("k", balance_micros=0 if status == 402 else 10_000,
                                                   **({"limits": limits} if limits else {}))
    body = dict(BODY)
    if status == 400:
        body["max_tokens"] = "many"
    if status == 404:
        body["model"] = "no/such-model"
    key = "sk-rp-wrong" if status == 401 else secret
    async with http.post(proxy.url + "/v1/messages", json=body, headers={"x-api-key": key}) as resp:
        raw = await resp.json()
    assert resp.status == status, raw
    assert raw["type"] == "error" and resp.headers["x-should-retry"] == "false"


async def test_an_overloaded_worker_stays_529(make_proxy, sim, http):
    proxy = await make_proxy()
    sim.script({"status": 529, "body": {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}},
               {"status": 529, "body": {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}},
               {"status": 529, "body": {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}})
    async with http.post(proxy.url + "/v1/messages", json=BODY, headers={"x-api-key": proxy.api_key}) as resp:
        raw = await resp.json()
    assert resp.status == 529 and raw["error"]["type"] == "overloaded_error", raw
    assert "x-should-retry" not in resp.headers


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/messages", 405), ("PUT", "/v1/messages/count_tokens", 405)])
async def test_every_answer_on_the_messages_routes_is_in_anthropics_envelope(make_proxy, http, method, path, status):
    proxy = await make_proxy()
    async with http.request(method, proxy.url + path, headers={"x-api-key": proxy.api_key}) as resp:
        raw = await resp.json()
    assert resp.status == status and raw["type"] == "error" and set(raw["error"]) == {"type", "message"}, raw


async def test_x_api_key_is_the_key_on_the_messages_routes(make_proxy, http):
    proxy = await make_proxy()
    same = {"x-api-key": proxy.api_key, "Authorization": f"Bearer {proxy.api_key}"}
    async with http.post(proxy.url + "/v1/messages", json=BODY, headers=same) as resp:
        assert resp.status == 200, await resp.text()
    two = {"x-api-key": proxy.api_key, "Authorization": "Bearer sk-rp-someone-else"}
    async with http.post(proxy.url + "/v1/messages", json=BODY, headers=two) as resp:
        raw = await resp.json()
    assert resp.status == 401 and "Two different API keys" in raw["error"]["message"], raw
    async with http.post(proxy.url + "/v1/messages", json=BODY) as resp:
        raw = await resp.json()
    assert resp.status == 401 and "x-api-key" in raw["error"]["message"].split("(")[0], raw


async def test_one_users_bad_key_never_stalls_another_in_a_shared_pool(make_proxy):
    """One anthropic SDK pool, two users: the bad key's 401 closes its connection, so the other
    user's next request never lands on a connection left behind an unread body. 100 of 100.
    (Before, such a request waited ~10.9 s for the server to close that connection: past the 8 s
    timeout here, which a loopback request to the simulator never comes near.)"""
    proxy = await make_proxy()
    good = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=proxy.api_key, max_retries=0, timeout=8)
    bad = good.with_options(api_key="sk-rp-revoked")  # the same client, so the same connection pool
    async with good:
        ok = 0
        # a body larger than the first reads: the 401 is answered before it has all arrived
        big = {**BODY, "messages": [{"role": "user", "content": "x" * (1 << 20)}]}
        for _ in range(100):
            with pytest.raises(anthropic.AuthenticationError):
                await bad.messages.create(**big)
            answer = await good.messages.create(**BODY)
            ok += answer.type == "message"
    assert ok == 100
