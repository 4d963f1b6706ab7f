"""What a request is billed: the model server's usage report, checked against what is possible.

The upstream's usage is not trusted as it comes: a model server (or anything answering in
its place) can report negative, fractional, huge or non-numeric counts, more cached tokens
than prompt tokens, or more output than the cap it was sent. `clean_usage` is the one place
that turns whatever came (or did not come) into the integers a usage row records:

  * each count must be an integer (an integral float is taken) in [0, 2**63 - 1]; anything
    else is replaced by the fallback: the prompt as the worker's tokenizer counted it (or
    the reservation's upper bound), the output as the deltas counted;
  * the prompt is at most the reservation's upper bound (when the prompt is text only);
  * cached tokens above the prompt are not believed (priced as uncached: never below cost);
  * the output is at least the deltas counted (each counted delta carried a token) and at
    most the output cap sent upstream; reasoning is part of the output;
  * the cost is at most the hold: the request never takes money held for another.

Every replacement is reported as a short reason; the caller logs and counts them. Pure:
no I/O, never raises for any input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from proxy.ledger.pricing import Price, cost_micros

__all__ = ["MAX_AMOUNT", "BilledUsage", "as_count", "clean_usage"]

# SQLite stores integers in 64 signed bits; beyond that a value silently becomes a REAL.
MAX_AMOUNT = 2**63 - 1


def as_count(value: Any) -> int | None:
    """A token count as an int in [0, MAX_AMOUNT]; None when `value` is not one."""
    if type(value) is int:
        return value if 0 <= value <= MAX_AMOUNT else None
    if type(value) is float and math.isfinite(value) and value.is_integer() and 0 <= value <= MAX_AMOUNT:
        return int(value)
    return None


@dataclass(slots=True)
class BilledUsage:
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    reasoning_tokens: int
    cost_micros: int
    corrections: list[str] = field(default_factory=list)


def _details(usage: dict, name: str) -> dict:
    found = usage.get(name)
    return found if isinstance(found, dict) else {}


def _reported_count(usage: dict, name: str, fixes: list[str], *, when_invalid: int, least: int | None = None,
                    most: int | None, above: str) -> int:
    """A top-level count of a usage (input_tokens, output_tokens): an invalid one is
    `when_invalid` (fix `<name>_invalid`), one below `least` is `least` (fix
    `<name>_below_counted`), one above `most` is `most` (fix `above`). The callers' defaults
    already lie within `most` (the fallback within the bound, the counted output within the
    cap), so only a reported count is checked against it."""
    count = as_count(usage.get(name))
    if count is None:
        fixes.append(f"{name}_invalid")
        return when_invalid
    if least is not None and count < least:
        fixes.append(f"{name}_below_counted")
        return least
    if most is not None and count > most:
        fixes.append(above)
        return most
    return count


def _detail_count(usage: dict, details: str, name: str, fixes: list[str], *, most: int, above: str,
                  when_above: int) -> int:
    """A count inside a usage's details object (cached_tokens, reasoning_tokens): absent is 0,
    an invalid one is 0 (fix `<name>_invalid`), one above `most` is `when_above` (fix `above`).
    The two details differ in what an excess means, so the caller says what replaces it."""
    raw = _details(usage, details).get(name)
    count = 0 if raw is None else as_count(raw)
    if count is None:
        fixes.append(f"{name}_invalid")
        return 0
    if count > most:
        fixes.append(above)
        return when_above
    return count


def clean_usage(reported: Any, *, counted_output: int, input_fallback: int, input_bound: int | None,
                output_cap: int | None, price: Price, hold_micros: int | None) -> BilledUsage:
    """The usage to bill. `reported`: the Responses-shaped usage the upstream reported (None:
    it reported none); `counted_output`: the output deltas counted; `input_fallback`: the
    prompt tokens to bill when none were reported (the worker's count, else the bound);
    `input_bound`: the most tokens the prompt can be (None: unknown, e.g. images);
    `output_cap`: the max_tokens sent upstream (None: none); `hold_micros`: the hold (None:
    no hold, the cost is not clamped)."""
    fixes: list[str] = []
    counted = as_count(counted_output) or 0
    if output_cap is not None and counted > output_cap:
        counted = output_cap  # the rewriter stops at the cap; a defence in depth
    fallback = as_count(input_fallback) or 0
    if input_bound is not None and fallback > input_bound:
        fallback = input_bound
    if isinstance(reported, dict):
        input_tokens = _reported_count(reported, "input_tokens", fixes, when_invalid=fallback,
                                       most=input_bound, above="input_tokens_above_bound")
        cached = _detail_count(reported, "input_tokens_details", "cached_tokens", fixes,
                               most=input_tokens, above="cached_tokens_above_input", when_above=0)
        output = _reported_count(reported, "output_tokens", fixes, when_invalid=counted, least=counted,
                                 most=output_cap, above="output_tokens_above_cap")
        reasoning = _detail_count(reported, "output_tokens_details", "reasoning_tokens", fixes,
                                  most=output, above="reasoning_tokens_above_output", when_above=output)
    else:
        input_tokens, cached, output, reasoning = fallback, 0, counted, 0
    cost = cost_micros(price, input_tokens, cached, output)
    if hold_micros is not None and cost > hold_micros:
        fixes.append("cost_above_hold")
        cost = max(0, int(hold_micros))
    return BilledUsage(input_tokens, cached, output, reasoning, cost, fixes)
