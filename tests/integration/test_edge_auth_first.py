"""Nothing costly before authentication: auth is the first phase (no configuration moves it),
a request without a valid key is refused from its headers alone (its body is
never read, the answer comes while the client is still sending), HEAD is guarded like GET,
and two Authorization headers are refused."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from tests.conftest import POLICIES, only

CUSTOM = "tests.support.custom_mw:create"
BODY = orjson.dumps({"model": "tiny-org/tiny-model", "input": "hi", "max_output_tokens": 5})


async def call(proxy, body: bytes = BODY, *, headers: list[tuple[str, str]] | None = None, method: str = "POST",
               path: str = "/v1/responses") -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, proxy.url + path, data=body if method == "POST" else None,
                                headers=[("Content-Type", "application/json"), *(headers or [])]) as r:
            return r.status, r.headers.copy(), await r.read()


def key(proxy) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {proxy.api_key}")]


def error(raw: bytes) -> dict:
    found = orjson.loads(raw)["error"]
    assert set(found) == {"message", "type", "param", "code"}
    return found


async def test_a_bad_body_without_a_key_is_401_not_400(sim, make_proxy):
    proxy = await make_proxy()  # the default chain lists stateless before auth
    status, _, raw = await call(proxy, b"{bad")
    assert status == 401 and error(raw)["code"] == "invalid_api_key"
    status, _, raw = await call(proxy, b"{bad", headers=key(proxy))
    assert status == 400 and error(raw)["code"] == "invalid_json"


async def test_auth_runs_before_every_body_check(sim, make_proxy):
    proxy = await make_proxy(only(*POLICIES))
    stored = orjson.dumps({"model": "tiny-org/tiny-model", "input": "hi", "previous_response_id": "resp_1"})
    for body in (b"{bad", stored, b"x" * 1000):
        status, _, raw = await call(proxy, body)
        assert status == 401 and error(raw)["code"] == "invalid_api_key"
    status, _, raw = await call(proxy, stored, headers=key(proxy))  # the later phases still run
    assert status == 400 and error(raw)["code"] == "stateless_only"
    status, _, raw = await call(proxy, headers=key(proxy))
    assert status == 200, raw


async def test_a_custom_middleware_after_auth_sees_only_authenticated_requests(sim, make_proxy):
    proxy = await make_proxy(only(*POLICIES, after_auth=[{CUSTOM: {"header": "x-custom", "refuse_model": "banned"}}]))
    banned = orjson.dumps({"model": "banned", "input": "hi"})
    status, headers, raw = await call(proxy, banned)
    assert status == 401 and error(raw)["code"] == "invalid_api_key"
    status, _, raw = await call(proxy, banned, headers=key(proxy))
    assert status == 403 and error(raw)["code"] == "model_refused"


async def test_a_pipeline_without_auth_still_serves_without_a_key(sim, make_proxy):
    proxy = await make_proxy(only("stateless", "tools"))
    status, _, raw = await call(proxy)
    assert status == 200, raw


# --------------------------------------------------------------------------- the body is never read


FIRST = 65_536
BIG = 8 * 1024 * 1024


async def _refused_mid_body(proxy, extra: bytes, *, chunked: bool) -> tuple[bytes, asyncio.StreamReader,
                                                                              asyncio.StreamWriter]:
    """Send the head of an 8 MiB POST and its first 64 KiB, then send nothing more: the
    answer must come anyway (a proxy that reads the body first waits for the rest)."""
    port = int(proxy.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    size = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % BIG
    writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
                 + extra + size + b"\r\n\r\n")
    first = b'{"model":"tiny-org/tiny-model","input":"' + b"x" * (FIRST - 31)
    writer.write(b"%x\r\n%s\r\n" % (len(first), first) if chunked else first)
    await writer.drain()
    async with asyncio.timeout(20):  # the body read timeout is 60 s: only an early answer beats this
        head = await reader.readuntil(b"\r\n\r\n")
    return head, reader, writer


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        field, _, value = line.partition(b":")
        if field.strip().lower() == name:
            return value.strip()
    return None


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("credentials", [b"", b"Authorization: Bearer sk-rp-not-a-key\r\n",
                                         b"Authorization: Basic x\r\n"])
async def test_an_8mb_body_without_a_valid_key_is_refused_before_it_is_sent(sim, make_proxy, chunked, credentials):
    proxy = await make_proxy({"server": {"log_format": "json", "body_read_timeout": 60}})
    head, reader, writer = await _refused_mid_body(proxy, credentials, chunked=chunked)
    try:
        assert head.startswith(b"HTTP/1.1 401 "), head
        assert _header(head, b"connection") == b"close"
        body = await reader.readexactly(int(_header(head, b"content-length")))
        assert error(body)["code"] == "invalid_api_key"
        # The rest is dropped as it arrives; once the client is done, the connection closes.
        rest = b"x" * (BIG - FIRST)
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest) if chunked else rest)
        await writer.drain()
        writer.write_eof()
        async with asyncio.timeout(20):
            assert await reader.read() == b""
    finally:
        writer.close()


async def test_a_small_refused_body_keeps_the_connection(sim, make_proxy):
    """Only a body still arriving costs the connection: a whole small one does not."""
    proxy = await make_proxy()
    status, headers, _ = await call(proxy, b"{bad")
    assert status == 401 and headers.get("Connection", "").lower() != "close"


# --------------------------------------------------------------------------- HEAD and duplicate headers


async def test_head_of_models_needs_a_key(sim, make_proxy):
    proxy = await make_proxy()
    status, headers, _ = await call(proxy, method="HEAD", path="/v1/models")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    status, _, _ = await call(proxy, method="HEAD", path="/v1/models", headers=key(proxy))
    assert status == 200


async def test_a_method_a_guarded_path_does_not_serve_is_still_405(sim, make_proxy):
    proxy = await make_proxy()
    status, _, raw = await call(proxy, method="DELETE", path="/v1/responses")
    assert status == 405 and error(raw)["type"] == "invalid_request_error"


@pytest.mark.parametrize("second", ["same", "other"])
@pytest.mark.parametrize("path, method", [("/v1/responses", "POST"), ("/v1/models", "GET")])
async def test_two_authorization_headers_are_400(sim, make_proxy, second, path, method):
    proxy = await make_proxy()
    other = "Bearer sk-rp-someone-else" if second == "other" else f"Bearer {proxy.api_key}"
    status, _, raw = await call(proxy, method=method, path=path,
                                headers=[*key(proxy), ("Authorization", other)])
    assert status == 400
    found = error(raw)
    assert found["code"] == "duplicate_header" and found["type"] == "invalid_request_error"
    assert proxy.api_key not in found["message"]


async def test_clients_sending_a_large_body_with_a_wrong_key_read_the_401(sim, make_proxy):
    """The connection is closed under a client still sending: the OpenAI SDK (httpx) and
    aiohttp still read the 401, not a connection error."""
    import openai

    proxy = await make_proxy()
    client = proxy.openai(api_key="sk-rp-wrong")
    with pytest.raises(openai.AuthenticationError) as caught:
        await client.responses.create(model="tiny-org/tiny-model", input="x" * (7 * 1024 * 1024))
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    status, headers, raw = await call(proxy, b'{"input":"' + b"x" * (7 * 1024 * 1024) + b'"}',
                                      headers=[("Authorization", "Bearer sk-rp-wrong")])
    assert status == 401 and error(raw)["code"] == "invalid_api_key"


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_oversize_body_with_a_key_is_refused_and_not_drained(sim, make_proxy, chunked):
    """A 413 that leaves the body unread (declared too large, or counted past the limit)
    closes the connection behind it, as a refused key does."""
    proxy = await make_proxy({"server": {"log_format": "json", "max_body_bytes": 32 * 1024,
                                         "body_read_timeout": 60}})
    port = int(proxy.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    size = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % BIG
    writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + proxy.api_key.encode() + b"\r\n" + size + b"\r\n\r\n")
    first = b"x" * FIRST
    writer.write(b"%x\r\n%s\r\n" % (len(first), first) if chunked else first)
    await writer.drain()
    try:
        async with asyncio.timeout(20):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413 "), head
        assert _header(head, b"connection") == b"close"
        assert error(await reader.readexactly(int(_header(head, b"content-length"))))["code"] == "request_too_large"
        writer.write_eof()
        async with asyncio.timeout(20):
            assert await reader.read() == b""
    finally:
        writer.close()
