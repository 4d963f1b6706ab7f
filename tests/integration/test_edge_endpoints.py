"""The model server's other APIs through the edge (proxy.http.passthrough_handler), with real clients:
the openai SDK's chat.completions.create (plain, stream, tools), completions.create and
embeddings.create; each billed from the upstream's usage, on a usage row naming its endpoint."""

from __future__ import annotations

import json

import openai
import orjson
import pytest

from middlewares.balance import wait_for_settlements
from proxy.ledger import KeyLimits

MODEL = "tiny-org/tiny-model"
PRICES = {"prices": {"default": {"input": 1.0, "output": 2.0}}}


async def _rows(proxy):
    await wait_for_settlements(proxy.app)
    return await proxy.ledger.list_usage()


def _cost(inp: int, out: int) -> int:
    return inp * 1 + out * 2  # micros at 1 / 2 per million tokens... per token in micros


async def test_chat_plain_is_the_upstreams_answer_and_billed_on_a_chat_row(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    sim.script({"text": "Hello there friend"})
    client = proxy.openai()
    answer = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=50)
    assert answer.choices[0].message.content == "Hello there friend"
    sent = sim.requests[-1]
    assert sent["messages"] == [{"role": "user", "content": "Hi"}] and sent["max_tokens"] == 50
    assert "stream_options" not in sent
    (row,) = await _rows(proxy)
    assert row.endpoint == "/v1/chat/completions" and row.status == "completed"
    assert (row.input_tokens, row.output_tokens) == (answer.usage.prompt_tokens, answer.usage.completion_tokens)
    assert row.served_model == MODEL and row.worker == "sim"


async def test_chat_stream_passes_chunks_through_and_hides_the_usage_chunk_it_asked_for(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    sim.script({"text": "one two three four"})
    client = proxy.openai()
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  stream=True, max_tokens=50)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three four"
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)  # no usage chunk shown
    assert sim.requests[-1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    (row,) = await _rows(proxy)
    assert row.endpoint == "/v1/chat/completions" and row.output_tokens == 4 and row.input_tokens > 0


async def test_chat_stream_with_usage_asked_keeps_the_usage_chunk(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    client = proxy.openai()
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  stream=True, max_tokens=20, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and not chunks[-1].choices
    (row,) = await _rows(proxy)
    assert (row.input_tokens, row.output_tokens) == (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens)


async def test_chat_tools_come_back_as_tool_calls(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    sim.script({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})
    client = proxy.openai()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    answer = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                                  tools=tools, max_tokens=100)
    call = answer.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert sim.requests[-1]["tools"] == tools
    sim.script({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]})
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                                  tools=tools, max_tokens=100, stream=True)
    args = "".join([c.choices[0].delta.tool_calls[0].function.arguments or ""
                    async for c in stream if c.choices and c.choices[0].delta.tool_calls])
    assert json.loads(args) == {"city": "Oslo"}


async def test_embeddings_and_completions_through_the_sdk(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    client = proxy.openai()
    emb = await client.embeddings.create(model=MODEL, input=["hello world", "bye"])
    assert len(emb.data) == 2 and emb.usage.prompt_tokens > 0
    done = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert done.choices[0].text and done.usage.completion_tokens <= 5
    stream = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True)
    texts = [c.choices[0].text async for c in stream if c.choices]
    assert texts and all(isinstance(t, str) for t in texts)
    rows = {r.endpoint: r for r in await _rows(proxy)}
    assert set(rows) == {"/v1/embeddings", "/v1/completions"}
    assert rows["/v1/embeddings"].input_tokens == emb.usage.prompt_tokens and rows["/v1/embeddings"].output_tokens == 0


async def test_the_resolved_model_goes_upstream_and_the_keys_models_apply(make_proxy, sim):
    proxy = await make_proxy(PRICES)
    client = proxy.openai()
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert sim.requests[-1]["model"] == MODEL
    secret, _ = await proxy.ledger.create_key("limited", balance_micros=10_000_000,
                                              limits=KeyLimits(allowed_models=["other/model"]))
    with pytest.raises(openai.PermissionDeniedError):
        await proxy.openai(secret).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])


async def test_a_low_balance_lowers_max_tokens_with_a_notice(make_proxy, sim, http):
    proxy = await make_proxy({"prices": {"default": {"input": 1_000_000.0, "output": 1_000_000.0}}})
    secret, _ = await proxy.ledger.create_key("poor", balance_micros=2_000)
    async with http.post(proxy.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                               "max_tokens": 10_000}) as resp:
        assert resp.status == 200, await resp.text()
        assert "max_output_tokens lowered" in resp.headers.get("x-token-notice", "")
    assert sim.requests[-1]["max_tokens"] < 10_000
    (row,) = await _rows(proxy)
    assert row.debited_micros <= 2_000


async def test_an_endpoint_can_be_turned_off(make_proxy, http):
    proxy = await make_proxy({"endpoints": {"embeddings": False}})
    async with http.post(proxy.url + "/v1/embeddings", headers={"Authorization": f"Bearer {proxy.api_key}"},
                         json={"model": MODEL, "input": "x"}) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "endpoint_disabled"
    async with http.get(proxy.url + "/v1/models", headers={"Authorization": f"Bearer {proxy.api_key}"}) as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]


async def test_a_turned_off_endpoint_is_a_404_after_auth_before_any_limit_or_body(make_proxy, http):
    """Its chain is auth, then the 404: no rate token taken, no byte of the body read (a body
    that is not JSON is a 404, not a 400), and without a key a
    401 (whether a path exists is not told to a caller without one). (Before: the switch was
    read in the translate step, after the limits had counted the request and the body was read.)"""
    proxy = await make_proxy({"endpoints": {"chat_completions": False}})
    secret, _ = await proxy.ledger.create_key("one a minute", 10_000_000, limits=KeyLimits(rate_per_min=1))
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    for _ in range(3):  # past the rate of one a minute: a 404 each time, never a 429
        async with http.post(proxy.url + "/v1/chat/completions", headers=headers, data=b"not json") as resp:
            assert resp.status == 404, await resp.text()
            assert (await resp.json())["error"]["code"] == "endpoint_disabled"
    async with http.post(proxy.url + "/v1/chat/completions", data=b"{}") as resp:
        assert resp.status == 401
    # The key's one request a minute is still there for an endpoint that is on.
    async with http.post(proxy.url + "/v1/responses", headers=headers,
                         json={"model": MODEL, "input": "hi"}) as resp:
        assert resp.status == 200, await resp.text()


async def test_upstream_errors_and_n_above_one(make_proxy, sim, http):
    proxy = await make_proxy()
    headers = {"Authorization": f"Bearer {proxy.api_key}"}
    async with http.post(proxy.url + "/v1/chat/completions", headers=headers,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 17}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "n"
    sim.script({"status": 400, "message": "bad things"})
    async with http.post(proxy.url + "/v1/chat/completions", headers=headers,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}) as resp:
        assert resp.status == 400 and "bad things" in (await resp.json())["error"]["message"]
    rows = await _rows(proxy)
    assert all(r.cost_micros == 0 for r in rows)


async def test_an_output_cap_the_window_has_no_room_for_is_lowered_as_vllm_does(make_proxy, http):
    """vLLM takes a max_tokens that the prompt leaves no room for and lowers it (the capture
    chat_prompt_plus_maxtokens_over); Claude Code asks 32,000 whatever the window. Through the edge
    too: never refused for it, one above the whole window is lowered to it; a prompt that does not
    fit at all is the model server's 400."""
    from proxy.simulator.server import Simulator

    async with Simulator(max_model_len=2048) as small:
        proxy = await make_proxy(PRICES, workers=[{"name": "small", "url": small.url, "dialect": "vllm",
                                                   "models": [MODEL]}])
        headers = {"Authorization": f"Bearer {proxy.api_key}"}
        prompt = "hello " * 300
        cases = [("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
                 ("/v1/messages", {"messages": [{"role": "user", "content": prompt}]})]
        for path, body in cases:
            for asked, sent in ((2000, 2000), (5000, 2048)):
                async with http.post(proxy.url + path, headers=headers,
                                     json={"model": MODEL, "max_tokens": asked, **body}) as resp:
                    assert resp.status == 200, (path, asked, await resp.text())
                assert small.requests[-1].get("_path", "/v1/chat/completions") == path
                assert small.requests[-1]["max_tokens"] == sent
        async with http.post(proxy.url + "/v1/chat/completions", headers=headers,
                             json={"model": MODEL, "max_tokens": 10,
                                   "messages": [{"role": "user", "content": "hello " * 3000}]}) as resp:
            error = (await resp.json())["error"]
        assert resp.status == 400 and error["code"] == "context_length_exceeded", error
