"""Once the first byte of an answer went out, the only endings are a terminal event or a cut
connection: never a second HTTP response inside (or behind) the body. Before the first byte,
an upstream answer that is not an event stream, or is encoded, fails over like a bad JSON
answer does. Read with a raw socket client that parses the chunked framing strictly."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import orjson
import pytest

from proxy.protocol.rewriter import StreamRewriter
from tests.support.raw_chat_upstream import ChatUpstream, chunked, gzipped, json_answer, sse_events
from tests.support.sdk_check import parse_sse
from tests.conftest import only
from tests.support.paths import REPO


@dataclass
class Raw:
    status: int
    headers: dict[str, str]
    body: bytes  # the de-chunked body
    terminated: bool  # the terminating zero-size chunk came
    after: bytes  # bytes behind the end of the response (there must be none)
    raw: bytes = field(repr=False, default=b"")

    @property
    def events(self) -> list[dict]:
        return parse_sse(self.body)


def parse_response(data: bytes) -> Raw:
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, data[:200]
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), lines[0]
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding", "").lower() != "chunked":
        length = int(headers["content-length"])
        return Raw(status, headers, rest[:length], True, rest[length:], data)
    body = bytearray()
    pos = 0
    while True:
        end = rest.find(b"\r\n", pos)
        if end < 0:
            return Raw(status, headers, bytes(body), False, b"", data)  # cut inside a size line
        size_line = rest[pos:end]
        assert size_line and all(c in b"0123456789abcdefABCDEF" for c in size_line), \
            f"not a chunk size: {size_line[:80]!r}"
        size = int(size_line, 16)
        pos = end + 2
        if size == 0:
            assert rest[pos:pos + 2] == b"\r\n", rest[pos:pos + 80]  # no trailers
            return Raw(status, headers, bytes(body), True, rest[pos + 2:], data)
        if len(rest) < pos + size + 2:
            body += rest[pos:pos + size]
            return Raw(status, headers, bytes(body), False, b"", data)  # cut inside a chunk
        body += rest[pos:pos + size]
        assert rest[pos + size:pos + size + 2] == b"\r\n", "chunk not followed by CRLF"
        pos += size + 2


async def raw_post(proxy, payload: dict) -> Raw:
    """One POST on its own connection (Connection: close), read to the end of the connection."""
    port = int(proxy.url.rsplit(":", 1)[1])
    body = orjson.dumps(payload)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer %s\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                 % (proxy.api_key.encode(), len(body), body))
    data = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 20):
            data += chunk
    except ConnectionError:
        pass
    writer.close()
    return parse_response(data)


def assert_one_response(answer: Raw) -> None:
    assert b"HTTP/1." not in answer.body, answer.body[-300:]
    assert answer.after == b"", answer.after[:300]


STREAM = {"model": "tiny-org/tiny-model", "input": "hello there", "stream": True, "max_output_tokens": 50}
PIPELINE = only("stateless", "auth", "balance", "notices")


# -- errors after the first byte


async def test_an_exception_mid_stream_ends_with_response_failed(make_proxy, monkeypatch):
    feed = StreamRewriter.feed

    def exploding_feed(self, data: bytes) -> bytes:
        if b"BOOM" in data:
            raise RuntimeError("a bug in the rewriter")
        return feed(self, data)

    monkeypatch.setattr(StreamRewriter, "feed", exploding_feed)
    events = sse_events("BOOM")

    async def behave(n, chat, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n" % (len(events[0]), events[0]))
        await writer.drain()
        await asyncio.sleep(0.05)  # the first event reaches the client on its own
        writer.write(chunked(events[1:]))
        return True

    async with ChatUpstream(behave) as upstream:
        proxy = await make_proxy({**PIPELINE, "health": {"enabled": False}}, workers=[upstream.worker()])
        for _ in range(3):
            answer = await raw_post(proxy, STREAM)
            assert answer.status == 200 and answer.terminated, answer
            assert_one_response(answer)
            types = [e["type"] for e in answer.events]
            assert types[0] == "response.created" and types[-1] == "response.failed", types
            assert answer.events[-1]["response"]["error"]["code"] == "server_error"
        # each request was settled, not left as an open hold, and the books balance
        from middlewares.balance import wait_for_settlements

        await wait_for_settlements(proxy.app)
        assert await proxy.ledger.holds() == []
        for key_id, balance, expected in await proxy.ledger.audit():
            assert balance == expected, key_id


async def test_a_broken_upstream_chunk_mid_stream_ends_with_response_failed(make_proxy):
    events = sse_events("fine so far")

    async def behave(n, chat, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n" % (len(events[0]), events[0]))
        await writer.drain()
        await asyncio.sleep(0.05)  # the first event reaches the client on its own
        writer.write(b"zz-not-a-chunk-size\r\nHTTP/1.1 500 Internal Server Error\r\n\r\n")
        return "close"

    async with ChatUpstream(behave) as upstream:
        proxy = await make_proxy({**PIPELINE, "health": {"enabled": False}}, workers=[upstream.worker()])
        answer = await raw_post(proxy, STREAM)
        assert answer.status == 200 and answer.terminated, answer
        assert_one_response(answer)
        assert answer.events[-1]["type"] == "response.failed"


@pytest.mark.parametrize("mode", ["raise_after", "api_error_after"])
async def test_an_exception_after_a_whole_stream_leaves_it_whole(make_proxy, mode):
    proxy = await make_proxy({**PIPELINE, "middlewares": {"before_handler": [{"tests.support.fault_mw:create": {"mode": mode}}]}})
    for _ in range(3):
        answer = await raw_post(proxy, STREAM)
        assert answer.status == 200 and answer.terminated, answer
        assert_one_response(answer)
        assert answer.events[-1]["type"] == "response.completed"


async def test_an_exception_in_a_stream_no_rewriter_knows_cuts_the_connection(make_proxy):
    proxy = await make_proxy({**PIPELINE, "middlewares": {"before_handler": [{"tests.support.fault_mw:create": {"mode": "own_stream"}}]}})
    answer = await raw_post(proxy, STREAM)
    assert answer.status == 200
    assert not answer.terminated, answer  # a truncated body, not a valid-looking end
    assert_one_response(answer)
    assert answer.body == b'event: response.created\ndata: {"type": "response.cre'


async def test_a_prepare_hook_that_fails_gets_one_clean_error_response(make_proxy):
    proxy = await make_proxy({**PIPELINE, "middlewares": {"before_handler": [{"tests.support.fault_mw:create": {"mode": "hook_raises"}}]}})
    for _ in range(2):
        answer = await raw_post(proxy, STREAM)
        assert answer.status == 500 and answer.terminated, answer
        assert_one_response(answer)
        assert orjson.loads(answer.body)["error"]["code"] == "internal_error"


async def test_non_stream_errors_after_the_handler_are_still_envelopes(make_proxy):
    proxy = await make_proxy({**PIPELINE, "middlewares": {"before_handler": [{"tests.support.fault_mw:create": {"mode": "raise_after"}}]}})
    answer = await raw_post(proxy, {**STREAM, "stream": False})
    assert answer.status == 500 and answer.terminated
    assert_one_response(answer)
    assert orjson.loads(answer.body)["error"]["code"] == "internal_error"


# -- what is not an event stream, before the first byte


HTML = b"<html><head><title>Welcome</title></head><body>a login page</body></html>"


def html_200(chat):
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s" % (len(HTML), HTML))


def garbage_200(chat):
    junk = b"\x00\x01garbage that is no event stream at all\n\n"
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
            % (len(junk), junk))


def json_200(chat):
    return json_answer(b'{"id": "x", "object": "chat.completion", "choices": []}')


@pytest.mark.parametrize("answer", [html_200, garbage_200, json_200, gzipped], ids=lambda f: f.__name__)
async def test_a_stream_that_is_not_plain_events_fails_over(make_proxy, sim, answer):
    async def behave(n, chat, writer):
        writer.write(answer(chat))
        return True

    async with ChatUpstream(behave) as upstream:
        sim_worker = {"name": "sim", "url": sim.url, "dialect": "vllm", "models": ["tiny-org/tiny-model"]}
        proxy = await make_proxy({**PIPELINE, "health": {"enabled": False},
                                  "routing": {"affinity": {"enabled": False}}},
                                 workers=[upstream.worker(), sim_worker])
        for _ in range(4):
            got = await raw_post(proxy, STREAM)
            assert got.status == 200 and got.terminated, got
            assert_one_response(got)
            types = [e["type"] for e in got.events]
            assert types[-1] == "response.completed", (types, got.body[:500])
            assert b"<html" not in got.body and b"garbage" not in got.body
        assert upstream.count >= 1  # the raw worker was tried (and failed over from)


@pytest.mark.parametrize("answer", [html_200, garbage_200, json_200, gzipped], ids=lambda f: f.__name__)
async def test_a_stream_that_is_not_plain_events_with_no_other_worker_is_a_502(make_proxy, answer):
    async def behave(n, chat, writer):
        writer.write(answer(chat))
        return True

    async with ChatUpstream(behave) as upstream:
        proxy = await make_proxy({**PIPELINE, "health": {"enabled": False}}, workers=[upstream.worker()])
        got = await raw_post(proxy, STREAM)
        assert got.status == 502, got
        assert_one_response(got)
        assert orjson.loads(got.body)["error"]["code"] == "upstream_error"


async def test_a_gzipped_json_answer_is_refused_not_parsed(make_proxy):
    async def behave(n, chat, writer):
        writer.write(gzipped(chat))
        return True

    async with ChatUpstream(behave) as upstream:
        proxy = await make_proxy({**PIPELINE, "health": {"enabled": False}}, workers=[upstream.worker()])
        got = await raw_post(proxy, {**STREAM, "stream": False})
        assert got.status == 502, got
        error = orjson.loads(got.body)["error"]
        assert error["code"] == "upstream_error" and "gzip" in error["message"], error
        assert all(b"accept-encoding: identity" in head.lower() for head in upstream.chat_heads)


# -- header values from config


@pytest.mark.parametrize("key, where", [
    ("sk-worker\r\nX-Injected: yes", "workers[0].api_key"),
    ("sk-worker\n", "workers[0].api_key"),
    ("sk-w\x00rker", "workers[0].api_key"),
    ("sk-wörker", "workers[0].api_key"),
])
def test_control_characters_in_a_configured_header_stop_start_up(key, where):
    from proxy.app import build_app
    from proxy.config.load import Config, ConfigError

    with pytest.raises(ConfigError) as raised:
        build_app(Config.from_dict({"workers": [{"name": "w", "url": "http://127.0.0.1:9", "api_key": key}]}))
    assert str(raised.value).startswith(where), raised.value


def test_control_characters_in_a_worker_url_stop_start_up():
    from proxy.app import build_app
    from proxy.config.load import Config, ConfigError

    with pytest.raises(ConfigError, match=r"workers\[1\]\.url"):
        build_app(Config.from_dict({"workers": [
            {"name": "ok", "url": "http://127.0.0.1:9", "api_key": "fine"},
            {"name": "w", "url": "http://127.0.0.1:9/v1\r\nX-Injected: yes"}]}))


def test_cli_refuses_a_key_from_the_environment_with_its_trailing_newline(tmp_path):
    import os
    import subprocess
    import sys

    config = tmp_path / "config.yaml"
    config.write_text("workers:\n  - {name: gpu-a, url: 'http://127.0.0.1:9', models: [m], api_key: '${GPU_KEY}'}\n"
                      f"ledger: {{path: {tmp_path / 'l.db'}}}\n")
    proc = subprocess.run([sys.executable, "-m", "proxy", "--config", str(config), "serve", "--port", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GPU_KEY": "sk-from-a-file\n"})
    assert proc.returncode == 2, proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "workers[0].api_key" in lines[0] and "'\\n'" in lines[0], lines
