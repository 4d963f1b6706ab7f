"""proxy.protocol.chat_usage.SSEScanner, the pass-through's only look at a stream: fed vLLM's
captured bytes (tests/fixtures/vllm-0.32-cpu) cut at every byte, it passes them on unchanged
(but the usage chunk the edge asked for itself, cut out byte for byte), whole events only, and
reads the usage, the deltas and the end as they were."""

from __future__ import annotations

import orjson
import pytest

from proxy.protocol.chat_usage import SSEScanner
from tests.conftest import FIXTURES

CHAT = (FIXTURES / "chat_stream_usage.body").read_bytes()
MESSAGES = (FIXTURES / "anthropic_messages_stream.body").read_bytes()
USAGE_CHUNK = next(e + b"\n\n" for e in CHAT.split(b"\n\n") if b'"usage":{' in e)
FINGERPRINT = b',"system_fingerprint":"vllm-0.32.0-ada4ea05"}'


def without_usage(body: bytes, eol: bytes = b"\n") -> bytes:
    """What vLLM writes when the client asks no usage (chat_completion/serving.py): no usage chunk,
    and its system_fingerprint on the terminal chunk (the one with a finish_reason) instead."""
    usage = USAGE_CHUNK.replace(b"\n", eol)
    out = []
    for event in body.replace(usage, b"").split(eol + eol):
        if b'"finish_reason":"' in event and b'"system_fingerprint"' not in event:
            event = event[:-1] + FINGERPRINT
        out.append(event)
    return (eol + eol).join(out)


def run(scanner: SSEScanner, data: bytes, cuts: list[int]) -> bytes:
    out, at = [], 0
    for cut in [*cuts, len(data)]:
        piece = scanner.feed(data[at:cut])
        assert piece == b"" or piece.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")), piece[-20:]  # whole events only
        out.append(piece)
        at = cut
    out.append(scanner.flush())
    return b"".join(out)


def every_cut(data: bytes):
    return [[i] for i in range(1, len(data))]


@pytest.mark.parametrize("drop", [True, False])
def test_a_chat_stream_cut_anywhere_passes_on_as_it_came(drop):
    expected = without_usage(CHAT) if drop else CHAT
    for cuts in every_cut(CHAT):
        scanner = SSEScanner("chat", drop)
        assert run(scanner, CHAT, cuts) == expected, cuts
        assert scanner.usage["input_tokens"] == 28 and scanner.usage["output_tokens"] == 6
        assert scanner.done and scanner.finished and scanner.counted == 5  # the role chunk carries none


def test_the_usage_chunk_is_cut_from_a_coalesced_read_of_crlf_events():
    crlf = CHAT.replace(b"\n\n", b"\r\n\r\n")
    scanner = SSEScanner("chat", True)
    assert run(scanner, crlf, []) == without_usage(crlf, b"\r\n")
    assert scanner.usage["output_tokens"] == 6 and scanner.done


def test_a_usage_string_in_the_text_is_not_the_usage():
    text = (b'data: {"choices":[{"index":0,"delta":{"content":"say \\"usage\\":{\\"prompt_tokens\\":9} ok"}}]}\n\n'
            + USAGE_CHUNK + b"data: [DONE]\n\n")
    scanner = SSEScanner("chat", True)
    assert run(scanner, text, []) == text.replace(USAGE_CHUNK, b"")
    assert scanner.usage["input_tokens"] == 28


def test_a_messages_stream_cut_anywhere_passes_on_as_it_came():
    # vLLM 0.32 closes a thinking block with a signature_delta: no token of output
    deltas = MESSAGES.count(b"event: content_block_delta") - MESSAGES.count(b'"signature_delta"')
    assert deltas == 10
    for cuts in every_cut(MESSAGES):
        scanner = SSEScanner("messages", False)
        assert run(scanner, MESSAGES, cuts) == MESSAGES, cuts
        # message_start's usage, then message_delta's over it
        assert (scanner.usage["input_tokens"], scanner.usage["output_tokens"]) == (24, 10)
        assert scanner.done and scanner.finished and scanner.counted == deltas
        assert scanner.counted <= scanner.usage["output_tokens"]  # never above what vLLM reports


def test_a_completions_stream_keeps_its_text_chunks_and_drops_its_usage_chunk():
    head = b'data: {"id":"cmpl-1","object":"text_completion","model":"m","choices":'
    events = [head + b'[{"index":0,"text":"%s","finish_reason":%s}]}\n\n' % (w, f)
              for w, f in ((b"a", b"null"), (b"", b"null"), (b" b", b'"length"'))]
    usage = head + b'[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n'
    data = b"".join(events) + usage + b"data: [DONE]\n\n"
    scanner = SSEScanner("completions", True)
    assert run(scanner, data, [len(events[0]) + 7]) == data.replace(usage, b"")
    assert scanner.counted == 2 and scanner.usage["output_tokens"] == 2 and scanner.done


def _chunk(content: str, index: int = 0, finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"object": "chat.completion.chunk", "choices": [
        {"index": index, "delta": {"content": content}, "finish_reason": finish}]}) + b"\n\n"


def test_done_inside_the_text_does_not_end_the_stream():
    """A delta whose text holds `data: [DONE]` is text: the stream goes on to its real end."""
    body = (_chunk("before data: [DONE]\n\n after") + _chunk("more") + _chunk("end", finish="stop")
            + USAGE_CHUNK + b"data: [DONE]\n\n")
    for cuts in every_cut(body):
        scanner = SSEScanner("chat", True)
        assert run(scanner, body, cuts) == without_usage(body)
        assert scanner.done and scanner.finished and scanner.counted == 3


def test_usage_in_json_with_spaces_is_read():
    spaced = b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}\n\n'
    body = _chunk("a") + spaced + b"data: [DONE]\n\n"
    scanner = SSEScanner("chat", True)
    assert run(scanner, body, []) == _chunk("a") + b"data: [DONE]\n\n"
    assert (scanner.usage["input_tokens"], scanner.usage["output_tokens"]) == (7, 3)


def test_the_cut_is_at_the_event_that_crosses_the_cap_in_one_coalesced_read():
    body = b"".join(_chunk(f"w{i} ") for i in range(50)) + _chunk("", finish="length") + b"data: [DONE]\n\n"
    scanner = SSEScanner("chat", True, cap=5)
    out = run(scanner, body, [])
    assert out == b"".join(_chunk(f"w{i} ") for i in range(5))
    assert scanner.capped and scanner.done and not scanner.completed and scanner.counted == 5


def test_each_answer_of_n_has_its_own_cap():
    body = b"".join(_chunk("x", index=i % 3) for i in range(9)) + b"data: [DONE]\n\n"
    scanner = SSEScanner("chat", True, cap=3)
    assert run(scanner, body, []) == body
    assert scanner.counted == 9 and scanner.per_answer == {0: 3, 1: 3, 2: 3} and not scanner.capped
    scanner = SSEScanner("chat", True, cap=2)
    assert run(scanner, body, []) == b"".join(_chunk("x", index=i % 3) for i in range(6))
    assert scanner.capped


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"])
def test_events_framed_with_cr_line_ends(eol):
    body = (_chunk("a") + _chunk("b", finish="stop") + USAGE_CHUNK + b"data: [DONE]\n\n").replace(b"\n", eol)
    for cuts in every_cut(body):
        scanner = SSEScanner("chat", True)
        out = run(scanner, body, cuts)
        assert out == without_usage(body, eol), cuts
        assert scanner.done and scanner.counted == 2 and scanner.usage["output_tokens"] == 6


def test_multi_line_data_and_comments():
    body = b": keep-alive\n\ndata: {\"choices\":\ndata: [{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n"
    scanner = SSEScanner("chat", False)
    assert run(scanner, body, []) == body
    assert scanner.counted == 1 and scanner.done


def test_an_anthropic_stream_is_cut_at_the_delta_past_max_tokens():
    cap = 4
    scanner = SSEScanner("messages", False, cap=cap)
    out = run(scanner, MESSAGES, [])
    assert out.count(b'"thinking_delta"') == cap and scanner.capped and scanner.counted == cap


def test_the_usage_at_the_end_of_an_answer_too_large_to_read():
    from proxy.protocol.chat_usage import usage_in_tail

    tail = b'..."text":"usage \\"usage\\":{}"}],"usage": {"prompt_tokens": 5, "total_tokens": 9, ' \
           b'"completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}}'
    got = usage_in_tail(tail)
    assert (got["input_tokens"], got["output_tokens"], got["input_tokens_details"]["cached_tokens"]) == (5, 4, 2)
    assert usage_in_tail(b'"usage":{"input_tokens":3,"output_tokens":7}}')["output_tokens"] == 7
    assert usage_in_tail(b'no usage here') is None and usage_in_tail(b'"usage":{"prompt_tokens":') is None


# ----------------------------------------------------------------------------- the fast path, differentially

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
_TEXTS = st.one_of(st.sampled_from(["a", " b", "word ", "x y z", "", 'q"uote', "back\\slash", "\n", "é", "[DONE]",
                                    "data: [DONE]"]), st.text(max_size=6))


def _openai_event(kind: str, text: str, index: int, completions: bool) -> bytes:
    if kind == "usage":
        return b"data: " + orjson.dumps({**_HEAD, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9},
                                         "system_fingerprint": "fp"}) + b"\n\n"
    if kind == "done":
        return b"data: [DONE]\n\n"
    if kind == "ping":
        return b": keep-alive\n\n"
    finish = "stop" if kind == "finish" else None
    choice = ({"index": index, "text": text, "logprobs": None, "finish_reason": finish} if completions else
              {"index": index, "delta": {"content": text} if kind != "role" else {"role": "assistant", "content": ""},
               "logprobs": None, "finish_reason": finish})
    return b"data: " + orjson.dumps({**_HEAD, "choices": [choice]}) + b"\n\n"


_EVENTS = st.tuples(st.sampled_from(["text"] * 8 + ["finish", "usage", "ping", "role"]), _TEXTS,
                    st.sampled_from([0, 0, 0, 1]))


@given(events=st.lists(_EVENTS, min_size=1, max_size=60), cuts=st.lists(st.integers(0, 8000), max_size=6),
       cap=st.one_of(st.none(), st.integers(1, 40)), drop=st.booleans(), completions=st.booleans(),
       done=st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_runs_of_learned_chunks_count_and_cut_exactly_as_parsing_each(events, cuts, cap, drop, completions, done):
    family = "completions" if completions else "chat"
    body = b"".join(_openai_event(k, t, i, completions) for k, t, i in events) + (b"data: [DONE]\n\n" if done else b"")
    cuts = sorted(c for c in cuts if c < len(body))
    fast, slow = SSEScanner(family, drop, cap), SSEScanner(family, drop, cap, runs=False)
    assert run(fast, body, cuts) == run(slow, body, cuts)
    for name in ("counted", "per_answer", "usage", "completed", "finished", "capped"):
        assert getattr(fast, name) == getattr(slow, name), name


def test_a_coalesced_read_of_text_chunks_is_counted_as_a_run():
    body = (_openai_event("role", "", 0, False) + b"".join(_openai_event("text", f"w{i} ", 0, False)
                                                         for i in range(100))
            + _openai_event("finish", "", 0, False) + _openai_event("usage", "", 0, False) + b"data: [DONE]\n\n")
    parsed = []

    class Counting(SSEScanner):
        __slots__ = ()

        def _event(self, event):
            parsed.append(event)
            return super()._event(event)

    scanner = Counting("chat", True)
    out = run(scanner, body, [len(_openai_event("role", "", 0, False)) + len(_openai_event("text", "w0 ", 0, False))])
    assert scanner.counted == 100 and scanner.completed and scanner.usage["output_tokens"] == 9
    assert len(parsed) < 10  # the role, the first text (learned), the finish, the usage, [DONE]
    assert out == SSEScanner("chat", True, runs=False).feed(body)


def _anthropic_event(kind: str, text: str) -> bytes:
    def ev(name: str, obj: dict) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **obj}) + b"\n\n"

    if kind == "text":
        return ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
    if kind == "thinking":
        return ev("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": text}})
    if kind == "signature":
        return ev("content_block_delta", {"index": 0, "delta": {"type": "signature_delta", "signature": "ab12"}})
    if kind == "ping":
        return b'event: ping\ndata: {"type":"ping"}\n\n'
    return ev("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 7}})


@given(events=st.lists(st.tuples(st.sampled_from(["text"] * 6 + ["thinking"] * 3 + ["signature", "ping", "delta"]),
                                 _TEXTS), min_size=1, max_size=60),
       cuts=st.lists(st.integers(0, 8000), max_size=6), cap=st.one_of(st.none(), st.integers(1, 40)))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_anthropic_runs_count_and_cut_exactly_as_parsing_each(events, cuts, cap):
    body = (MESSAGES.split(b"\n\n")[0] + b"\n\n" + b"".join(_anthropic_event(k, t) for k, t in events)
            + b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    cuts = sorted(c for c in cuts if c < len(body))
    fast, slow = SSEScanner("messages", False, cap), SSEScanner("messages", False, cap, runs=False)
    assert run(fast, body, cuts) == run(slow, body, cuts)
    for name in ("counted", "usage", "completed", "finished", "capped"):
        assert getattr(fast, name) == getattr(slow, name), name
