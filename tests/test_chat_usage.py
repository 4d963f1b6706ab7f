"""proxy.protocol.chat_usage.SSEScanner, the pass-through's only look at a stream: fed vLLM's
captured bytes (tests/fixtures/vllm-0.32-cpu) cut at every byte, it passes them on unchanged
(but the usage chunk the edge asked for itself, cut out byte for byte), whole events only, and
reads the usage, the deltas and the end as they were."""

from __future__ import annotations

import pytest

from proxy.protocol.chat_usage import SSEScanner
from tests.conftest import FIXTURES

CHAT = (FIXTURES / "chat_stream_usage.body").read_bytes()
MESSAGES = (FIXTURES / "anthropic_messages_stream.body").read_bytes()
USAGE_CHUNK = next(e + b"\n\n" for e in CHAT.split(b"\n\n") if b'"usage":{' in e)


def run(scanner: SSEScanner, data: bytes, cuts: list[int]) -> bytes:
    out, at = [], 0
    for cut in [*cuts, len(data)]:
        piece = scanner.feed(data[at:cut])
        assert piece == b"" or piece.endswith((b"\n\n", b"\r\n\r\n")), piece[-20:]  # whole events only
        out.append(piece)
        at = cut
    out.append(scanner.flush())
    return b"".join(out)


def every_cut(data: bytes):
    return [[i] for i in range(1, len(data))]


@pytest.mark.parametrize("drop", [True, False])
def test_a_chat_stream_cut_anywhere_passes_on_as_it_came(drop):
    expected = CHAT.replace(USAGE_CHUNK, b"") if drop else CHAT
    for cuts in every_cut(CHAT):
        scanner = SSEScanner("chat", drop)
        assert run(scanner, CHAT, cuts) == expected, cuts
        assert scanner.usage["input_tokens"] == 28 and scanner.usage["output_tokens"] == 6
        assert scanner.done and scanner.finished and scanner.counted == 5  # the role chunk carries none


def test_the_usage_chunk_is_cut_from_a_coalesced_read_of_crlf_events():
    crlf = CHAT.replace(b"\n\n", b"\r\n\r\n")
    scanner = SSEScanner("chat", True)
    assert run(scanner, crlf, []) == crlf.replace(USAGE_CHUNK.replace(b"\n\n", b"\r\n\r\n"), b"")
    assert scanner.usage["output_tokens"] == 6 and scanner.done


def test_a_usage_string_in_the_text_is_not_the_usage():
    text = (b'data: {"choices":[{"index":0,"delta":{"content":"say \\"usage\\":{\\"prompt_tokens\\":9} ok"}}]}\n\n'
            + USAGE_CHUNK + b"data: [DONE]\n\n")
    scanner = SSEScanner("chat", True)
    assert run(scanner, text, []) == text.replace(USAGE_CHUNK, b"")
    assert scanner.usage["input_tokens"] == 28


def test_a_messages_stream_cut_anywhere_passes_on_as_it_came():
    deltas = MESSAGES.count(b"event: content_block_delta")
    for cuts in every_cut(MESSAGES):
        scanner = SSEScanner("messages", False)
        assert run(scanner, MESSAGES, cuts) == MESSAGES, cuts
        # message_start's usage, then message_delta's over it
        assert (scanner.usage["input_tokens"], scanner.usage["output_tokens"]) == (24, 10)
        assert scanner.done and scanner.finished and scanner.counted == deltas


def test_a_completions_stream_keeps_its_text_chunks_and_drops_its_usage_chunk():
    head = b'data: {"id":"cmpl-1","object":"text_completion","model":"m","choices":'
    events = [head + b'[{"index":0,"text":"%s","finish_reason":%s}]}\n\n' % (w, f)
              for w, f in ((b"a", b"null"), (b"", b"null"), (b" b", b'"length"'))]
    usage = head + b'[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n'
    data = b"".join(events) + usage + b"data: [DONE]\n\n"
    scanner = SSEScanner("completions", True)
    assert run(scanner, data, [len(events[0]) + 7]) == data.replace(usage, b"")
    assert scanner.counted == 2 and scanner.usage["output_tokens"] == 2 and scanner.done
