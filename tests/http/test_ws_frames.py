"""The batched frames of a WebSocket turn (proxy.http.websocket.send_messages: the events of one
write, JSON lines, in one transport write) against the general path (one aiohttp send_frame per
event): over real sockets, with and without permessage-deflate, the client receives the same
frames, byte for byte on the wire, the same messages in the same order."""

from __future__ import annotations

import asyncio
import base64
import os

import aiohttp
import orjson
import pytest
from aiohttp import WSMsgType, web

from proxy.http import websocket
from proxy.http.websocket import send_messages
from tests.conftest import free_port

MODEL = "tiny-org/tiny-model"
# Every length class of a frame header (< 126, 16-bit, 64-bit), text past ASCII, an empty one.
MESSAGES = [b'{"type":"a"}', b"", "é€😀".encode() * 10, b"x" * 125, b"y" * 126, b"z" * 65535,
            b"w" * 65536, b"v" * 200_000, b'{"type":"b","delta":"\\n"}']


async def _server(batched: bool, writers: list | None = None):
    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(compress=True)
        await ws.prepare(request)
        await ws.receive()  # the client's go
        if writers is not None:  # what send_messages finds: the writer it batches on, or None
            writers.append(websocket._plain_writer(ws))
        if batched:  # as JSON lines (turn.TurnStream's writes): blocks of one, several, none
            await send_messages(ws, b"".join(m + b"\n" for m in MESSAGES[:3]))
            await send_messages(ws, b"")
            await send_messages(ws, MESSAGES[3] + b"\n")
            await send_messages(ws, b"".join(m + b"\n" for m in MESSAGES[4:]))
        else:
            for message in MESSAGES:
                await ws.send_frame(message, WSMsgType.TEXT)
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/ws", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def _raw(port: int, deflate: bool) -> bytes:
    """Every byte the server sends after its handshake answer, up to its close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    ext = "Sec-WebSocket-Extensions: permessage-deflate\r\n" if deflate else ""
    writer.write((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{ext}\r\n").encode())
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), head
    assert (b"permessage-deflate" in head.lower()) == deflate
    writer.write(b"\x81\x82abcd" + bytes(c ^ m for c, m in zip(b"go", b"ab")))  # a masked text "go"
    data = bytearray()
    while True:  # frame by frame (the server sends none masked), up to its close frame
        head = await asyncio.wait_for(reader.readexactly(2), 10)
        n = head[1] & 0x7F
        extra = b"" if n < 126 else await reader.readexactly(2 if n == 126 else 8)
        if extra:
            n = int.from_bytes(extra, "big")
        data += head + extra + await reader.readexactly(n)
        if head[0] & 0x0F == 0x8:
            break
    writer.write(b"\x88\x82abcd" + bytes(c ^ m for c, m in zip(b"\x03\xe8", b"ab")))  # close 1000
    writer.close()
    return bytes(data)


@pytest.mark.parametrize("deflate", [False, True])
async def test_batched_frames_are_the_per_frame_bytes(deflate):
    wire = {}
    writers: list = []
    for batched in (False, True):
        runner, port = await _server(batched, writers)
        try:
            wire[batched] = await _raw(port, deflate)
        finally:
            await runner.cleanup()
    assert wire[True] == wire[False]
    # the batch path ran (not send_frame's fallback) wherever it can: no deflate
    assert [w is not None for w in writers] == [not deflate, not deflate]
    if not deflate:
        assert wire[True].startswith(b"\x81\x0c" + MESSAGES[0])


@pytest.mark.parametrize("compress", [0, 15])
async def test_batched_frames_are_the_same_messages(compress):
    got = {}
    for batched in (False, True):
        runner, port = await _server(batched)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.ws_connect(f"http://127.0.0.1:{port}/ws", compress=compress, max_msg_size=0) as ws:
                    await ws.send_str("go")
                    got[batched] = []
                    async for msg in ws:
                        got[batched].append((msg.type, msg.data))
        finally:
            await runner.cleanup()
    assert got[True] == got[False] == [(WSMsgType.TEXT, m.decode()) for m in MESSAGES]


# What differs between two runs of the same script: ids, clocks, and the simulator's prompt cache.
_CLOCKS = {"id", "item_id", "response_id", "created_at", "completed_at", "encrypted_content", "call_id",
           "previous_response_id", "input_tokens_details"}


def _normalised(value):
    if isinstance(value, dict):
        return {k: _normalised(v) for k, v in value.items() if k not in _CLOCKS}
    if isinstance(value, list):
        return [_normalised(v) for v in value]
    return value


async def _turns(sim, proxy, compress: int) -> list[list[dict]]:
    """Two turns on one socket (the second continues the first): every message of each."""
    turns = []
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(proxy.url + "/v1/responses", headers={"Authorization": f"Bearer {proxy.api_key}"},
                                   compress=compress) as ws:
            previous = None
            for text in ("one two three four five six seven eight nine ten " * 8, "short"):
                sim.script({"text": text, "reasoning": "thinking it over"})
                body = {"type": "response.create", "model": MODEL, "input": "Say something.",
                        "reasoning": {"effort": "low"}, **({"previous_response_id": previous} if previous else {})}
                await ws.send_str(orjson.dumps(body).decode())
                events = []
                while True:
                    msg = await ws.receive()
                    assert msg.type == WSMsgType.TEXT, msg
                    events.append(orjson.loads(msg.data))
                    if events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                        break
                previous = events[-1]["response"]["id"]
                turns.append(events)
    return turns


@pytest.mark.parametrize("compress", [0, 15])
async def test_a_turns_messages_are_the_same_batched_or_not(sim, make_proxy, monkeypatch, compress):
    proxy = await make_proxy({})
    got = {}
    for batched in (False, True):
        monkeypatch.setattr(websocket, "BATCH_FRAMES", batched)
        got[batched] = await _turns(sim, proxy, compress)
    assert got[True][1][-1]["response"]["previous_response_id"] == got[True][0][-1]["response"]["id"]
    assert [_normalised(t) for t in got[True]] == [_normalised(t) for t in got[False]]
    assert got[True][0][-1]["type"] == "response.completed" and len(got[True][0]) > 20


async def test_aiohttps_private_names_are_as_the_batch_writer_reads_them():
    """proxy.http.websocket._plain_writer and _write_frames read aiohttp's private names (it has
    no public batch send; the measured cost of its public per-frame send is in their comments).
    Each one is pinned here on the installed aiohttp, and the writer's flow control that
    _write_frames copies: an aiohttp release that renames, retypes or reshapes any of them fails
    this test (then measure again: adapt, or let send_messages take send_frame)."""
    import inspect

    from aiohttp._websocket.writer import WebSocketWriter
    from aiohttp.base_protocol import BaseProtocol

    # WebSocketResponse._writer: None until prepared, then the WebSocketWriter it sends with.
    assert web.WebSocketResponse()._writer is None
    prepare = inspect.getsource(web.WebSocketResponse)
    assert "writer = WebSocketWriter(" in prepare and "self._writer = writer" in prepare
    assert "await self._writer.send_frame(message, opcode, compress)" in prepare  # ws.send_frame: the writer's

    class Transport(asyncio.Transport):
        def is_closing(self) -> bool:
            return False

    protocol = BaseProtocol(asyncio.get_running_loop())
    transport = Transport()
    writer = WebSocketWriter(protocol, transport, limit=4096)
    assert writer.transport is transport and writer.protocol is protocol
    assert writer.compress == 0 and writer.use_mask is False
    assert writer._closing is False and writer._output_size == 0 and writer._limit == 4096
    assert protocol._paused is False
    assert inspect.iscoroutinefunction(BaseProtocol._drain_helper)
    assert list(inspect.signature(BaseProtocol._drain_helper).parameters) == ["self"]
    # The writer's own bookkeeping, as _write_frames repeats it for a batch.
    send = inspect.getsource(WebSocketWriter.send_frame)
    assert "if self._closing and not (opcode & WSMsgType.CLOSE):" in send
    assert "if self._output_size > self._limit:\n            self._output_size = 0\n" in send
    assert "if self.protocol._paused:\n                await self.protocol._drain_helper()" in send
    frame = inspect.getsource(WebSocketWriter._write_websocket_frame)
    assert "if self.transport.is_closing():" in frame
    assert "self._output_size += header_len + msg_length" in frame
    close = inspect.getsource(WebSocketWriter.close)
    assert "self._closing = True" in close
