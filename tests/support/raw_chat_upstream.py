"""A raw asyncio chat-completions server for the stream-integrity tests: it writes exactly the
bytes each case needs (unsolicited answers on an idle keep-alive connection, 1xx interim
answers, HTML or gzip where JSON or SSE belongs), which the simulator, being a well-behaved
aiohttp server, cannot.

Each answer echoes the request's last user message, so a test can tell whose answer a
client got. `behave(n, chat, writer)` may take over request number n (from 0): it returns
True when it wrote the answer itself, "close" to end the connection, None for the default.
"""

from __future__ import annotations

import asyncio
import gzip
from typing import Any, Awaitable, Callable

import orjson

Behaviour = Callable[[int, dict, asyncio.StreamWriter], Awaitable[Any]]


def last_user_text(chat: dict) -> str:
    for message in reversed(chat.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content)
    return ""


def completion(text: str, model: str = "tiny-org/tiny-model") -> bytes:
    return orjson.dumps({
        "id": "chatcmpl-raw", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    })


def sse_events(text: str, model: str = "tiny-org/tiny-model") -> list[bytes]:
    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
        body: dict = {"id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 1, "model": model,
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if usage is not None:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    return [chunk({"role": "assistant", "content": ""}), chunk({"content": text}),
            chunk({}, "stop", {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}),
            b"data: [DONE]\n\n"]


def json_answer(body: bytes, status: str = "200 OK", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            .encode() + body)


def chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"


def sse_answer(text: str, extra: str = "") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            + extra.encode() + b"\r\n" + chunked(sse_events(text)))


def answer_for(chat: dict) -> bytes:
    text = "echo: " + last_user_text(chat)
    return sse_answer(text) if chat.get("stream") else json_answer(completion(text))


def gzipped(chat: dict) -> bytes:
    """The default answer, gzip-encoded although the request asked for none."""
    text = "echo: " + last_user_text(chat)
    if chat.get("stream"):
        body = gzip.compress(b"".join(sse_events(text)))
        return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + chunked([body]))
    return json_answer(gzip.compress(completion(text)), extra="Content-Encoding: gzip\r\n")


class ChatUpstream:
    def __init__(self, behave: Behaviour | None = None) -> None:
        self.behave = behave
        self.count = 0  # chat requests seen
        self.connections = 0
        self.chat_connections = 0  # connections that carried at least one chat request
        self.chat_heads: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> "ChatUpstream":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker(self, name: str = "raw", **extra: Any) -> dict:
        return {"name": name, "url": self.url, "dialect": "vllm", "models": ["tiny-org/tiny-model"],
                "timeouts": {"connect": 2, "first_byte": 10, "idle": 10, "total": 30}, **extra}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        chat_seen = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                if head.startswith(b"GET /v1/models"):
                    writer.write(json_answer(orjson.dumps({"object": "list", "data": [
                        {"id": "tiny-org/tiny-model", "object": "model", "max_model_len": 32768}]})))
                    continue
                if not head.startswith(b"POST /v1/chat/completions"):
                    writer.write(json_answer(b'{"error": "not found"}', "404 Not Found"))
                    continue
                if not chat_seen:
                    chat_seen = True
                    self.chat_connections += 1
                n = self.count
                self.count += 1
                self.chat_heads.append(head)
                chat = orjson.loads(body)
                done = await self.behave(n, chat, writer) if self.behave is not None else None
                if done == "close":
                    break
                if not done:
                    writer.write(answer_for(chat))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
