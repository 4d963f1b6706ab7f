"""How a streamed answer reaches the client's socket: the headers ride with the first events,
the last events with the end of the body, and an answer the upstream sent whole goes out as
one send. Each send is a syscall and a loopback round of TCP work (see `make bench`)."""

from __future__ import annotations

import pytest
from aiohttp.http_writer import StreamWriter

from tests.faults.test_upstream import body, call

WORDS = " ".join(f"w{i}" for i in range(60))


@pytest.fixture
def sends(monkeypatch) -> dict[int, list[bytes]]:
    """Every send of every response writer, by writer: the bytes handed to the transport."""
    sent: dict[int, list[bytes]] = {}
    writers: dict[int, StreamWriter] = {}  # held, so that no id is reused while the test runs
    real_write, real_writelines = StreamWriter._write, StreamWriter._writelines

    def record(writer: StreamWriter, data: bytes) -> None:
        writers[id(writer)] = writer
        sent.setdefault(id(writer), []).append(data)

    def write(self, chunk):
        record(self, bytes(chunk))
        return real_write(self, chunk)

    def writelines(self, chunks):
        record(self, b"".join(bytes(c) for c in chunks))
        return real_writelines(self, chunks)

    monkeypatch.setattr(StreamWriter, "_write", write)
    monkeypatch.setattr(StreamWriter, "_writelines", writelines)
    return sent


def _event_stream_sends(sent: dict[int, list[bytes]]) -> list[list[bytes]]:
    """The sends of our event-stream responses (the simulator's own are in the same process)."""
    return [s for s in sent.values() if s[0].startswith(b"HTTP/1.1 200") and b"event: response.created" in s[0]]


async def test_a_whole_coalesced_answer_is_one_send(sim, make_proxy, sends):
    proxy = await make_proxy()
    status, _, events = await call(proxy, body({"text": WORDS, "coalesce": True}, stream=True))
    assert status == 200 and events[-1]["type"] == "response.completed"
    (ours,) = _event_stream_sends(sends)
    assert len(ours) == 1, [s[:60] for s in ours]  # headers, every event and the last chunk, at once
    assert ours[0].count(b"event: response.output_text.delta\n") == 60
    assert ours[0].endswith(b"\r\n0\r\n\r\n")


async def test_a_streamed_answer_sends_headers_with_the_first_events_and_eof_with_the_last(
        sim, make_proxy, sends):
    proxy = await make_proxy()
    status, _, events = await call(proxy, body({"text": "one two three four five", "delay": 0.02}, stream=True))
    assert status == 200 and events[-1]["type"] == "response.completed"
    (ours,) = _event_stream_sends(sends)
    assert len(ours) > 2  # one send per upstream read while the answer streams
    assert not any(s.startswith(b"HTTP/1.1") for s in ours[1:])  # no send of headers alone
    assert b"response.completed" in ours[-1] and ours[-1].endswith(b"\r\n0\r\n\r\n")
    assert all(b"0\r\n\r\n" not in s[-5:] for s in ours[:-1])
