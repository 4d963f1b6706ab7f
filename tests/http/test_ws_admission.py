"""Connection admission on the WebSocket transport, tried as hostile clients: a key that opens
socket after socket, a deflating client whose small frames inflate to megabytes, messages
queued behind a slow turn, a ping flood, a flood of refused turns, and a close frame sent while
a turn runs with more queued behind it."""

from __future__ import annotations

import asyncio
import zlib

import aiohttp
import orjson
import pytest
from aiohttp import WSMsgType

from proxy.ledger import KeyLimits
from tests.conftest import eventually

MODEL = "tiny-org/tiny-model"


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _create(**body) -> bytes:
    return orjson.dumps({"type": "response.create", "model": MODEL, "input": "hi", **body})


async def _next_event(ws) -> dict | None:
    msg = await ws.receive(timeout=10)
    if msg.type != WSMsgType.TEXT:
        return None
    return orjson.loads(msg.data)


async def _until_end(ws) -> dict | None:
    while True:
        event = await _next_event(ws)
        if event is None or event["type"] in ("error", "response.completed", "response.failed", "response.incomplete"):
            return event


async def test_sockets_are_bounded_per_key_and_in_all(make_proxy):
    proxy = await make_proxy({"websocket": {"max_sockets_per_key": 3, "max_sockets": 5}})
    one, _ = await proxy.ledger.create_key("one", balance_micros=1_000_000)
    two, _ = await proxy.ledger.create_key("two", balance_micros=1_000_000)
    async with aiohttp.ClientSession() as http:
        mine = [await http.ws_connect(proxy.url + "/v1/responses", headers=_auth(one)) for _ in range(3)]
        try:
            await http.ws_connect(proxy.url + "/v1/responses", headers=_auth(one))
            raise AssertionError("a fourth socket of one key was admitted")
        except aiohttp.WSServerHandshakeError as exc:
            assert exc.status == 429
        theirs = [await http.ws_connect(proxy.url + "/v1/responses", headers=_auth(two)) for _ in range(2)]
        try:  # 5 open in all
            await http.ws_connect(proxy.url + "/v1/responses", headers=_auth(two))
            raise AssertionError("a sixth socket was admitted")
        except aiohttp.WSServerHandshakeError as exc:
            assert exc.status == 429
        await mine[0].close()

        async def admitted():
            try:
                return await http.ws_connect(proxy.url + "/v1/responses", headers=_auth(one))
            except aiohttp.WSServerHandshakeError as exc:
                assert exc.status == 429
                return None

        again = await eventually(admitted, what="the closed socket's place freed")  # a closed one frees its place
        for ws in (*mine, *theirs, again):
            await ws.close()


async def test_an_inflated_message_is_bounded_while_it_inflates(make_proxy):
    proxy = await make_proxy({"websocket": {"max_message_bytes": 1_000_000}})
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(proxy.url + "/v1/responses", headers=_auth(proxy.api_key), compress=15) as ws:
            assert ws.compress  # permessage-deflate was negotiated
            padding = "a" * 4_000_000  # ~4 KB on the wire, 4 MB inflated
            await ws.send_bytes(_create(instructions=padding))
            msg = await ws.receive(timeout=10)
            assert msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSED), msg
            assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    assert len(zlib.compress(padding.encode())) < 10_000


async def test_messages_queued_behind_a_slow_turn_are_bounded_in_bytes_as_inflated(make_proxy, sim):
    proxy = await make_proxy({"websocket": {"max_queued_bytes": 600_000, "max_queued_turns": 8}})
    sim.script({"text_words": 40, "delay": 0.05})
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(proxy.url + "/v1/responses", headers=_auth(proxy.api_key), compress=15) as ws:
            await ws.send_bytes(_create())
            assert (await _next_event(ws))["type"] == "response.created"
            # 3 x 250 KB inflated (a few hundred bytes each on the wire) > 600 KB: the third is the
            # one past the bound, and nothing is sent after it (a send onto the closed socket
            # would end it as 1006 on this side, hiding the server's close code).
            for _ in range(3):
                await ws.send_bytes(_create(instructions="b" * 250_000))
            events = []
            while True:
                event = await _next_event(ws)
                if event is None:
                    break
                events.append(event)
            errors = [e for e in events if e["type"] == "error"]
            assert errors and errors[-1]["error"]["code"] == "websocket_queue_full", events[-3:]
            assert ws.close_code == aiohttp.WSCloseCode.POLICY_VIOLATION


@pytest.mark.parametrize("queued", [3, 7])
async def test_a_close_frame_cancels_the_turn_in_flight_and_drops_the_queued_ones(make_proxy, sim, queued):
    """7 queued: more than max_queued_turns (4), as the attack sent: a reader that stopped
    reading at the bound never saw the close, and the queued turns ran (and were billed) after it."""
    proxy = await make_proxy({})
    sim.script(*[{"text_words": 200, "delay": 0.05}] * 8)
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(proxy.url + "/v1/responses", headers=_auth(proxy.api_key))
        await ws.send_bytes(_create())
        assert (await _next_event(ws))["type"] == "response.created"
        for _ in range(queued):
            await ws.send_bytes(_create())
        await ws.close()  # the close frame; the TCP connection stays until the server answers it
    await eventually(lambda: sim.state.cancelled >= 1, what="the turn in flight cancelled by the close")
    assert sim.state.cancelled == 1, "the turn in flight ran on after the close"
    await asyncio.sleep(0.5)  # not a wait: the time a queued turn would need to reach the model, if it ran
    assert len(sim.requests) == 1, "a queued turn reached the model after the close"


async def test_a_ping_flood_closes_the_socket_and_spares_other_clients(make_proxy):
    proxy = await make_proxy({"websocket": {"max_control_frames_per_s": 10}})
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(proxy.url + "/v1/responses", headers=_auth(proxy.api_key), autoping=False) as ws:
            for _ in range(1000):
                await ws.ping(b"x")
            closed = None
            for _ in range(1100):
                msg = await ws.receive(timeout=10)
                if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING):
                    closed = msg
                    break
            assert closed is not None and ws.close_code == aiohttp.WSCloseCode.POLICY_VIOLATION
        async with http.ws_connect(proxy.url + "/v1/responses", headers=_auth(proxy.api_key)) as ws:
            await ws.send_bytes(_create())
            assert (await _until_end(ws))["type"] == "response.completed"


async def test_limits_refuse_a_message_before_it_is_parsed(make_proxy, sim):
    """A spent rate is a 429 for what follows, whatever it is: the message is not read (an
    invalid one would be a 400 if it were), and the queue it would have joined holds."""
    proxy = await make_proxy({})
    secret, _ = await proxy.ledger.create_key("one-a-minute", balance_micros=10_000_000,
                                              limits=KeyLimits(rate_per_min=1))
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(proxy.url + "/v1/responses", headers=_auth(secret)) as ws:
            await ws.send_bytes(_create())
            assert (await _until_end(ws))["type"] == "response.completed"
            for message in (b"{not json", _create(input=[{"type": "message"}] * 100_000)):
                await ws.send_bytes(message)
                event = await _until_end(ws)
                assert event["type"] == "error" and event["status"] == 429, event
                assert event["error"]["code"] == "rate_limit_exceeded"
    assert len(sim.requests) == 1


@pytest.mark.parametrize("why", ["rate", "balance"])
async def test_a_socket_whose_turns_keep_being_refused_is_closed_and_its_key_not_compressed(make_proxy, sim, why):
    """A spent rate or balance: each refused message still cost its inflating (8 MB out of a few
    kB) and decoding. After max_refused_turns in a row the socket is closed (1008), and the key's
    next socket negotiates no permessage-deflate: what it sends is what the proxy reads."""
    proxy = await make_proxy({"prices": {"default": {"input": 1_000_000, "output": 1_000_000}},
                              "websocket": {"refuse_sockets_s": 0.5}})
    limits = KeyLimits(rate_per_min=1) if why == "rate" else KeyLimits()
    secret, _ = await proxy.ledger.create_key("refused", balance_micros=10_000_000 if why == "rate" else 0,
                                              limits=limits)
    padding = "x" * (4 << 20)  # 4 MiB inflated, ~4 kB on the wire
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(proxy.url + "/v1/responses", headers=_auth(secret), compress=15) as ws:
            assert ws.compress
            if why == "rate":
                await ws.send_bytes(_create())
                assert (await _until_end(ws))["type"] == "response.completed"
            for _ in range(3):
                await ws.send_bytes(_create(instructions=padding))
                event = await _until_end(ws)
                assert event["type"] == "error" and event["status"] in (402, 429), event
            closing = await ws.receive()
            assert closing.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING), closing
            assert ws.close_code == 1008
        # For refuse_sockets_s its handshakes get the refusal as a plain HTTP answer: a reconnect
        # per three turns would cost a handshake each (~3x a refused request).
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(proxy.url + "/v1/responses", headers=_auth(secret), compress=15)
        assert refused.value.status == (429 if why == "rate" else 402)
        assert int(refused.value.headers["Retry-After"]) >= 1
        await asyncio.sleep(0.6)  # not a wait: time passes, past the refusal's window
        async with http.ws_connect(proxy.url + "/v1/responses", headers=_auth(secret), compress=15) as ws:
            assert not ws.compress  # refused a moment ago: no compression to amplify
        async with http.ws_connect(proxy.url + "/v1/responses", headers=_auth(proxy.api_key), compress=15) as ws:
            assert ws.compress  # another key is not touched
