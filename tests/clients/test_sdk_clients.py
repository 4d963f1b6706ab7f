"""The openai Python SDK, unchanged, against the proxy (every policy on: auth, balance...).

responses.create / responses.stream / responses.input_tokens.count, the exception class of
every refusal, compressed request bodies, and every top-level field of the Response object.
"""

from __future__ import annotations

import gzip

import aiohttp
import httpx2 as httpx
import openai
import orjson
import pytest
import zstandard
from openai.types.responses import Response

from tests.support.sdk_check import check_sequence, parse_sse, validate_response, validate_sdk_response
from tests.conftest import POLICIES, only
from proxy.ledger import KeyLimits

PIPELINE = only(*POLICIES)  # every policy: auth (demo key), balance...
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
RESPONSE_FIELDS = set(Response.model_fields)


@pytest.fixture
async def proxy(make_proxy):
    return await make_proxy(PIPELINE)


def assert_every_field(response: dict, sdk_dump: bool = False) -> None:
    missing = RESPONSE_FIELDS - set(response)
    assert not missing, f"Response fields missing: {sorted(missing)}"
    for tool in response.get("tools") or []:
        if tool.get("type") == "function":
            assert "strict" in tool, tool
    # an SDK object's dump is not what the proxy sent: the spec judged those bytes in the transport
    (validate_sdk_response if sdk_dump else validate_response)(response)


async def test_create(sim, proxy):
    client = proxy.openai()
    sim.script({"reasoning": "Short answer.", "text": "Paris."})
    response = await client.responses.create(model="tiny-org/tiny-model", instructions="Be brief.",
                                             input="Capital of France?", max_output_tokens=50)
    assert isinstance(response, Response)
    assert response.output_text == "Paris."
    assert response.id.startswith("resp_") and response.status == "completed"
    assert response.instructions == "Be brief." and response.max_output_tokens == 50
    assert response.output[0].type == "reasoning" and response.output[1].type == "message"
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert_every_field(response.model_dump(mode="json"), sdk_dump=True)


async def test_stream_accumulator_with_a_tool_call(sim, proxy):
    client = proxy.openai()
    sim.script({"reasoning": "I need the weather.", "text": "Let me check.",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})
    seen = []
    async with client.responses.stream(model="tiny-org/tiny-model", input="Weather in Paris?", tools=[WEATHER]) as stream:
        async for event in stream:
            seen.append(event.type)
        final = await stream.get_final_response()
    assert seen[0] == "response.created" and seen[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in seen and "response.output_text.delta" in seen
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    call = final.output[2]
    assert call.name == "get_weather" and orjson.loads(call.arguments) == {"city": "Paris"}
    assert final.output_text == "Let me check."
    assert final.usage is not None and final.usage.output_tokens > 0
    echoed = final.tools[0]
    assert echoed.name == "get_weather" and echoed.strict is None  # echoed with strict, null: not sent
    assert_every_field(final.model_dump(mode="json"), sdk_dump=True)
    # the stream ended with the spec's data: [DONE] after response.completed; the SDK took it
    assert [end.endswith(b"}\n\ndata: [DONE]\n\n") for end in proxy.spec.stream_ends] == [True]


async def test_stream_text_helper_and_create_stream(sim, proxy):
    client = proxy.openai()
    sim.script({"text": "One, two, three."}, {"text": "Four."})
    async with client.responses.stream(model="tiny-org/tiny-model", input="Count.") as stream:
        text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
    assert text == "One, two, three."
    events = [e async for e in await client.responses.create(model="tiny-org/tiny-model", input="More.", stream=True)]
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Four."
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_input_tokens_count(sim, proxy):
    client = proxy.openai()
    counted = await client.responses.input_tokens.count(model="tiny-org/tiny-model", input="hello there",
                                                        instructions="Be brief.", tools=[WEATHER])
    assert counted.input_tokens > 0
    sim.script({"text": "ok"})
    answered = await client.responses.create(model="tiny-org/tiny-model", input="hello there", instructions="Be brief.",
                                             tools=[WEATHER])
    assert answered.usage.input_tokens == counted.input_tokens


# --------------------------------------------------------------------------- errors


async def test_400_bad_request(proxy):
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.openai().responses.create(model="tiny-org/tiny-model", input="hi", temperature=5)
    assert caught.value.status_code == 400 and caught.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.openai().responses.create(model="tiny-org/tiny-model", input="hi", previous_response_id="resp_1")
    assert caught.value.code == "stateless_only"


async def test_401_authentication(proxy):
    with pytest.raises(openai.AuthenticationError) as caught:
        await proxy.openai(api_key="sk-rp-wrong").responses.create(model="tiny-org/tiny-model", input="hi")
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


async def test_402_insufficient_quota(sim, proxy):
    secret, _ = await proxy.ledger.create_key("broke", balance_micros=0)
    with pytest.raises(openai.APIStatusError) as caught:
        await proxy.openai(api_key=secret).responses.create(model="tiny-org/tiny-model", input="hi")
    assert caught.value.status_code == 402
    assert caught.value.code == "insufficient_quota"
    # Streamed too: the SDK accepts JSON, so the refusal stays an HTTP 402 before any event.
    with pytest.raises(openai.APIStatusError) as caught:
        async with proxy.openai(api_key=secret).responses.stream(model="tiny-org/tiny-model", input="hi") as stream:
            await stream.get_final_response()
    assert caught.value.status_code == 402 and caught.value.code == "insufficient_quota"
    assert sim.requests == []


async def test_402_as_an_event_for_an_event_stream_only_client(sim, proxy):
    """Codex (Accept: text/event-stream) reads a spent balance only from response.failed."""
    secret, _ = await proxy.ledger.create_key("broke", balance_micros=0)
    body = {"model": "tiny-org/tiny-model", "input": "hi", "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json=body, headers={
                "Authorization": f"Bearer {secret}", "Accept": "text/event-stream"}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            events = parse_sse(await resp.read())
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
        failed = events[-1]["response"]
        assert failed["error"]["code"] == "insufficient_quota" and failed["x_should_retry"] is False
        assert failed["id"] == events[0]["response"]["id"] and failed["status"] == "failed"
        assert RESPONSE_FIELDS <= set(failed)
        # JSON accepted, or no stream: the HTTP 402 envelope.
        for accept, stream in (("application/json", True), ("text/event-stream", False)):
            async with http.post(proxy.url + "/v1/responses", json={**body, "stream": stream}, headers={
                    "Authorization": f"Bearer {secret}", "Accept": accept}) as resp:
                assert resp.status == 402
                assert (await resp.json())["error"]["code"] == "insufficient_quota"
    assert sim.requests == []


async def test_404_not_found(proxy):
    with pytest.raises(openai.NotFoundError) as caught:
        await proxy.openai().responses.create(model="no-such-model", input="hi")
    assert caught.value.status_code == 404


async def test_429_rate_limit(sim, proxy):
    sim.script({"status": 429, "message": "busy"})
    with pytest.raises(openai.RateLimitError) as caught:
        await proxy.openai().responses.create(model="tiny-org/tiny-model", input="hi")
    assert caught.value.status_code == 429


async def test_429_concurrency_limit_of_a_key(sim, proxy):
    secret, record = await proxy.ledger.create_key("one-at-a-time", balance_micros=10**9,
                                                   limits=KeyLimits(concurrency=1))
    sim.script({"text": "slow " * 40, "delay": 0.05})
    client = proxy.openai(api_key=secret)
    async with client.responses.stream(model="tiny-org/tiny-model", input="long") as first:
        async for event in first:
            if event.type == "response.output_text.delta":
                break
        with pytest.raises(openai.RateLimitError):
            await client.responses.create(model="tiny-org/tiny-model", input="second")


@pytest.mark.parametrize("status", [500, 503])
async def test_5xx_internal_server_error(sim, proxy, status):
    sim.script(*[{"status": status, "message": "upstream broke"}] * 3)
    with pytest.raises(openai.InternalServerError) as caught:
        await proxy.openai().responses.create(model="tiny-org/tiny-model", input="hi")
    assert caught.value.status_code >= 500


# --------------------------------------------------------------------------- compressed bodies


def _compressing_client(proxy, encoding: str) -> openai.AsyncOpenAI:
    """The SDK with an httpx transport that compresses each request body (as Codex does)."""

    class Compress(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()
            self.sent = 0

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = request.read()
            packed = gzip.compress(body) if encoding == "gzip" else zstandard.ZstdCompressor().compress(body)
            headers = dict(request.headers)
            headers["content-encoding"] = encoding
            headers["content-length"] = str(len(packed))
            self.sent += 1
            return await self.inner.handle_async_request(
                httpx.Request(request.method, request.url, headers=headers, content=packed))

        async def aclose(self) -> None:
            await self.inner.aclose()

    transport = Compress()
    client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=proxy.api_key, max_retries=0,
                                http_client=httpx.AsyncClient(transport=transport))
    client._test_transport = transport  # type: ignore[attr-defined]
    return client


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
async def test_compressed_request_bodies(sim, proxy, encoding):
    client = _compressing_client(proxy, encoding)
    sim.script({"text": "decompressed fine"}, {"text": "streamed fine"})
    response = await client.responses.create(model="tiny-org/tiny-model", input="x" * 5000)
    assert response.output_text == "decompressed fine"
    assert sim.requests[-1]["messages"][-1]["content"] == "x" * 5000
    async with client.responses.stream(model="tiny-org/tiny-model", input="y" * 100) as stream:
        final = await stream.get_final_response()
    assert final.output_text == "streamed fine"
    assert client._test_transport.sent == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
async def test_corrupt_compressed_body_is_a_400(proxy, encoding):
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", data=b"\x28\xb5\x2f\xfd garbage",
                             headers={"Authorization": f"Bearer {proxy.api_key}", "Content-Type": "application/json",
                                      "Content-Encoding": encoding}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "invalid_body"


# --------------------------------------------------------------------------- the Response object


async def test_every_top_level_field_everywhere(sim, proxy):
    """JSON answer, and the response inside created / in_progress / completed / incomplete / failed."""
    body = {"model": "tiny-org/tiny-model", "input": "hi", "tools": [WEATHER, {**WEATHER, "name": "strict_one",
                                                                      "strict": True}]}
    headers = {"Authorization": f"Bearer {proxy.api_key}"}
    sim.script({"text": "ok"}, {"text": "ok"}, {"text": " ".join(["word"] * 40)}, {"text": "a b c d e f",
                                                                                      "error_after": 2})
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json=body, headers=headers) as resp:
            answer = await resp.json()
        assert_every_field(answer)
        assert [t["strict"] for t in answer["tools"]] == [None, True]
        for extra, terminal in [({}, "response.completed"), ({"max_output_tokens": 3}, "response.incomplete"),
                                ({}, "response.failed")]:
            async with http.post(proxy.url + "/v1/responses", json={**body, **extra, "stream": True},
                                 headers=headers) as resp:
                events = parse_sse(await resp.read())
            check_sequence(events)
            assert events[-1]["type"] == terminal
            for event in events:
                if "response" in event:
                    assert_every_field(event["response"])
    assert RESPONSE_FIELDS <= set(answer)
