"""How an answer ended, as its handler reports it (sans-I/O): the figures it showed (`Tokens`), the
report the balance bills, the limits debit and the envelope logs (`AnswerReport`), and the record
that makes that report once (`AnswerRecord`: proxy.upstream.exchange's Attempt is one, timed by the
exchange with its worker).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from proxy.protocol.response import client_usage

__all__ = ["Tokens", "NO_TOKENS", "AnswerReport", "AnswerRecord", "shown_tokens"]


# What an answer reports are NamedTuples: immutable, and built by one C call (a frozen dataclass's
# __init__ sets each field through object.__setattr__), once or twice a request.
class Tokens(NamedTuple):
    """An answer's token figures: as its Response shows them, or as billed."""

    input: int = 0
    cached: int = 0
    output: int = 0
    reasoning: int = 0

    def as_chat_usage(self) -> dict:
        """The figures as a chat usage (what the rewriter's response.failed carries)."""
        return {"prompt_tokens": self.input, "completion_tokens": self.output,
                "prompt_tokens_details": {"cached_tokens": self.cached},
                "completion_tokens_details": {"reasoning_tokens": self.reasoning}}


NO_TOKENS = Tokens()


class AnswerReport(NamedTuple):
    """What the handler says about its answer, once, when it ends (returned, raised or was
    cancelled): the balance turns it into the bill, the limits debit its tokens, the envelope
    logs it. Written by the handler alone (ctx.report), never changed after."""

    status: str  # completed | incomplete | failed | cancelled | error
    upstream: str | None = None  # the worker the generation was sent to (None: none was)
    ttfb_ms: float | None = None
    # The upstream's usage as reported (Responses-shaped, unchecked: proxy.ledger.usage checks
    # it before billing); None: none was reported.
    usage: dict | None = None
    counted_output: int = 0  # output deltas counted (each carried at least one token)
    output_capped: bool = False  # cut off at the output cap (the worker ignored max_tokens)
    shown: Tokens = NO_TOKENS  # what the client was shown (the access line's when nothing is billed)
    error: str | None = None  # the error code of a stream the proxy ended with response.failed
    count_failed: bool = False  # a worker's tokenizer was asked for the usage and could not say


class AnswerRecord:
    """One worker's answer as it is learnt: `end` makes its report, once the answer ended (the
    handler calls it with what it read and counted); `report` is None until then."""

    __slots__ = ("worker", "ttfb_ms", "report")

    def __init__(self, worker: Any) -> None:
        self.worker = worker  # its `name` is the report's upstream
        self.ttfb_ms: float | None = None
        self.report: AnswerReport | None = None

    def end(self, status: str, usage: dict | None = None, counted: int = 0, cap: int | None = None, *,
            capped: bool = False, shown: dict | None = None, error: str | None = None,
            count_failed: bool = False) -> AnswerReport:
        """The answer ended: its report. `usage` is the upstream's (Responses-shaped, unchecked:
        the balance checks it before billing), `counted` the output deltas counted; `shown`,
        when the caller has it, is the usage its Response shows (the same figures)."""
        self.report = AnswerReport(status, self.worker.name, self.ttfb_ms, usage or None, counted, capped,
                                   shown_tokens(usage, counted, cap, shown), error, count_failed)
        return self.report


def shown_tokens(usage: dict | None, counted: int, cap: int | None, shown: dict | None = None) -> Tokens:
    """The figures an answer shows (the access line's and the metrics' when nothing is billed):
    the reported usage under the same checks as the client's Response, short; else as counted."""
    if not usage:
        return Tokens(output=counted) if counted else NO_TOKENS
    if shown is None:
        shown = client_usage(usage, cap)
    return Tokens(shown["input_tokens"], shown["input_tokens_details"]["cached_tokens"],
                  max(shown["output_tokens"], counted), shown["output_tokens_details"]["reasoning_tokens"])
