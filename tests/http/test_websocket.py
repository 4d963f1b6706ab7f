"""The Responses WebSocket transport (GET /v1/responses, Open Responses 2026-04-24): the
openai SDK's `responses.connect()` and a plain aiohttp WebSocket client against a real proxy
and simulator. Every event is judged by the spec's published types and the SDK's."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from aiohttp import WSMsgType
from openai.types.responses.responses_server_event import ResponseWsError
from openresponses_types import types as spec_types

from proxy.ledger import KeyLimits
from tests.conftest import eventually, unchanged_for
from tests.support.sdk_check import check_sequence, normalise, parse_sse, validate_spec_ws_error

MODEL = "tiny-org/tiny-model"
PRICES = {"default": {"input": 1_000_000, "cached_input": 1_000_000, "output": 1_000_000}}
TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


def ws_url(proxy) -> str:
    return proxy.url + "/v1/responses"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def turn(ws, body: dict) -> list[dict]:
    """Send one response.create; -> every message up to its terminal event (or error)."""
    await ws.send_str(orjson.dumps({"type": "response.create", **body}).decode())
    return await until_terminal(ws)


async def until_terminal(ws) -> list[dict]:
    events = []
    while True:
        msg = await ws.receive()
        assert msg.type == WSMsgType.TEXT, msg
        event = orjson.loads(msg.data)
        events.append(event)
        if event["type"] in TERMINAL:
            return events


def error_of(events: list[dict]) -> dict:
    assert len(events) == 1 and events[0]["type"] == "error", events
    validate_spec_ws_error(events[0])  # strict, and only documented fields beyond the spec
    ResponseWsError.model_validate(events[0], strict=True)  # the openai SDK's WebSocket error event
    return events[0]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def test_sdk_connect_runs_turns_and_continues_them(sim, make_proxy):
    proxy = await make_proxy({})
    client = proxy.openai()
    sim.script({"tool_calls": [{"name": "lookup", "arguments": {"q": "tides"}}]}, {"text": "High tide at noon."})
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
    async with client.responses.connect() as connection:
        await connection.response.create(model=MODEL, input="When is high tide?", tools=tools, store=False)
        first = check_sequence(await _events(connection))
        call = first["output"][-1]
        assert call["type"] == "function_call" and call["name"] == "lookup"
        await connection.response.create(model=MODEL, previous_response_id=first["id"], tools=tools,
                                         input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "noon"}])
        final = check_sequence(await _events(connection))
    assert final["status"] == "completed" and final["output"][-1]["content"][0]["text"] == "High tide at noon."
    assert final["previous_response_id"] == first["id"]
    # The second turn reached the model with the whole conversation the socket remembered.
    messages = sim.requests[-1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[0]["content"] == "When is high tide?" and messages[2]["content"] == "noon"


async def _events(connection) -> list[dict]:
    """One turn's events as sent (the SDK parses each one too)."""
    events = []
    while True:
        raw = await connection.recv_bytes()
        parsed = connection.parse_event(raw)
        events.append(orjson.loads(raw))
        assert parsed.type == events[-1]["type"]
        if parsed.type in TERMINAL:
            return events


async def test_socket_events_equal_the_http_stream(sim, make_proxy, http):
    """The same event objects, in the same order, with the same sequence numbers."""
    proxy = await make_proxy({})
    body = {"model": MODEL, "input": "Say something.", "reasoning": {"effort": "low"}}
    sim.script({"text": "one two three", "reasoning": "thinking it over"})
    async with http.post(proxy.url + "/v1/responses", json={**body, "stream": True},
                         headers=auth(proxy.api_key)) as resp:
        over_http = parse_sse(await resp.read())
    sim.script({"text": "one two three", "reasoning": "thinking it over"})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        over_ws = await turn(ws, body)
    check_sequence(over_ws)  # each event judged by the spec's types and the SDK's
    assert [(e["type"], e["sequence_number"]) for e in over_ws] == [(e["type"], e["sequence_number"]) for e in over_http]
    assert normalise(over_ws[-1]["response"]) == normalise(over_http[-1]["response"])


async def test_handshake_needs_the_key(sim, make_proxy, http):
    proxy = await make_proxy({})
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        async with http.ws_connect(ws_url(proxy)):
            pass
    assert refused.value.status == 401
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        async with http.ws_connect(ws_url(proxy), headers=auth("sk-rp-not-a-key")):
            pass
    assert refused.value.status == 401
    assert sim.requests == []


async def test_get_without_an_upgrade_is_405(make_proxy, http):
    proxy = await make_proxy({})
    async with http.get(ws_url(proxy), headers=auth(proxy.api_key)) as resp:
        assert resp.status == 405
        assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}


async def test_unknown_and_evicted_ids_are_previous_response_not_found(sim, make_proxy, http):
    proxy = await make_proxy({})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        unknown = error_of(await turn(ws, {"model": MODEL, "previous_response_id": "resp_nowhere", "input": "x"}))
        assert unknown["status"] == 400 and unknown["error"]["code"] == "previous_response_not_found"
        assert unknown["error"]["param"] == "previous_response_id"
        first = (await turn(ws, {"model": MODEL, "input": "hello"}))[-1]["response"]
        second = (await turn(ws, {"model": MODEL, "previous_response_id": first["id"], "input": "more"}))[-1]["response"]
        # Only the last response is kept: the first can no longer be continued.
        older = error_of(await turn(ws, {"model": MODEL, "previous_response_id": first["id"], "input": "x"}))
        assert older["error"]["code"] == "previous_response_not_found"
        # A continuation turn that fails evicts the response it continued.
        failed = error_of(await turn(ws, {"model": MODEL, "previous_response_id": second["id"], "input": "x",
                                          "temperature": 7}))
        assert failed["status"] == 400 and failed["error"]["code"] != "previous_response_not_found"
        evicted = error_of(await turn(ws, {"model": MODEL, "previous_response_id": second["id"], "input": "x"}))
        assert evicted["error"]["code"] == "previous_response_not_found"
    # A new socket knows nothing of the old one's responses: nothing was stored.
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        gone = error_of(await turn(ws, {"model": MODEL, "previous_response_id": second["id"], "input": "x"}))
        assert gone["error"]["code"] == "previous_response_not_found"


async def test_http_still_refuses_previous_response_id(sim, make_proxy, http):
    proxy = await make_proxy({})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        response = (await turn(ws, {"model": MODEL, "input": "hello"}))[-1]["response"]
        async with http.post(proxy.url + "/v1/responses", headers=auth(proxy.api_key),
                             json={"model": MODEL, "previous_response_id": response["id"], "input": "x"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("message, code, param", [
    (b"not json", "invalid_json", None),
    (b"[1]", "invalid_json", None),
    (b'{"type": "response.cancel"}', "invalid_event_type", "type"),
    (b'{"type": "response.create", "model": "tiny-org/tiny-model", "background": true}', "invalid_request", "background"),
    (b'{"type": "response.create", "model": "tiny-org/tiny-model", "stream": false}', "invalid_request", "stream"),
    (b'{"type": "response.create", "model": "tiny-org/tiny-model", "stream_options": {}}', "invalid_request", "stream_options"),
    (b'{"type": "response.create", "input": "no model"}', None, "model"),
])
async def test_bad_messages_get_error_events_and_the_socket_stays(sim, make_proxy, http, message, code, param):
    proxy = await make_proxy({})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        await ws.send_str(message.decode())
        error = error_of(await until_terminal(ws))
        assert error["status"] == 400 and error["error"]["param"] == param
        if code is not None:
            assert error["error"]["code"] == code
        events = await turn(ws, {"model": MODEL, "input": "still here?"})
        assert events[-1]["type"] == "response.completed"


async def test_turns_wait_in_order_one_in_flight(sim, make_proxy, http):
    proxy = await make_proxy({})
    sim.script({"text": "first answer", "delay": 0.02}, {"text": "second answer"})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        for text in ("one", "two"):
            await ws.send_str(orjson.dumps({"type": "response.create", "model": MODEL, "input": text}).decode())
        first, second = await until_terminal(ws), await until_terminal(ws)
    assert first[-1]["response"]["output"][-1]["content"][0]["text"] == "first answer"
    assert second[-1]["response"]["output"][-1]["content"][0]["text"] == "second answer"
    assert [e["sequence_number"] for e in second] == list(range(len(second)))


async def _usage(ledger, key_id: str) -> list:
    return await eventually(lambda: ledger.list_usage(key_id), what=f"a usage row of {key_id}")


async def test_a_turn_is_billed_exactly_as_the_http_request(sim, make_proxy, http):
    proxy = await make_proxy({"prices": PRICES})
    body = {"model": MODEL, "input": "Bill me the same.", "max_output_tokens": 64}
    billed = []
    for transport in ("http", "websocket"):
        secret, record = await proxy.ledger.create_key(transport, balance_micros=1_000_000)
        sim.script({"text": "the same five words here"})
        if transport == "http":
            async with http.post(proxy.url + "/v1/responses", json={**body, "stream": True}, headers=auth(secret)) as r:
                assert r.status == 200
                await r.read()
        else:
            async with http.ws_connect(ws_url(proxy), headers=auth(secret)) as ws:
                assert (await turn(ws, body))[-1]["type"] == "response.completed"
        (usage,) = await _usage(proxy.ledger, record.key_id)
        key = await proxy.ledger.get_key(record.key_id)
        billed.append((usage.status, usage.input_tokens, usage.output_tokens, usage.cost_micros,
                       1_000_000 - key.balance_micros))
    assert billed[0] == billed[1] and billed[0][3] > 0, billed


async def test_each_turn_meets_the_balance(sim, make_proxy, http):
    """The balance policy runs per turn, on the open socket: a turn the key cannot pay is a
    402 error event; after a top-up the next turn runs."""
    proxy = await make_proxy({"prices": PRICES})
    secret, record = await proxy.ledger.create_key("poor", balance_micros=1)
    async with http.ws_connect(ws_url(proxy), headers=auth(secret)) as ws:
        broke = error_of(await turn(ws, {"model": MODEL, "input": "hi", "max_output_tokens": 16}))
        assert broke["status"] == 402 and broke["error"]["code"] == "insufficient_quota"
        await proxy.ledger.top_up(record.key_id, 1_000_000)
        sim.script({"text": "paid"})
        assert (await turn(ws, {"model": MODEL, "input": "hi", "max_output_tokens": 16}))[-1]["type"] == "response.completed"
    assert len(sim.requests) == 1


async def test_a_vanished_client_cancels_its_turn_and_is_billed(sim, make_proxy, http):
    proxy = await make_proxy({"prices": PRICES})
    secret, record = await proxy.ledger.create_key("leaver", balance_micros=1_000_000)
    sim.script({"text": " ".join(["slow"] * 200), "delay": 0.05})
    ws = await http.ws_connect(ws_url(proxy), headers=auth(secret))
    await ws.send_str(orjson.dumps({"type": "response.create", "model": MODEL, "input": "x"}).decode())
    deltas = 0
    while deltas < 3:
        deltas += orjson.loads((await ws.receive()).data)["type"] == "response.output_text.delta"
    await ws.close()
    (usage,) = await _usage(proxy.ledger, record.key_id)
    assert usage.status == "cancelled" and 3 <= usage.output_tokens < 200 and usage.cost_micros > 0
    await eventually(lambda: sim.cancelled, what="the upstream request cancelled")
    assert sim.cancelled == 1 and sim.in_flight == 0
    assert (await proxy.ledger.get_key(record.key_id)).balance_micros == 1_000_000 - usage.cost_micros


async def test_connection_limit_reached(sim, make_proxy, http):
    proxy = await make_proxy({"websocket": {"max_connection_minutes": 0.005}})  # 0.3 s
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        limit = error_of(await until_terminal(ws))  # sent by the server when the time is up
        closing = await ws.receive()
    spec_types.WebSocketErrorEvent.model_validate(limit)
    assert limit["error"]["code"] == "websocket_connection_limit_reached"
    assert closing.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING)


async def test_idle_socket_is_closed(make_proxy, http):
    proxy = await make_proxy({"websocket": {"idle_timeout_s": 0.2}})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        msg = await ws.receive()
    assert msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSED) and ws.close_code == aiohttp.WSCloseCode.GOING_AWAY


async def test_websocket_can_be_turned_off(make_proxy, http):
    proxy = await make_proxy({"websocket": {"enabled": False}})
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)):
            pass
    assert refused.value.status == 405


async def test_warm_up_generates_nothing_and_is_continued(sim, make_proxy, http):
    proxy = await make_proxy({})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        warm = await turn(ws, {"model": MODEL, "input": "context first", "generate": False})
        final = check_sequence(warm)
        assert final["output"] == [] and final["usage"]["total_tokens"] == 0 and sim.requests == []
        done = await turn(ws, {"model": MODEL, "previous_response_id": final["id"], "input": "now answer"})
    assert done[-1]["type"] == "response.completed"
    assert [m["content"] for m in sim.requests[0]["messages"]] == ["context first", "now answer"]


async def test_a_slow_reader_stalls_the_upstream(make_proxy, http):
    """As on HTTP (tests/http/test_backpressure.py): sending a message waits for the socket to
    drain, so a client that stops reading stops the proxy reading its upstream."""
    from tests.http.test_backpressure import CHUNKS, TEXT, LongUpstream

    async with LongUpstream() as upstream:
        proxy = await make_proxy({}, workers=[{"name": "long", "url": upstream.url, "models": [MODEL],
                                               "timeouts": {"connect": 2, "first_byte": 10, "idle": 60, "total": 120}}])
        async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key), max_msg_size=0) as ws:
            await ws.send_str(orjson.dumps({"type": "response.create", "model": MODEL, "input": "a lot"}).decode())
            assert orjson.loads((await ws.receive()).data)["type"] == "response.created"
            # the client reads nothing now: wait until the upstream stops (no progress for 1 s)
            await eventually(unchanged_for(lambda: upstream.written, 1.0),
                             what="the upstream's writes to stop while the client reads nothing")
            total = CHUNKS * (len(TEXT) + 150)
            assert not upstream.finished and upstream.written < total / 2, (upstream.written, total)
            events = await until_terminal(ws)  # reading again: the rest arrives
        assert events[-1]["type"] in ("response.completed", "response.incomplete") and upstream.finished


async def test_a_sockets_turns_stay_on_one_worker(sim, make_proxy, http):
    """Prompt-cache affinity keys each turn on its leading messages, which a continuation keeps:
    the socket's turns reach the worker that holds their prefix cache."""
    from proxy.simulator.server import Simulator

    async with Simulator() as other:
        workers = [{"name": name, "url": s.url, "dialect": "vllm", "models": [MODEL],
                    "timeouts": {"connect": 2, "first_byte": 10, "idle": 10, "total": 60}}
                   for name, s in (("a", sim), ("b", other))]
        proxy = await make_proxy({}, workers=workers)
        for conversation in range(4):
            before = (len(sim.requests), len(other.requests))
            async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
                previous = None
                for i in range(3):
                    body = {"model": MODEL, "input": f"conversation {conversation}, turn {i}"}
                    if previous is not None:
                        body["previous_response_id"] = previous
                    previous = (await turn(ws, body))[-1]["response"]["id"]
            added = sorted((len(sim.requests) - before[0], len(other.requests) - before[1]))
            assert added == [0, 3], added


async def test_the_operators_tool_policy_applies_to_each_turn(sim, make_proxy, http):
    proxy = await make_proxy({"tools": {"refuse": ["web_search"], "drop": []}})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        refused = error_of(await turn(ws, {"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}))
        assert refused["status"] == 400 and refused["error"]["code"] == "unsupported_tool"
        assert (await turn(ws, {"model": MODEL, "input": "x"}))[-1]["type"] == "response.completed"
    assert len(sim.requests) == 1


async def test_the_server_pings_and_closes_a_peer_that_does_not_answer(make_proxy, http):
    proxy = await make_proxy({"websocket": {"ping_interval_s": 0.2}})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key), autoping=False) as ws:
        ping = await ws.receive()
        assert ping.type == WSMsgType.PING  # and no pong goes back
        while (msg := await ws.receive()).type == WSMsgType.PING:
            pass
    assert msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING)


async def test_each_turn_meets_the_rate_limit(sim, make_proxy, http):
    """The limits policy runs per turn, not once per handshake: a key allowed one request a
    minute gets its second turn refused as a 429 error event carrying Retry-After."""
    proxy = await make_proxy({})
    secret, _ = await proxy.ledger.create_key("one-a-minute", balance_micros=10_000_000,
                                              limits=KeyLimits(rate_per_min=1))
    async with http.ws_connect(ws_url(proxy), headers=auth(secret)) as ws:
        sim.script({"text": "first"})
        assert (await turn(ws, {"model": MODEL, "input": "one"}))[-1]["type"] == "response.completed"
        limited = error_of(await turn(ws, {"model": MODEL, "input": "two"}))
    assert limited["status"] == 429 and limited["error"]["code"] == "rate_limit_exceeded"
    assert int(limited["error"]["retry_after"]) >= 1
    assert len(sim.requests) == 1


async def test_a_custom_middlewares_own_stream_on_a_turn_is_an_error_event(sim, make_proxy, http):
    """A custom middleware that prepares an event stream of its own on a turn must not write
    HTTP onto the socket (the turn shares the handshake's connection): the turn is a 500 error
    event and the socket stays usable."""
    proxy = await make_proxy({"middlewares": {"before_handler": [{"tests.support.fault_mw:create": {"mode": "own_stream"}}]}})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        for _ in range(2):
            failed = error_of(await turn(ws, {"model": MODEL, "input": "x"}))
            assert failed["status"] == 500 and failed["error"]["code"] == "internal_error"
    assert sim.requests == []


WEB_SEARCH_TURN = {"model": MODEL, "input": "What is new?", "tools": [{"type": "web_search"}]}


async def test_a_turns_notices_reach_the_socket(sim, make_proxy, http):
    """The notices HTTP sends in x-token-notice come on the turn's response.created as a
    `headers` object (as OpenAI's WebSocket mode carries a response's headers on its events),
    judged by the spec's types and the SDK's like every other event."""
    proxy = await make_proxy({})
    sim.script({"text": "No search here."})
    async with http.post(proxy.url + "/v1/responses", json={**WEB_SEARCH_TURN, "stream": True},
                         headers=auth(proxy.api_key)) as resp:
        notice = resp.headers["x-token-notice"]
        over_http = parse_sse(await resp.read())
    assert "web_search" in notice and all("headers" not in e for e in over_http)  # HTTP: the header only
    sim.script({"text": "No search here."})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        events = await turn(ws, WEB_SEARCH_TURN)
        quiet = await turn(ws, {"model": MODEL, "input": "Nothing to say about this one."})
    check_sequence(events)
    assert events[0]["type"] == "response.created" and events[0]["headers"] == {"x-token-notice": notice}
    assert all("headers" not in e for e in events[1:])  # once per turn, on its first event
    assert [(e["type"], e["sequence_number"]) for e in events] == [(e["type"], e["sequence_number"]) for e in over_http]
    check_sequence(quiet)
    assert all("headers" not in e for e in quiet)  # a turn with nothing to say says nothing


async def test_the_sdk_connection_reads_a_turns_notices(sim, make_proxy):
    proxy = await make_proxy({"notices": {"header": "x-proxy-notes"}})
    sim.script({"text": "No search here."})
    async with proxy.openai().responses.connect() as connection:
        await connection.response.create(**WEB_SEARCH_TURN)
        events = await _events(connection)
        created = connection.parse_event(orjson.dumps(events[0]))
    check_sequence(events)
    assert created.type == "response.created" and "web_search" in created.model_extra["headers"]["x-proxy-notes"]


async def test_a_refused_turns_notices_reach_the_socket(sim, make_proxy, http):
    """A turn refused after a notice was made (a hosted tool left out, then no balance): the
    error event carries the notice as the HTTP error envelope's header does."""
    proxy = await make_proxy({"prices": PRICES})
    secret, _ = await proxy.ledger.create_key("poor", balance_micros=1)
    async with http.post(proxy.url + "/v1/responses", json=WEB_SEARCH_TURN, headers=auth(secret)) as resp:
        assert resp.status == 402
        notice = resp.headers["x-token-notice"]
    async with http.ws_connect(ws_url(proxy), headers=auth(secret)) as ws:
        broke = error_of(await turn(ws, WEB_SEARCH_TURN))
    assert broke["status"] == 402 and broke["headers"] == {"x-token-notice": notice}
    assert sim.requests == []


ORPHAN = {"type": "function_call_output", "call_id": "call_openresponses_missing",
          "output": "No matching tool call exists in the previous response."}


async def test_a_failed_continuation_evicts_the_response_as_the_spec_suite_expects(sim, make_proxy, http):
    """The Open Responses suite's websocket-failed-continuation-evicts-cache, turn by turn: a
    continuation whose only item is a tool output answering no call fails (OpenAI's 400), the
    socket stays open, the response it continued is gone (previous_response_not_found), and a
    new turn on the same socket runs."""
    proxy = await make_proxy({})
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        seed = await turn(ws, {"model": MODEL, "store": False, "input": "Remember the code word: ember. Reply with OK."})
        first = check_sequence(seed)
        assert first["status"] == "completed"
        failed = error_of(await turn(ws, {"model": MODEL, "store": False, "previous_response_id": first["id"],
                                          "input": [ORPHAN]}))
        assert failed["status"] == 400
        assert failed["error"]["message"] == ("No tool call found for function call output with call_id "
                                              "call_openresponses_missing.")
        assert failed["error"]["param"] == "input"
        retry = error_of(await turn(ws, {"model": MODEL, "store": False, "previous_response_id": first["id"],
                                         "input": "Try to continue after the failed turn. Reply with exactly: stale"}))
        assert retry["status"] == 400 and retry["error"]["code"] == "previous_response_not_found"
        again = check_sequence(await turn(ws, {"model": MODEL, "store": False, "input": "Start over."}))
        assert again["status"] == "completed"
    # Over HTTP the same item is the same refusal.
    async with http.post(proxy.url + "/v1/responses", headers=auth(proxy.api_key),
                         json={"model": MODEL, "input": [{"role": "user", "content": "hi"}, ORPHAN]}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"] == {k: v for k, v in failed["error"].items()}


async def test_a_continuation_answers_the_calls_it_remembers(sim, make_proxy, http):
    """The tool output of a continuation answers a call of the remembered response: the input
    the check reads is the whole conversation the socket expands, not the message alone."""
    proxy = await make_proxy({})
    sim.script({"tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}]}, {"text": "done"})
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}]
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        first = check_sequence(await turn(ws, {"model": MODEL, "input": "look it up", "tools": tools}))
        call = first["output"][-1]
        done = check_sequence(await turn(ws, {"model": MODEL, "previous_response_id": first["id"], "tools": tools,
                                              "input": [{"type": "function_call_output", "call_id": call["call_id"],
                                                         "output": "found"}]}))
    assert done["status"] == "completed"


@pytest.mark.parametrize("bad_item, param", [
    ({"type": "message", "role": "robot", "content": "hi"}, "input[1].role"),
    ({"type": "message", "role": "user", "content": [{"type": "input_text", "text": 5}]}, "input[1].content[0].text"),
    (ORPHAN, "input"),
])
async def test_a_refused_turns_error_equals_the_http_error(sim, make_proxy, http, bad_item, param):
    """The same items refused over HTTP and in a socket's continuation: the same error object
    (code, type, message), its param naming the item as the client sent it, never its place in
    the history the socket expanded."""
    proxy = await make_proxy({})
    items = [{"type": "message", "role": "user", "content": "first"}, bad_item]
    async with http.post(proxy.url + "/v1/responses", headers=auth(proxy.api_key),
                         json={"model": MODEL, "input": items}) as resp:
        assert resp.status == 400
        over_http = (await resp.json())["error"]
    assert over_http["param"] == param
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        alone = error_of(await turn(ws, {"model": MODEL, "input": items}))
        first = check_sequence(await turn(ws, {"model": MODEL, "input": "before"}))
        continued = error_of(await turn(ws, {"model": MODEL, "previous_response_id": first["id"], "input": items}))
    assert continued["error"]["param"] == param  # not its index in the expanded history
    assert isinstance(over_http["code"], str)  # the socket's error event needs one: HTTP has the same
    assert alone["error"] == over_http
    assert continued["error"] == over_http


async def test_unknown_fields_and_store_true_are_named_on_both_transports(sim, make_proxy, http):
    """Accepted (200, the turn runs), never silently: HTTP's x-token-notice, the socket's
    headers on response.created, the same words."""
    proxy = await make_proxy({})
    request = {"model": MODEL, "input": "hello", "colour": "blue", "store": True}
    async with http.post(proxy.url + "/v1/responses", json=request, headers=auth(proxy.api_key)) as resp:
        assert resp.status == 200
        notice = resp.headers["x-token-notice"]
        assert (await resp.json())["status"] == "completed"
    assert "unknown field(s) ignored: colour" in notice and "nothing is stored" in notice
    async with http.ws_connect(ws_url(proxy), headers=auth(proxy.api_key)) as ws:
        events = await turn(ws, request)
        plain = await turn(ws, {"model": MODEL, "input": "hello", "store": False, "generate": True})
    check_sequence(events)
    assert events[0]["headers"] == {"x-token-notice": notice}
    assert all("headers" not in e for e in plain)  # known fields, store false: nothing to say
