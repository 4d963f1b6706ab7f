"""The access line names who asked (key id, client address), what it cost (the ledger row's
cost) and why it failed (the envelope's error code), and never carries a secret.

Real HTTP against a proxy app with a SQLite ledger; the fields are taken where the one
access-log call hands them over (proxy.app.access), so no logging configuration leaks
between tests."""

from __future__ import annotations

import json

import orjson
import pytest

import proxy.app
from tests.conftest import eventually

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")
PRICES = {"default": {"input": 1_000_000, "cached_input": 100_000, "output": 1_000_000}}


@pytest.fixture
def lines(monkeypatch):
    found: list[dict] = []
    real = proxy.app.access

    def record(**fields):
        found.append(dict(fields))
        real(**fields)

    monkeypatch.setattr(proxy.app, "access", record)
    return found


async def model_of(http, p, key: str) -> str:
    async with http.get(p.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
        return (await r.json())["data"][0]["id"]


async def post(http, p, key: str, body: dict):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with http.post(p.url + "/v1/responses", data=orjson.dumps(body), headers=headers) as r:
        await r.read()
        return r.status, r.headers.get("x-request-id")


def line_of(lines: list[dict], request_id: str) -> dict:
    matching = [f for f in lines if f["request_id"] == request_id]
    assert len(matching) == 1, lines
    return matching[0]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_billed_request_names_its_key_client_and_cost(make_proxy, http, lines, stream):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    model = await model_of(http, p, secret)
    status, request_id = await post(http, p, secret, {"model": model, "input": "hello there", "stream": stream,
                                                      "max_output_tokens": 20})
    assert status == 200
    usage = await p.ledger.usage(request_id)
    line = line_of(lines, request_id)
    assert line["key_id"] == record.key_id
    assert line["client"] == "127.0.0.1"
    assert line["cost_micros"] == usage.cost_micros > 0
    assert line["error_code"] is None
    assert (line["input_tokens"], line["output_tokens"]) == (usage.input_tokens, usage.output_tokens)
    assert secret not in json.dumps(line) and secret[8:] not in json.dumps(line)


async def test_a_refused_key_logs_the_error_code_and_no_secret(make_proxy, http, lines):
    p = await make_proxy({"prices": PRICES})
    bogus = "sk-rp-" + "x" * 40
    status, request_id = await post(http, p, bogus, {"model": "m", "input": "hi"})
    assert status == 401
    line = line_of(lines, request_id)
    assert line["error_code"] == "invalid_api_key"
    assert line["key_id"] is None and line["client"] == "127.0.0.1"
    assert "xxxxxxxx" not in json.dumps(line)


async def test_a_spent_balance_logs_the_key_and_the_error_code(make_proxy, http, lines):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("broke", balance_micros=0)
    model = await model_of(http, p, secret)
    status, request_id = await post(http, p, secret, {"model": model, "input": "hello"})
    assert status == 402
    line = line_of(lines, request_id)
    assert (line["key_id"], line["error_code"], line.get("cost_micros")) == (record.key_id, "insufficient_quota", None)


async def test_an_unknown_route_has_a_line_without_a_key(make_proxy, http, lines):
    p = await make_proxy()
    async with http.get(p.url + "/v1/nothing") as r:
        assert r.status == 404
        request_id = r.headers.get("x-request-id")
    line = line_of(lines, request_id)
    assert line["key_id"] is None and line["client"] == "127.0.0.1" and line["status"] == 404


async def test_a_stream_cut_mid_way_logs_the_code_of_its_response_failed(make_proxy, http, lines):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    model = await model_of(http, p, secret)
    script = "SIM:" + json.dumps({"text": "one two three four five six seven eight", "drop_after": 3})
    status, request_id = await post(http, p, secret, {"model": model, "input": script, "stream": True})
    assert status == 200
    line = line_of(lines, request_id)
    assert (line["outcome"], line["error_code"], line["key_id"]) == ("failed", "upstream_disconnected", record.key_id)
    assert line["cost_micros"] == (await p.ledger.usage(request_id)).cost_micros


async def test_every_line_names_the_transport_that_carried_the_request(make_proxy, http, lines):
    """http for an HTTP request (refused, unknown route or answered); websocket for a socket's
    handshake and for each of its turns, answered or refused."""
    p = await make_proxy({"prices": PRICES})
    secret, _ = await p.ledger.create_key("payer", balance_micros=1_000_000)
    model = await model_of(http, p, secret)
    status, answered = await post(http, p, secret, {"model": model, "input": "hi", "max_output_tokens": 5})
    assert status == 200
    async with http.get(p.url + "/v1/nothing") as r:
        unknown = r.headers["x-request-id"]
    _, refused = await post(http, p, "sk-rp-" + "x" * 40, {"model": model, "input": "hi"})
    before = len(lines)
    async with http.ws_connect(p.url + "/v1/responses", headers={"Authorization": f"Bearer {secret}"}) as ws:
        for message in ({"type": "response.create", "model": model, "input": "hi", "max_output_tokens": 5},
                        {"type": "response.create", "model": model, "input": [{"type": "message", "role": "robot"}]}):
            await ws.send_str(orjson.dumps(message).decode())
            while orjson.loads((await ws.receive(timeout=30)).data)["type"] not in TERMINAL:
                pass
    # the handshake's line is written when the server has closed the socket
    await eventually(lambda: any(f["status"] == 101 for f in lines[before:]), what="the handshake's access line")
    for request_id in (answered, unknown, refused):
        assert line_of(lines, request_id)["transport"] == "http"
    over_socket = lines[before:]
    assert sorted(f["status"] for f in over_socket) == [101, 200, 400]  # the handshake, then the two turns
    assert {f["transport"] for f in over_socket} == {"websocket"}
    assert all("transport" in f for f in lines)


async def test_every_access_line_has_an_outcome_a_refusal_error(make_proxy, http, lines):
    p = await make_proxy({"prices": PRICES})
    secret, _ = await p.ledger.create_key("broke", balance_micros=0)
    refused = [await post(http, p, "sk-rp-" + "x" * 30, {"model": "m", "input": "hi"}),  # 401
               await post(http, p, secret, {"model": "tiny-org/tiny-model", "input": "hi"})]  # 402
    assert [status for status, _ in refused] == [401, 402]
    for _, request_id in refused:
        assert line_of(lines, request_id)["outcome"] == "error"
    async with http.get(p.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}) as r:
        assert r.status == 200
        answered = r.headers["x-request-id"]
    assert line_of(lines, answered)["outcome"] == "completed"
