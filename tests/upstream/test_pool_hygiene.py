"""The chat leg's connection pool never hands one client's request bytes that were not its own
answer: a pooled connection that receives anything while idle, or more than the one answer
it was asked for, is closed instead of reused (a raw upstream that writes unsolicited HTTP
answers on its keep-alive connections plays the misbehaving server)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from proxy.state import UPSTREAMS
from tests.conftest import eventually
from tests.support.raw_chat_upstream import ChatUpstream, answer_for, json_answer, completion, sse_answer

FAKE_TEXT = "LEAKED-answer-meant-for-nobody"
ROUNDS = 4


def fake(stream: bool) -> bytes:
    return sse_answer(FAKE_TEXT) if stream else json_answer(completion(FAKE_TEXT))


async def ask(proxy, text: str, stream: bool) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses",
                             json={"model": "tiny-org/tiny-model", "input": text, "stream": stream},
                             headers={"Authorization": f"Bearer {proxy.api_key}"},
                             timeout=aiohttp.ClientTimeout(total=20)) as resp:
            return resp.status, (await resp.read()).decode()


async def start(make_proxy, upstream: ChatUpstream):
    return await make_proxy({"health": {"enabled": False}}, workers=[upstream.worker()])


async def wait_idle_closed(proxy) -> None:
    """Until the pool has no idle connection (the old code never closed one)."""
    await eventually(lambda: not proxy.app[UPSTREAMS].stats()["idle"], what="the idle connection closed")


@pytest.mark.parametrize("stream", [False, True])
async def test_unsolicited_bytes_on_an_idle_connection_close_it(make_proxy, stream):
    written: list[asyncio.Event] = []

    async def behave(n, chat, writer):
        writer.write(answer_for(chat))
        await writer.drain()
        await asyncio.sleep(0.05)  # the proxy has pooled the connection by now
        writer.write(fake(chat.get("stream")))  # nobody asked for this one
        await writer.drain()
        written[-1].set()
        return True

    async with ChatUpstream(behave) as upstream:
        proxy = await start(make_proxy, upstream)
        for i in range(ROUNDS):
            written.append(asyncio.Event())
            status, body = await ask(proxy, f"client-A-{i}", stream)
            assert status == 200 and f"client-A-{i}" in body and FAKE_TEXT not in body, body
            await written[-1].wait()
            await wait_idle_closed(proxy)
            status, body = await ask(proxy, f"client-B-{i}", stream)
            assert status == 200, body
            assert FAKE_TEXT not in body and f"client-B-{i}" in body and "client-A" not in body, body
            await written[-1].wait()
            await wait_idle_closed(proxy)
        # every connection got stray bytes while idle: none was used twice
        assert upstream.chat_connections == 2 * ROUNDS


@pytest.mark.parametrize("stream", [False, True])
async def test_a_second_answer_behind_the_first_never_reaches_the_next_request(make_proxy, stream):
    """The server answers twice in one write: the first answer is the request's own, the
    second must not be kept on the connection for the next client."""

    async def behave(n, chat, writer):
        writer.write(answer_for(chat) + fake(chat.get("stream")))
        return True

    async with ChatUpstream(behave) as upstream:
        proxy = await start(make_proxy, upstream)
        for i in range(ROUNDS):
            status, body = await ask(proxy, f"client-{i}", stream)
            assert status == 200, body
            assert FAKE_TEXT not in body and f"client-{i}" in body, body
        # each answer's connection was closed, never pooled with the stray answer on it
        assert upstream.chat_connections == ROUNDS


async def test_an_answer_arriving_after_the_request_went_out_does_not_shift_later_answers(make_proxy):
    """A stray answer that lands after the next request was written cannot be told from that
    request's own (HTTP/1.1 has no request ids); but the real answer behind it is then extra
    bytes: the connection is dropped there, so the shift never reaches a third client."""

    async def behave(n, chat, writer):
        if n == 1:
            writer.write(fake(False) + answer_for(chat))
            return True
        return None

    async with ChatUpstream(behave) as upstream:
        proxy = await start(make_proxy, upstream)
        await ask(proxy, "first", False)
        await ask(proxy, "second", False)  # gets the stray answer, or fails: either way not a later one
        for i in range(ROUNDS):
            status, body = await ask(proxy, f"later-{i}", False)
            assert status == 200 and f"later-{i}" in body and "second" not in body and FAKE_TEXT not in body, body


async def test_pool_unit_idle_data_marks_the_connection_dead():
    """proxy.upstream.client directly: bytes on an idle pooled connection close it at once."""
    from multidict import CIMultiDict

    from proxy.upstream.client import UpstreamPool

    writers: list[asyncio.StreamWriter] = []

    async def serve(reader, writer):
        writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(json_answer(b'{"n": %d}' % len(writers)))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = UpstreamPool()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = CIMultiDict({"Content-Type": "application/json"})
    try:
        answer = await pool.post(url, headers, b"{}", connect_timeout=2)
        assert orjson.loads(await answer.read_capped(1000)) == {"n": 1}
        answer.release()
        assert pool.stats() == {"in_use": 0, "idle": 1}
        writers[0].write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nXX")
        await writers[0].drain()
        await eventually(lambda: pool.stats()["idle"] == 0, what="the connection that got stray bytes closed")
        answer = await pool.post(url, headers, b"{}", connect_timeout=2)
        assert orjson.loads(await answer.read_capped(1000)) == {"n": 2}
        answer.release()
    finally:
        await pool.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("stream", [False, True])
async def test_interim_1xx_answers_are_skipped(make_proxy, stream):
    async def behave(n, chat, writer):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the interim answer is read on its own
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # and the early hints on their own
        writer.write(answer_for(chat))
        return True

    async with ChatUpstream(behave) as upstream:
        proxy = await start(make_proxy, upstream)
        for i in range(3):
            status, body = await ask(proxy, f"after-1xx-{i}", stream)
            assert status == 200 and f"after-1xx-{i}" in body, body
        assert upstream.chat_connections == 1  # the 1xx answers did not cost the connection


async def test_switching_protocols_is_a_bad_response(make_proxy):
    async def behave(n, chat, writer):
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
        return True

    async with ChatUpstream(behave) as upstream:
        proxy = await start(make_proxy, upstream)
        status, body = await ask(proxy, "upgrade", False)
        assert status == 502 and orjson.loads(body)["error"]["code"] == "upstream_unreachable", body
