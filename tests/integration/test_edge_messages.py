"""Anthropic's Messages API through the edge, with the anthropic SDK unchanged: messages.create,
messages.stream, count_tokens; the key as x-api-key; errors in Anthropic's envelope; billed from
message_start / message_delta usage on a /v1/messages row."""

from __future__ import annotations

import anthropic
import pytest

from middlewares.balance import wait_for_settlements

MODEL = "tiny-org/tiny-model"
PRICES = {"prices": {"default": {"input": 1.0, "output": 2.0}}}


def _client(proxy, key: str | None = None) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key=key or proxy.api_key, max_retries=0)


async def _rows(proxy):
    await wait_for_settlements(proxy.app)
    return await proxy.ledger.list_usage()


async def test_messages_create_is_billed_from_its_usage(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    sim.script({"text": "Bonjour tout le monde"})
    message = await _client(proxy).messages.create(model=MODEL, max_tokens=64,
                                                   messages=[{"role": "user", "content": "Hi"}])
    assert message.content[0].text == "Bonjour tout le monde" and message.stop_reason == "end_turn"
    assert sim.requests[-1]["_path"] == "/v1/messages" and sim.requests[-1]["max_tokens"] == 64
    (row,) = await _rows(proxy)
    assert row.endpoint == "/v1/messages" and row.status == "completed"
    assert (row.input_tokens, row.output_tokens) == (message.usage.input_tokens, message.usage.output_tokens)


async def test_messages_stream_passes_events_through(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    sim.script({"text": "one two three"})
    async with _client(proxy).messages.stream(model=MODEL, max_tokens=64,
                                              messages=[{"role": "user", "content": "Hi"}]) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "one two three" and final.usage.output_tokens == 3
    (row,) = await _rows(proxy)
    assert row.endpoint == "/v1/messages" and row.output_tokens == 3 and row.input_tokens == final.usage.input_tokens


async def test_messages_tools(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    sim.script({"text": "", "tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}})
    tools = [{"name": "get_weather", "description": "weather",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    message = await _client(proxy).messages.create(model=MODEL, max_tokens=64, tools=tools,
                                                   messages=[{"role": "user", "content": "Weather?"}])
    use = [b for b in message.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and message.stop_reason == "tool_use"


async def test_count_tokens_is_free(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    counted = await _client(proxy).messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert counted.input_tokens > 0
    assert await _rows(proxy) == []


async def test_errors_are_in_anthropics_envelope(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await _client(proxy, "sk-wrong").messages.create(model=MODEL, max_tokens=5,
                                                          messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                            "message": caught.value.body["error"]["message"]}}
    secret, _ = await proxy.ledger.create_key("empty", balance_micros=0)
    with pytest.raises(anthropic.APIStatusError) as caught:
        await _client(proxy, secret).messages.create(model=MODEL, max_tokens=5,
                                                     messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.status_code == 402 and caught.value.body["error"]["type"] == "billing_error"
    with pytest.raises(anthropic.NotFoundError):
        await _client(proxy).messages.create(model="nobody/serves-this", max_tokens=5,
                                             messages=[{"role": "user", "content": "Hi"}])


async def test_a_worker_without_v1_messages_is_named_in_a_404(make_proxy, sim, http):
    from aiohttp import web

    async def not_found(request):
        return web.json_response({"detail": "Not Found"}, status=404)

    app = web.Application()
    app.router.add_post("/v1/messages", not_found)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        proxy = await make_proxy({"health": {"enabled": False}}, workers=[{"name": "old-sglang", "url": f"http://127.0.0.1:{port}",
                                           "dialect": "sglang", "models": [MODEL]}])
        async with http.post(proxy.url + "/v1/messages", headers={"x-api-key": proxy.api_key},
                             json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
                             ) as resp:
            body = await resp.json()
        assert resp.status == 404 and body["type"] == "error" and "old-sglang" in body["error"]["message"]
    finally:
        await runner.cleanup()
