"""Security: image URL policy (SSRF), credentials and headers on the upstream hop, upstream
error bodies without internals, keys hashed at rest and never logged, no unauthenticated
admin surface, no CR/LF from user input in any header we set."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.config import settings as config_settings
from proxy.policy.netguard import ImagePolicy, check_images, verdict_for_address
from tests.conftest import eventually

PUBLIC_ROUTES = {("POST", "/v1/responses"), ("POST", "/v1/responses/input_tokens"), ("GET", "/v1/models"),
                 ("GET", "/v1/responses"), ("POST", "/v1/responses/compact"),  # the WebSocket upgrade; compaction
                 ("GET", "/healthz"), ("GET", "/openapi.json"), ("GET", "/metrics"), ("HEAD", "/v1/models"),
                 ("HEAD", "/healthz"), ("HEAD", "/openapi.json"), ("HEAD", "/metrics"),
                 ("GET", "/livez"), ("HEAD", "/livez"), ("GET", "/readyz"), ("HEAD", "/readyz"),
                 ("GET", "/v1/key"), ("HEAD", "/v1/key"),  # /v1/key: the caller's own key, guarded by auth
                 # the model server's other APIs, passed through (proxy.http.passthrough_handler), guarded by auth
                 ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
                 ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")}


def image_body(url: str) -> dict:
    return {"model": "tiny-org/tiny-model", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": url}]}]}


async def post(proxy, payload, *, key: str | None = None, headers: dict | None = None, path="/v1/responses"):
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + path, data=orjson.dumps(payload),
                             headers={"Authorization": f"Bearer {key or proxy.api_key}",
                                      "Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, r.headers.copy(), await r.read()


REFUSED = [
    "http://127.0.0.1/a.png", "http://localhost:8080/a.png", "http://[::1]/a.png", "http://169.254.169.254/latest/",
    "http://10.0.0.5/a.png", "http://192.168.1.1/a.png", "http://172.16.0.1/", "http://100.64.0.1/",
    "http://0.0.0.0/", "http://2130706433/", "http://0x7f.1/", "http://127.1/", "http://[::ffff:127.0.0.1]/",
    "http://[fe80::1]/", "http://[fc00::1]/", "http://224.0.0.1/", "http://240.0.0.1/",
    "file:///etc/passwd", "ftp://example.com/a.png", "gopher://127.0.0.1/", "http://user:pw@8.8.8.8/a.png",
    "http://8.8.8.8\\@127.0.0.1/", "http://8.8.8.8/a b.png", "http:///a.png", "HTTP://127.0.0.1/",
]


@pytest.mark.parametrize("url", REFUSED)
async def test_private_and_odd_image_urls_are_refused(url):
    with pytest.raises(Exception) as info:
        await check_images(ImagePolicy(config_settings.of("images", {})), {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]})
    assert getattr(info.value, "status", None) == 400 and info.value.code == "image_url_refused"


async def test_public_and_data_urls_pass_and_policy_switches():
    public = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://8.8.8.8/cat.png"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}
    await check_images(ImagePolicy(config_settings.of("images", {})), public)
    private = {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                           "image_url": {"url": "http://10.1.2.3/x.png"}}]}]}
    await check_images(ImagePolicy(config_settings.of("images", {"allow_private": True})), private)
    await check_images(ImagePolicy(config_settings.of("images", {"allow_hosts": ["10.1.2.3"]})), private)
    with pytest.raises(Exception):
        await check_images(ImagePolicy(config_settings.of("images", {"allow_hosts": ["images.example.com"]})), public)
    assert verdict_for_address("8.8.8.8") is None and verdict_for_address("127.0.0.1")


async def test_dns_resolution_does_not_block_the_loop(monkeypatch):
    """A slow resolver costs the request its budget, not the event loop its responsiveness."""
    loop = asyncio.get_running_loop()

    async def slow(host, port, **kw):
        await asyncio.sleep(5)  # a resolver that hangs
        return []

    monkeypatch.setattr(loop, "getaddrinfo", slow)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    with pytest.raises(Exception) as info:
        await check_images(ImagePolicy(config_settings.of("images", {"resolve_timeout_s": 0.3})), {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://slow.example/x.png"}}]}]})
    task.cancel()
    assert info.value.status == 400 and ticks >= 10


async def test_private_image_url_refused_end_to_end_before_billing(sim, make_proxy):
    proxy = await make_proxy()
    sim.requests.clear()
    for url in ("http://127.0.0.1:1/x.png", "http://169.254.169.254/latest/meta-data/", "http://localhost/x"):
        status, _, raw = await post(proxy, image_body(url))
        assert status == 400 and orjson.loads(raw)["error"]["code"] == "image_url_refused"
        status, _, raw = await post(proxy, image_body(url), path="/v1/responses/input_tokens")
        assert status == 400
    assert sim.requests == []  # nothing reached the model server
    assert await proxy.ledger.holds() == [] and await proxy.ledger.list_usage() == []
    status, _, _ = await post(proxy, image_body("data:image/png;base64,iVBORw0KGgo="))
    assert status == 200


async def test_client_credentials_and_hop_by_hop_headers_never_reach_the_upstream(make_proxy):
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        await request.read()
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": "tiny-org/tiny-model",
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "ok"}}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    upstream = web.Application()
    upstream.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(upstream)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        # This upstream has no /v1/models or /health: no active check would ever let it in.
        proxy = await make_proxy({"health": {"enabled": False}}, workers=[{
            "name": "up", "url": f"http://127.0.0.1:{port}", "models": ["tiny-org/tiny-model"], "api_key": "worker-secret-1"}])
        status, _, raw = await post(proxy, {"model": "tiny-org/tiny-model", "input": "hi"}, headers={
            "Connection": "keep-alive, X-Secret-Hop", "X-Secret-Hop": "1", "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic abc", "TE": "trailers", "Upgrade": "h2c", "Cookie": "session=1",
            "X-Forwarded-For": "6.6.6.6", "OpenAI-Organization": "org-x"})
        assert status == 200, raw
    finally:
        await runner.cleanup()
    headers = seen[-1]
    assert headers["authorization"] == "Bearer worker-secret-1"  # the worker's key, never the client's
    assert proxy.api_key not in json.dumps(headers)
    for name in ("x-secret-hop", "keep-alive", "proxy-authorization", "te", "upgrade", "cookie", "openai-organization"):
        assert name not in headers, name


async def test_upstream_error_bodies_lose_their_internals(sim, make_proxy):
    proxy = await make_proxy()
    trace = ('boom at /srv/vllm/engine.py\nTraceback (most recent call last):\n  File "/usr/lib/python3.11/x.py", '
             'line 1\nValueError: secret internal state')
    for script in ({"status": 500, "body": f"<html><pre>{trace}</pre></html>"},
                   {"status": 400, "message": trace}, {"status": 404, "message": trace}):
        sim.script(script)
        status, _, raw = await post(proxy, {"model": "tiny-org/tiny-model", "input": "hi"})
        assert 400 <= status < 600 and status != 500, (status, raw)
        text = raw.decode()
        for leak in ("Traceback", "/srv/vllm", "/usr/lib", "secret internal state", "<html"):
            assert leak not in text, (leak, text)


async def test_api_keys_hashed_at_rest_and_never_logged(sim, make_proxy, tmp_path, capsys):
    proxy = await make_proxy()
    secret, _ = await proxy.ledger.create_key("alice", balance_micros=10_000_000)
    capsys.readouterr()
    for key in (proxy.api_key, secret, "sk-rp-not-a-real-key-000000000000000"):
        await post(proxy, {"model": "tiny-org/tiny-model", "input": "hi"}, key=key)
        async with aiohttp.ClientSession() as http:
            async with http.get(proxy.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
                await r.read()
    seen: list[str] = []

    def logged() -> bool:  # the access lines of the six requests
        captured = capsys.readouterr()
        seen.append(captured.out + captured.err)
        text = "".join(seen)
        return text.count("/v1/models") >= 3 and text.count("/v1/responses") >= 3

    await eventually(logged, what="the six requests' access lines")
    logs = "".join(seen)
    assert "request" in logs  # the access log was captured
    for key in (proxy.api_key, secret, "sk-rp-not-a-real-key"):
        assert key not in logs
    await proxy.runner.cleanup()  # flush and close the ledger
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("ledger.db*"))
    assert raw and secret.encode() not in raw and proxy.api_key.encode() not in raw


async def test_key_comparison_is_constant_time_by_construction():
    import inspect

    import middlewares.auth as auth
    from proxy.ledger.sqlite import ledger as sqlite

    assert "compare_digest" in inspect.getsource(auth)
    source = inspect.getsource(sqlite.SQLiteLedger.lookup_key)
    assert "compare_digest" in source or "secret_sha256" in source  # looked up by hash, never by secret


async def test_no_unauthenticated_admin_surface(sim, make_proxy):
    proxy = await make_proxy()
    routes = {(r.method, r.resource.canonical) for r in proxy.app.router.routes()}
    assert routes <= PUBLIC_ROUTES, routes - PUBLIC_ROUTES
    async with aiohttp.ClientSession() as http:
        for method, path in (("GET", "/sim/state"), ("POST", "/sim/script"), ("GET", "/admin"),
                             ("GET", "/v1/keys"), ("DELETE", "/v1/responses"), ("GET", "/debug/pprof")):
            async with http.request(method, proxy.url + path) as r:
                assert r.status in (404, 405), (method, path, r.status)
                assert set(await r.json()) == {"error"}
        for method, path in (("POST", "/v1/responses"), ("POST", "/v1/responses/input_tokens"), ("GET", "/v1/models"),
                             ("GET", "/v1/key"), ("GET", "/v1/responses"), ("POST", "/v1/responses/compact"),
                             ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"), ("POST", "/v1/messages")):
            async with http.request(method, proxy.url + path, json={"model": "tiny-org/tiny-model", "input": "x"}) as r:
                assert r.status == 401


@pytest.mark.parametrize("evil", ["a\r\nSet-Cookie: x=1", "a\nX-Injected: 1", "a\rb", "a\x00b", "é\u2028x"])
async def test_headers_we_set_carry_no_crlf_from_user_input(sim, make_proxy, evil):
    proxy = await make_proxy()
    payload = {"model": "tiny-org/tiny-model", "input": "hi", "max_output_tokens": 10**9,
               "tools": [{"type": "web_search", "name": evil}, {"type": "mcp", "server_label": evil}],
               "user": evil, "metadata": {"k": evil}, "prompt_cache_key": evil}
    reader, writer = await asyncio.open_connection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]))
    body = orjson.dumps(payload)
    writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + proxy.api_key.encode() + b"\r\nConnection: close\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 15)
    writer.close()
    head = raw.split(b"\r\n\r\n", 1)[0]
    lines = head.split(b"\r\n")
    assert re.match(rb"HTTP/1\.1 \d{3} ", lines[0])
    for line in lines[1:]:
        assert re.match(rb"^[A-Za-z0-9-]+: [\x20-\x7e\t]*$", line), line
        assert not line.lower().startswith((b"set-cookie", b"x-injected"))
