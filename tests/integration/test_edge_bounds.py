"""The edge's promises under hostile clients (issue 25), written as the attacker: a head of
128 headers of 8 KB, a head that trickles a byte at a time, HTTP/1.0 with Transfer-Encoding,
a flood of wrong admin keys. Each is refused in the envelope, in bounded bytes and time, or
answered, and the connection is closed; what a good client does on the same connection (a
body larger than the head budget, a body or a WebSocket slower than the head timeout, the
next request on a keep-alive connection) is never cut by it. proxy/http/parse_errors.py,
proxy/admin/auth.py."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

ADMIN_KEY = "adm-" + "a" * 28
PAD = 8000  # one header line stays under aiohttp's max_field_size (8190)


def _host(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _big_head(path: str = "/v1/models", lines: int = 127, *, end: bool = True) -> bytes:
    """127 headers of 8 KB and Host: aiohttp's max_headers (128), each under max_field_size."""
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode()
    head += b"".join(b"X-Pad-%03d: " % i + b"a" * PAD + b"\r\n" for i in range(lines))
    return head + (b"\r\n" if end else b"")


async def _send_quietly(writer: asyncio.StreamWriter, data: bytes, step: int = 65536) -> None:
    """Write as an attacker does: the server may close mid-way (that is the point)."""
    try:
        for i in range(0, len(data), step):
            writer.write(data[i:i + step])
            await writer.drain()
    except (ConnectionError, OSError):
        pass


async def _read_to_eof(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the server sends until it closes; TimeoutError if it keeps the connection."""
    out = b""
    async with asyncio.timeout(within):
        while True:
            try:
                chunk = await reader.read(65536)
            except (ConnectionError, OSError):
                return out
            if not chunk:
                return out
            out += chunk


def _answer(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, orjson.loads(body) if body else {}


# --------------------------------------------------------------------------- head bytes

@pytest.mark.parametrize("end", [True, False], ids=["whole-head", "head-held-open"])
async def test_128_headers_of_8kb_are_a_431_envelope_and_the_connection_closes(make_proxy, end):
    """Before: a whole head of ~1 MB reached the app (a 401 on a kept connection), and one
    held open (no blank line) sat in the parser for keepalive_timeout."""
    p = await make_proxy()
    reader, writer = await asyncio.open_connection(*_host(p.url))
    sender = asyncio.create_task(_send_quietly(writer, _big_head(end=end)))
    raw = await _read_to_eof(reader, within=10)  # the answer, then EOF: closed
    await sender
    writer.close()
    status, _, body = _answer(raw)
    assert status == 431
    assert body["error"]["code"] == "request_header_too_large"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert b"aaaa" not in raw  # nothing of the client's bytes echoed


async def test_the_head_budget_is_per_request_and_never_counts_a_body(make_proxy):
    """A body of 64 KB (16x the budget) and then, after 2.5 s idle (2.5x the head timeout), the
    next request with a head of 3 KB, on one keep-alive connection: both answered; the third
    request's 6 KB head is the 431."""
    p = await make_proxy({"server": {"log_format": "json", "max_header_bytes": 4096, "header_read_timeout_s": 1.0}})
    body = orjson.dumps({"model": "tiny-org/tiny-model", "input": "hi " * 23000, "max_output_tokens": 4})
    assert len(body) > 16 * 4096
    pad = b"X-Pad: " + b"p" * 3000 + b"\r\n"
    first = (b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + p.api_key.encode()
             + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body) + pad + b"\r\n" + body)
    second = (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + p.api_key.encode() + b"\r\n"
              + pad + b"\r\n")
    reader, writer = await asyncio.open_connection(*_host(p.url))
    try:
        for request in (first, second):
            writer.write(request)
            await writer.drain()
            async with asyncio.timeout(30):
                head = await reader.readuntil(b"\r\n\r\n")
                status, headers, _ = _answer(head)
                await reader.readexactly(int(headers["content-length"]))
            assert status == 200, head
            assert headers.get("connection", "").lower() != "close"
            await asyncio.sleep(2.5)  # idle between requests: keepalive_timeout's business
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + pad + pad + b"\r\n")
        status, _, body = _answer(await _read_to_eof(reader, within=10))
        assert (status, body["error"]["code"]) == (431, "request_header_too_large")
    finally:
        writer.close()


# --------------------------------------------------------------------------- head time

async def test_a_head_trickled_a_byte_at_a_time_is_cut_at_the_timeout(make_proxy):
    """Slowloris: a byte every 0.2 s never completes the head. Before: held for the runner's
    keepalive_timeout (75 s under serve, an hour in the tests' runner)."""
    p = await make_proxy({"server": {"log_format": "json", "header_read_timeout_s": 1.0}})
    reader, writer = await asyncio.open_connection(*_host(p.url))

    async def trickle() -> None:
        try:
            for byte in b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 1000:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)  # a head that trickles a byte at a time
        except (ConnectionError, OSError):
            pass

    started = time.monotonic()
    sender = asyncio.create_task(trickle())
    raw = await _read_to_eof(reader, within=10)  # generous: 10x the timeout
    elapsed = time.monotonic() - started
    sender.cancel()
    writer.close()
    assert elapsed >= 0.5  # not refused for its pace before the timeout
    status, _, body = _answer(raw)
    assert (status, body["error"]["code"]) == (408, "request_header_timeout")


async def test_a_connection_that_sends_nothing_is_closed_at_the_timeout(make_proxy):
    p = await make_proxy({"server": {"log_format": "json", "header_read_timeout_s": 1.0}})
    reader, writer = await asyncio.open_connection(*_host(p.url))
    assert await _read_to_eof(reader, within=10) == b""  # closed, nothing answered
    writer.close()


async def test_a_slow_body_and_a_websocket_outlive_the_head_timeout(make_proxy):
    """The timer covers heads only: a body that takes 2.5 s and a WebSocket open 2.5 s, with a
    1 s head timeout (a keep-alive connection idle between requests: the test above)."""
    p = await make_proxy({"server": {"log_format": "json", "header_read_timeout_s": 1.0}})
    auth = {"Authorization": f"Bearer {p.api_key}"}
    body = orjson.dumps({"model": "tiny-org/tiny-model", "input": "hello", "max_output_tokens": 4})

    async def slow_body():
        for part in (body[:10], body[10:20], body[20:]):
            yield part
            await asyncio.sleep(0.85)  # a body that trickles, each gap under the read timeout

    async with aiohttp.ClientSession() as s:
        r = await s.post(p.url + "/v1/responses", data=slow_body(),
                         headers={**auth, "Content-Type": "application/json"})
        assert r.status == 200, await r.text()
        assert (await r.json())["object"] == "response"

        async with s.ws_connect(p.url.replace("http", "ws") + "/v1/responses", headers=auth) as ws:
            await asyncio.sleep(2.5)  # an idle socket, past keepalive_timeout
            await ws.send_str(orjson.dumps({"type": "response.create", "model": "tiny-org/tiny-model",
                                            "input": "hello", "max_output_tokens": 4}).decode())
            async with asyncio.timeout(30):
                while True:
                    msg = await ws.receive()
                    assert msg.type == aiohttp.WSMsgType.TEXT, msg
                    if orjson.loads(msg.data)["type"] in ("response.completed", "response.incomplete"):
                        break


# --------------------------------------------------------------------------- HTTP/1.0 + Transfer-Encoding

@pytest.mark.parametrize("path, auth", [("/v1/models", True), ("/v1/models", False), ("/livez", False)],
                         ids=["answered", "refused-before-the-handler", "probe"])
async def test_http10_with_transfer_encoding_is_answered_then_closed(make_proxy, path, auth):
    """RFC 9112 6.1: the framing of an HTTP/1.0 message with Transfer-Encoding is faulty; the
    server closes after answering. Before: `Connection: keep-alive` kept the connection."""
    p = await make_proxy()
    reader, writer = await asyncio.open_connection(*_host(p.url))
    head = f"GET {path} HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n"
    if auth:
        head += f"Authorization: Bearer {p.api_key}\r\n"
    writer.write(head.encode() + b"\r\n0\r\n\r\n")
    await writer.drain()
    raw = await _read_to_eof(reader, within=10)
    writer.close()
    assert raw.startswith(b"HTTP/1."), raw[:200]
    status, headers, _ = _answer(raw)
    assert status == (200 if auth or path == "/livez" else 401)
    assert headers.get("connection", "").lower() != "keep-alive"


async def test_http10_with_transfer_encoding_streamed_answer_then_closed(make_proxy):
    """The same for a streamed answer, whose head left before the handler was done."""
    p = await make_proxy()
    body = orjson.dumps({"model": "tiny-org/tiny-model", "input": "hello", "max_output_tokens": 4, "stream": True})
    reader, writer = await asyncio.open_connection(*_host(p.url))
    writer.write(b"POST /v1/responses HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n"
                 b"Content-Type: application/json\r\nAuthorization: Bearer " + p.api_key.encode() + b"\r\n\r\n"
                 + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
    await writer.drain()
    raw = await _read_to_eof(reader, within=30)
    writer.close()
    assert raw.startswith(b"HTTP/1.") and b" 200 " in raw.split(b"\r\n", 1)[0], raw[:300]
    assert b"response.completed" in raw or b"response.incomplete" in raw


# --------------------------------------------------------------------------- admin keys

def _admin(**extra):
    return {"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY}], **extra}}


@pytest.mark.parametrize("via", ["bearer", "login"])
async def test_a_flood_of_wrong_admin_keys_is_throttled_and_the_right_key_too(make_proxy, via):
    """Before: 1,000-3,400 guesses a second, none refused. After the burst (10 by default)
    every key from the address is a 429 with Retry-After, the right one too, so guessing stops."""
    p = await make_proxy(_admin())

    async def attempt(s: aiohttp.ClientSession, key: str) -> aiohttp.ClientResponse:
        if via == "bearer":
            return await s.get(p.url + "/admin/api/keys", headers={"Authorization": f"Bearer {key}"})
        return await s.post(p.url + "/admin/login", json={"key": key})

    async with aiohttp.ClientSession() as s:
        statuses = []
        for i in range(25):
            r = await attempt(s, f"guess-{i:04d}-" + "x" * 20)
            statuses.append(r.status)
            if r.status == 429:
                body = await r.json()
                assert body["error"]["code"] == "too_many_login_attempts"
                assert set(body["error"]) == {"message", "type", "param", "code"}
                assert 1 <= int(r.headers["Retry-After"]) <= 60
        assert statuses[:10] == [401] * 10 and statuses[10:] == [429] * 15, statuses
        r = await attempt(s, ADMIN_KEY)
        assert r.status == 429  # the right key is not even compared while throttled


async def test_right_admin_keys_are_never_throttled(make_proxy):
    """Successes spend nothing: 30 right keys (3x the burst) from one address, then 9 wrong
    ones still get their 401."""
    p = await make_proxy(_admin())
    async with aiohttp.ClientSession() as s:
        for _ in range(30):
            r = await s.get(p.url + "/admin/api/keys", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert r.status == 200
        for _ in range(9):
            r = await s.get(p.url + "/admin/api/keys", headers={"Authorization": "Bearer wrong-" + "w" * 20})
            assert r.status == 401


def test_the_login_throttle_is_per_address_refills_and_is_bounded():
    from proxy.admin.auth import LoginThrottle

    t = LoginThrottle(per_min=60, burst=3, max_addresses=100)  # one failure a second
    for _ in range(3):
        assert t.retry_after("203.0.113.7", now=0.0) == 0
        t.failed("203.0.113.7", now=0.0)
    assert t.retry_after("203.0.113.7", now=0.0) == pytest.approx(1.0)
    assert t.retry_after("203.0.113.8", now=0.0) == 0  # another address keeps its budget
    assert t.retry_after("::ffff:203.0.113.7", now=0.0) > 0  # the same IPv4 address, mapped
    assert t.retry_after("203.0.113.7", now=1.5) == 0  # refilled one failure's worth
    # one IPv6 host holds a /64: its addresses share one budget
    for i in range(3):
        t.failed(f"2001:db8::{i + 1}", now=0.0)
    assert t.retry_after("2001:db8::ffff", now=0.0) > 0
    assert t.retry_after("2001:db8:0:1::1", now=0.0) == 0
    # memory: at most max_addresses tracked, the least recently failing forgotten first
    for i in range(1000):
        t.failed(f"198.51.{i // 256}.{i % 256}", now=2.0)
    assert len(t) == 100
