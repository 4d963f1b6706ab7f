"""One exchange with a worker, shared by every forwarding handler (proxy.http.responses_handler for
/v1/responses, proxy.http.passthrough_handler for the other endpoints): the POST, the status, the
first read, the upstream's failures mapped once to what the client is told, the worker's success or
failure recorded, the stream's start checked, the connection let go; and the `Attempt`, timed
from the POST to the first bytes, that reports how the answer ended (proxy.protocol.answer_report).

`open_upstream` returns the answer and its first bytes (a stream's first read, or a JSON answer
whole). When it raises, the connection is already given back (pooled when its answer was read
whole, else closed), so the caller only lets go of answers it was handed. A `Retryable` is a
failure before anything reached the client: the caller may try another worker. `attempt_once`
runs one worker's try around the handler's own answer (its JSON or its event stream).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson

from proxy.errors import APIError
from proxy.protocol.answer_report import AnswerRecord, AnswerReport
from proxy.protocol.rewriter import public_message
from proxy.upstream.client import (
    BadResponse,
    ConnectFailed,
    ConnectTimeout,
    DeadlinePassed,
    Disconnected,
    UpstreamPool,
    UpstreamResponse,
)
from proxy.upstream.workers import Worker, WorkerPool

# A non-stream answer is buffered whole: past this size it is an upstream fault (an endless
# body), refused instead of held in memory until the total timeout. Error bodies are only
# read for their message.
MAX_JSON_BODY = 16 * 1024 * 1024
MAX_ERROR_BODY = 64 * 1024
TAIL_BYTES = 64 * 1024  # of an answer too large to read: where its usage is
MAX_TAIL_SCAN = 4 * MAX_JSON_BODY  # how much more of it is read, looking for that end


class Retryable(Exception):
    """The worker failed before anything reached the client: another worker may take it."""

    def __init__(self, worker: Worker, reason: str, final: APIError) -> None:
        super().__init__(reason)
        self.worker = worker
        self.final = final


class AnswerLost(APIError):
    """The worker answered 200 and its answer could not be read: larger than the proxy reads
    (`whole`: it ran to its end, so to its cap), or the connection lost mid-body. The work was
    done: the failover bills it as far as it can be counted and asks no other worker."""

    def __init__(self, message: str, *, whole: bool, tail: bytes = b"", status: int = 502) -> None:
        super().__init__(status, message, code="upstream_error" if status == 502 else "upstream_timeout")
        self.whole = whole
        self.tail = tail  # the answer's last bytes (where vLLM and SGLang write the usage)


def upstream_message(body: bytes) -> tuple[str | None, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    if isinstance(data, dict):
        err = data["error"] if isinstance(data.get("error"), dict) else data
        message = err.get("message")
        if isinstance(message, str):
            # Upstream messages are useful to the client ("maximum context length is ..."),
            # but never pass on what looks like an internal trace.
            message = public_message(message, 1000)
            return message, err.get("param")
    return None, None


def map_upstream_error(worker: Worker, status: int, body: bytes) -> APIError | Retryable:
    message, param = upstream_message(body)
    if status in (400, 422):
        code = "context_length_exceeded" if message and "context length" in message else "invalid_request"
        return APIError(400, message or "The model server rejected the request.", code=code,
                        param=param if isinstance(param, str) else None)
    if status == 404:
        return APIError(404, message or "The model does not exist on the model server.", code="model_not_found",
                        param="model")
    if status == 413:
        return APIError(413, "The model server found the request too large.", code="request_too_large")
    if status == 429:
        return APIError(429, "The model server is at capacity; retry shortly.", code="capacity_exhausted",
                        headers={"Retry-After": "1"})
    if status == 529:  # Anthropic's (and vLLM's Anthropic API's) overloaded: another worker may take it
        return Retryable(worker, "status 529", APIError(529, message or "The model server is overloaded.",
                                                        code="overloaded_error", headers={"Retry-After": "1"}))
    final = APIError(502, f"The model server answered {status}.", code="upstream_error")
    return Retryable(worker, f"status {status}", final)


async def _read_tail(upstream: UpstreamResponse, first: bytes, deadline: float) -> bytes:
    """The rest of an answer too large to hold, read to its end (within the deadline and
    MAX_TAIL_SCAN more bytes) keeping only its last TAIL_BYTES: its usage, for the bill. b""
    when the end cannot be had (then it is billed as having run to its cap)."""
    tail = first[-TAIL_BYTES:]
    left = MAX_TAIL_SCAN
    try:
        while left > 0:
            chunk = await upstream.read(deadline)
            if not chunk:
                return tail
            left -= len(chunk)
            tail = (tail + chunk)[-TAIL_BYTES:]
    except (Disconnected, BadResponse, DeadlinePassed):
        pass
    return b""  # no end within the bound: an endless body, or one too large to look through


# (status, error body) -> the refusal to raise instead of map_upstream_error's, or None
Refine = Callable[[int, bytes], "APIError | Retryable | None"]


async def open_upstream(upstreams: UpstreamPool, pool: WorkerPool, worker: Worker, url: str, payload: bytes, *,
                        stream: bool, refine: Refine | None = None,
                        headers: Any = None) -> tuple[UpstreamResponse, bytes]:
    """POST `payload` to `url` on `worker` -> (the answer, its first bytes): a stream's first read,
    a JSON answer whole (up to MAX_JSON_BODY). A status other than 200 raises what
    map_upstream_error (or `refine`, asked first) makes of it; an encoded answer, an unreachable
    worker, a connect timeout or an answer too large raise Retryable; no first byte in time
    raises the 504. Whatever it raises, the connection is released first."""
    timeouts = worker.timeouts
    loop = asyncio.get_running_loop()
    first_byte = min(timeouts.first_byte, timeouts.total) if stream else timeouts.total
    upstream: UpstreamResponse | None = None
    try:
        try:
            # The connect phase is bounded by its own timeout inside post(); first byte, idle
            # and total are timed by the callers' deadlines, so each one is reported as itself.
            first_deadline = loop.time() + first_byte
            upstream = await upstreams.post(url, worker.chat_headers if headers is None else headers, payload,
                                                       connect_timeout=timeouts.connect, deadline=first_deadline)
            if upstream.status != 200:
                body = await upstream.read_capped(MAX_ERROR_BODY, first_deadline)
                error = refine(upstream.status, body) if refine is not None else None
                if error is None:
                    error = map_upstream_error(worker, upstream.status, body)
                    if upstream.status >= 500:
                        pool.record_failure(worker, f"status {upstream.status}")
                raise error
            if upstream.content_encoding is not None:
                # Asked for identity: compressed bytes must never reach a JSON parser or a rewriter as text.
                pool.record_failure(worker, "encoded answer")
                coding = upstream.content_encoding.decode("latin-1")[:40]
                raise Retryable(worker, "content_encoding", APIError(
                    502, f"The model server sent an encoded answer ({coding}) although none was asked for.",
                    code="upstream_error"))
            if stream:
                first = await upstream.read(first_deadline)
            else:
                try:
                    first = await upstream.read_capped(MAX_JSON_BODY, first_deadline)
                except (Disconnected, BadResponse):
                    pool.record_failure(worker, "disconnected mid-answer")
                    raise AnswerLost("The connection to the model server was lost while it sent its answer.",
                                     whole=False) from None
                except DeadlinePassed:  # its headers came (vLLM sends them with the body): mid-answer
                    pool.record_failure(worker, "total timeout mid-answer")
                    raise AnswerLost(f"The model server did not finish its answer within {first_byte:g}s "
                                     "(total timeout).", whole=False, status=504) from None
                if len(first) > MAX_JSON_BODY:
                    raise AnswerLost(f"The model server sent an answer larger than {MAX_JSON_BODY} bytes, the most "
                                     "this proxy reads; ask for less (fewer answers, fewer logprobs).", whole=True,
                                     tail=await _read_tail(upstream, first, first_deadline))
        except ConnectTimeout:
            # Nothing was sent: another worker may take it.
            pool.record_failure(worker, "connect timeout")
            raise Retryable(worker, "connect_timeout",
                             APIError(504, f"The model server did not accept a connection within "
                                           f"{timeouts.connect:g}s.", code="upstream_timeout")) from None
        except DeadlinePassed:
            pool.record_failure(worker, "first byte timeout")
            which = "first_byte" if stream and first_byte < timeouts.total else "total"
            raise APIError(504, f"The model server did not answer within {first_byte:g}s ({which} timeout).",
                           code="upstream_timeout") from None
        except (ConnectFailed, Disconnected, BadResponse) as exc:
            pool.record_failure(worker, type(exc).__name__)
            unreachable = APIError(502, "The model server could not be reached.", code="upstream_unreachable")
            raise Retryable(worker, type(exc).__name__, unreachable) from None
    except BaseException:
        if upstream is not None:
            upstream.release()  # pooled when the (error) answer was read whole, else closed
        raise
    return upstream, first


STREAM_END_GRACE_S = 1.0  # after [DONE], how long the last chunk of a stream may take to keep its connection


class Attempt(AnswerRecord):
    """One worker's try, filled in by the handler as it goes: timed from the POST (`sent`) to its
    first bytes (`opened`, where the worker's success is recorded); `end`, once the answer ended,
    makes its report (proxy.protocol.answer_report), which the failover hands on as the request's
    (ctx.report)."""

    __slots__ = ("sent_at",)

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        self.sent_at: float | None = None  # perf_counter() when the generation was sent

    def sent(self) -> None:
        self.sent_at = time.perf_counter()

    def opened(self, pool: Any, upstream: UpstreamResponse, first: bytes, stream: bool) -> None:
        """The answer's first bytes came (open_upstream): timed, and the worker's success
        recorded once they can start the answer (a stream's must start an event stream, else
        Retryable)."""
        assert self.sent_at is not None
        seconds = time.perf_counter() - self.sent_at
        self.ttfb_ms = seconds * 1000
        if stream:
            check_stream_start(pool, self.worker, upstream, first)
        pool.record_success(self.worker, seconds)

    def ended(self, status: str) -> AnswerReport:
        """The report of an attempt that ended without one (it raised, or was cancelled): the
        worker named only when the generation was sent to it."""
        if self.report is not None:
            return self.report
        return AnswerReport(status, self.worker.name if self.sent_at is not None else None, self.ttfb_ms)


def check_stream_start(pool: Any, worker: Worker, upstream: UpstreamResponse, first: bytes) -> None:
    """Raise Retryable when the first read of a stream is not the start of an event stream."""
    if not first:
        pool.record_failure(worker, "closed before the first byte")
        raise Retryable(worker, "empty_stream",
                         APIError(502, "The model server closed the stream before answering.",
                                  code="upstream_error"))
    if not is_event_stream(upstream.content_type, first):
        # An HTML page or JSON where events belong (a proxy's error page, a misrouted
        # request): nothing reached the client yet, so another worker may take it.
        pool.record_failure(worker, "not an event stream")
        raise Retryable(worker, "not_event_stream",
                         APIError(502, "The model server answered the stream with something other than "
                                       "an event stream.", code="upstream_error"))


def let_go(upstream: UpstreamResponse, stream: bool, report: AnswerReport | None) -> None:
    """Release the upstream connection for reuse, or close it.

    An unfinished generation is aborted upstream by closing its connection (vLLM frees the
    GPU when the connection drops), never left running for a pooled reuse."""
    if report is not None and report.output_capped:
        upstream.close()  # it ignored max_tokens: whatever it is still sending is not wanted
    elif upstream.at_eof():
        upstream.release()
    elif stream and report is not None and report.status in ("completed", "incomplete"):
        upstream.release_when_complete(STREAM_END_GRACE_S)  # only the stream's framing is left
    else:
        upstream.close()


_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")


def is_event_stream(content_type: bytes | None, first: bytes) -> bool:
    """Whether an answer can be an event stream: its Content-Type (when it says one) is
    text/event-stream and its first line starts like an SSE field (a short first read may
    hold only the start of one)."""
    if content_type is not None and not content_type.strip().lower().startswith(b"text/event-stream"):
        return False
    head = first.lstrip(b"\r\n")[:6]
    return not head or any(head.startswith(f) or f.startswith(head) for f in _SSE_FIELDS)


_Answer = TypeVar("_Answer")  # the handler's answer (a web.StreamResponse)


async def attempt_once(upstreams: UpstreamPool, pool: WorkerPool, attempt: Attempt, url: str, payload: bytes, *,
                       stream: bool, answer_json: Callable[[bytes], Awaitable[_Answer]],
                       answer_stream: Callable[[UpstreamResponse, bytes, float], Awaitable[_Answer]],
                       refine: Refine | None = None, headers: Any = None) -> _Answer:
    """One worker's try, whichever handler makes it: the POST sent and its status and first read
    checked (open_upstream: raises Retryable while another worker may answer), the stream's
    start checked, the answer made by the handler's `answer_json(body)` or
    `answer_stream(upstream, first, deadline)`, and the connection given back whatever happens.
    `headers`: instead of the worker's own (a traced attempt's carry its traceparent)."""
    worker = attempt.worker
    deadline = asyncio.get_running_loop().time() + worker.timeouts.total
    upstream = None
    attempt.sent()
    try:
        upstream, first = await open_upstream(upstreams, pool, worker, url, payload, stream=stream, refine=refine,
                                              headers=headers)
        attempt.opened(pool, upstream, first, stream)
        if not stream:
            return await answer_json(first)
        return await answer_stream(upstream, first, deadline)
    finally:
        if upstream is not None:
            let_go(upstream, stream, attempt.report)
