"""Traces (proxy/runtime/tracing.py) against an OTLP/HTTP receiver started here, on loopback,
that decodes what it gets with the opentelemetry-proto package (ExportTraceServiceRequest), as
a collector does: one trace per request with its phases and its upstream attempt, the GenAI
attributes, the client's traceparent as the parent, the worker given the attempt's; no secret
and no prompt text unless asked; nothing at all with tracing off."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import eventually

collector = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
async def receiver():
    """(its traces URL, the spans it got: name -> list of (span, attributes as a dict))."""
    spans: list[tuple] = []

    async def traces(request: web.Request) -> web.Response:
        message = collector.ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    spans.append((span, {a.key: _value(a.value) for a in span.attributes}))
        return web.Response(body=collector.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1/traces", spans
    finally:
        await runner.cleanup()


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _tracing(url: str, **extra) -> dict:
    return {"tracing": {"endpoint": url, "export_delay_ms": 50, **extra}}


async def test_a_request_is_one_trace_with_its_phases_the_genai_attributes_and_the_clients_parent(
        make_proxy, receiver, sim):
    url, spans = receiver
    proxy = await make_proxy(_tracing(url))
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", headers={
                "Authorization": f"Bearer {proxy.api_key}", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
                json={"model": "tiny-org/tiny-model", "input": "a secret prompt", "max_output_tokens": 8}) as r:
            assert r.status == 200
            request_id = r.headers["x-request-id"]

    def server_span():
        return next((s for s in spans if s[1].get("responses_proxy.request_id") == request_id), None)

    await eventually(lambda: server_span() is not None and any(s[0].name == "upstream attempt" for s in spans),
                     30, what="the request's spans exported")
    span, attrs = server_span()
    assert span.trace_id.hex() == CLIENT_TRACE and span.parent_span_id.hex() == CLIENT_SPAN
    assert span.name == "POST /v1/responses" and span.kind == span.SPAN_KIND_SERVER
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "tiny-org/tiny-model"
    assert attrs["gen_ai.response.model"] and attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gen_ai.usage.output_tokens"] > 0 and attrs["gen_ai.response.finish_reasons"]
    assert attrs["http.response.status_code"] == 200 and attrs["responses_proxy.key_id"]
    trace = [s for s in spans if s[0].trace_id.hex() == CLIENT_TRACE]
    names = {s[0].name for s in trace}
    assert {"auth", "limits", "prepare", "balance", "upstream attempt"} <= names, names
    everything = json.dumps([a for _, a in trace])
    assert "a secret prompt" not in everything and proxy.api_key not in everything
    # The worker got the attempt span's context as its traceparent.
    (attempt,) = [s for s in trace if s[0].name == "upstream attempt"]
    sent = [tp for tp in sim.state.traceparents if tp]
    assert sent and sent[-1] == f"00-{CLIENT_TRACE}-{attempt[0].span_id.hex()}-01"


async def test_prompts_are_recorded_only_when_asked(make_proxy, receiver):
    url, spans = receiver
    proxy = await make_proxy(_tracing(url, record_prompts=True))
    await proxy.openai().responses.create(model="tiny-org/tiny-model", input="the words asked for",
                                          max_output_tokens=8)
    await eventually(lambda: any("the words asked for" in str(a.get("gen_ai.input.messages")) for _, a in spans),
                     30, what="the prompt in the span")


async def test_tracing_off_sends_nothing_and_no_traceparent_upstream(make_proxy, receiver, sim):
    url, spans = receiver
    proxy = await make_proxy({})
    await proxy.openai().responses.create(model="tiny-org/tiny-model", input="hi", max_output_tokens=8)
    assert sim.state.traceparents and all(tp is None for tp in sim.state.traceparents)
    assert spans == []
    from proxy.runtime import tracing

    assert tracing.ACTIVE is None


async def test_each_websocket_turn_is_a_span_under_its_sockets(make_proxy, receiver):
    import orjson

    url, spans = receiver
    proxy = await make_proxy(_tracing(url))
    async with aiohttp.ClientSession() as http, http.ws_connect(
            proxy.url + "/v1/responses", headers={"Authorization": f"Bearer {proxy.api_key}",
                                                  "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}) as ws:
        for _ in range(2):
            await ws.send_str(orjson.dumps({"type": "response.create", "model": "tiny-org/tiny-model",
                                            "input": "hi", "max_output_tokens": 8}).decode())
            while True:
                event = orjson.loads((await ws.receive()).data)
                if event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                    break
    await eventually(lambda: sum(1 for s, _ in spans if s.name == "turn") == 2
                     and any(s.name == "GET /v1/responses" for s, _ in spans), 30, what="the turns' spans")
    (socket,) = [s for s, _ in spans if s.name == "GET /v1/responses"]
    turns = [(s, a) for s, a in spans if s.name == "turn"]
    assert socket.trace_id.hex() == CLIENT_TRACE and socket.parent_span_id.hex() == CLIENT_SPAN
    handshake = {s.span_id: s for s, _ in spans if s.trace_id == socket.trace_id}
    for span, attrs in turns:
        assert span.trace_id == socket.trace_id and span.kind == span.SPAN_KIND_INTERNAL
        parent = handshake[span.parent_span_id]  # the handshake's innermost phase: up the chain, its span
        while parent.span_id != socket.span_id:
            parent = handshake[parent.parent_span_id]
        assert attrs["responses_proxy.transport"] == "websocket" and attrs["gen_ai.usage.output_tokens"] > 0
    assert len({a["responses_proxy.request_id"] for _, a in turns}) == 2
