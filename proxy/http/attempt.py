"""One worker's try at an answer, shared by both forwarding handlers (proxy.http.responses_handler,
proxy.http.passthrough_handler): what it learns on the way (`Attempt`, ended into the request's
AnswerReport), whether its first read can start an event stream, and how its connection is let go.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from proxy.errors import APIError
from proxy.http.upstream_open import Refine, Retryable, open_upstream
from proxy.protocol.response import client_usage
from proxy.state import NO_TOKENS, POOL, AnswerReport, Tokens
from proxy.upstream.client import UpstreamResponse
from proxy.upstream.workers import Worker

STREAM_END_GRACE_S = 1.0  # after [DONE], how long the last chunk of a stream may take to keep its connection


class Attempt:
    """One worker's try, filled in by the handler as it goes; `end` makes its report (once the
    answer ended), which the failover hands on as the request's (ctx.report)."""

    __slots__ = ("worker", "sent_at", "ttfb_ms", "report")

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.sent_at: float | None = None  # perf_counter() when the generation was sent
        self.ttfb_ms: float | None = None
        self.report: AnswerReport | None = None

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

    def end(self, status: str, usage: dict | None = None, counted: int = 0, cap: int | None = None, *,
            capped: bool = False, shown: dict | None = None, error: str | None = None,
            count_failed: bool = False) -> AnswerReport:
        """The answer ended: its report. `usage` is the upstream's (Responses-shaped, unchecked:
        the balance checks it before billing), `counted` the output deltas counted; `shown`,
        when the caller has it, is the usage its Response shows (the same figures)."""
        self.report = AnswerReport(status, self.worker.name, self.ttfb_ms, usage or None, counted, capped,
                                   shown_tokens(usage, counted, cap, shown), error, count_failed)
        return self.report

    def ended(self, status: str) -> AnswerReport:
        """The report of an attempt that ended without one (it raised, or was cancelled)."""
        if self.report is not None:
            return self.report
        return AnswerReport(status, self.worker.name if self.sent_at is not None else None, self.ttfb_ms)


def shown_tokens(usage: dict | None, counted: int, cap: int | None, shown: dict | None = None) -> Tokens:
    """The figures an answer shows (the access line's and the metrics' when nothing is billed):
    the reported usage under the same checks as the client's Response, short; else as counted."""
    if not usage:
        return Tokens(output=counted) if counted else NO_TOKENS
    if shown is None:
        shown = client_usage(usage, cap)
    return Tokens(shown["input_tokens"], shown["input_tokens_details"]["cached_tokens"],
                  max(shown["output_tokens"], counted), shown["output_tokens_details"]["reasoning_tokens"])


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


async def attempt_once(app: Any, attempt: Attempt, url: str, payload: bytes, *, stream: bool,
                       answer_json: Callable[[bytes], Awaitable[web.StreamResponse]],
                       answer_stream: Callable[[UpstreamResponse, bytes, float], Awaitable[web.StreamResponse]],
                       refine: Refine | None = None) -> web.StreamResponse:
    """One worker's try, whichever handler makes it: the POST sent and its status and first read
    checked (open_upstream: raises Retryable while another worker may answer), the stream's
    start checked, the answer made by the handler's `answer_json(body)` or
    `answer_stream(upstream, first, deadline)`, and the connection given back whatever happens."""
    worker = attempt.worker
    deadline = asyncio.get_running_loop().time() + worker.timeouts.total
    upstream = None
    attempt.sent()
    try:
        upstream, first = await open_upstream(app, worker, url, payload, stream=stream, refine=refine)
        attempt.opened(app[POOL], upstream, first, stream)
        if not stream:
            return await answer_json(first)
        return await answer_stream(upstream, first, deadline)
    finally:
        if upstream is not None:
            let_go(upstream, stream, attempt.report)
