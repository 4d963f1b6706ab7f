"""Concurrency and rate limits on the API routes (POST /v1/responses[/input_tokens]).

    limits:
      global_concurrency: 1024      # requests in flight over all keys (null: unlimited)
      default_key_concurrency: 64   # per key, unless the key has its own `concurrency`
      retry_after_s: 1              # Retry-After on a concurrency 429

Over a concurrency limit -> 429 `concurrency_limit` with Retry-After. A key with
`rate_per_min` gets an in-memory token bucket holding one minute's allowance and
refilling continuously; empty -> 429 `rate_limit_exceeded` with Retry-After set to the
seconds until the next token. A key with `tokens_per_min` has a second bucket, of tokens:
it holds one minute's allowance, refills continuously, and is debited after each request
by the tokens it used (input + output, as billed); while it is empty (at or below zero)
the key's requests get 429 `tokens_per_min_exceeded` with Retry-After set to the seconds
until it is positive again. A request's size is only known once it ran, so the last
request admitted may take the bucket below zero: the next ones wait that much longer.
A slot is held for the whole request, a stream included
(the handler returns once the stream has ended), and is given back in a finally, so a
client that disconnects frees it too. Counters are per process.
"""

from __future__ import annotations

import math
import time
from typing import Any

from aiohttp import web

from proxy.config.load import ConfigError
from proxy.http.errors import APIError
from proxy.state import RequestContext

_GUARDED = ("/v1/responses", "/v1/responses/input_tokens")


def _opt_positive(section: dict, name: str, default: Any) -> int | None:
    value = section.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"limits.{name} must be a positive integer or null, not {value!r}")
    return value


class _Bucket:
    __slots__ = ("tokens", "stamp")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


class _TokenBuckets:
    """Per key: tokens left of its tokens_per_min, refilled continuously, debited after use."""

    def __init__(self) -> None:
        self.buckets: dict[str, _Bucket] = {}

    def _refill(self, bucket: _Bucket, tpm: int, now: float) -> None:
        bucket.tokens = min(float(tpm), bucket.tokens + (now - bucket.stamp) * tpm / 60.0)
        bucket.stamp = now

    def wait(self, key_id: str, tpm: int) -> float:
        """0 when the key's bucket is positive, else the seconds until it is."""
        bucket = self.buckets.get(key_id)
        if bucket is None:
            return 0.0
        self._refill(bucket, tpm, time.monotonic())
        return 0.0 if bucket.tokens > 0 else (1.0 - bucket.tokens) * 60.0 / tpm

    def spend(self, key_id: str, tpm: int, used: int) -> None:
        now = time.monotonic()
        bucket = self.buckets.get(key_id)
        if bucket is None:
            bucket = self.buckets[key_id] = _Bucket(float(tpm), now)
        self._refill(bucket, tpm, now)
        bucket.tokens -= used
        if bucket.tokens >= tpm:
            del self.buckets[key_id]  # full again: forgotten (memory stays bounded by the busy keys)


def create(section: dict[str, Any], app: web.Application):
    global_limit = _opt_positive(section, "global_concurrency", 1024)
    key_default = _opt_positive(section, "default_key_concurrency", 64)
    retry_after = section.get("retry_after_s", 1)
    if isinstance(retry_after, bool) or not isinstance(retry_after, (int, float)) or retry_after < 0:
        raise ConfigError(f"limits.retry_after_s must be a non-negative number, not {retry_after!r}")
    retry_header = str(max(0, math.ceil(retry_after)))
    unknown = set(section) - {"global_concurrency", "default_key_concurrency", "retry_after_s"}
    if unknown:
        raise ConfigError(f"limits: unknown setting(s) {', '.join(sorted(unknown))}")

    in_flight: dict[str, int] = {}
    total = [0]
    buckets: dict[str, _Bucket] = {}

    def take_token(key_id: str, rate: int) -> float:
        """0 when a token was taken, else the seconds until one is there."""
        now = time.monotonic()
        per_s = rate / 60.0
        bucket = buckets.get(key_id)
        if bucket is None:
            bucket = buckets[key_id] = _Bucket(float(rate), now)
        bucket.tokens = min(float(rate), bucket.tokens + (now - bucket.stamp) * per_s)
        bucket.stamp = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / per_s

    tokens = _TokenBuckets()

    def busy(message: str) -> APIError:
        return APIError(429, message, code="concurrency_limit", headers={"Retry-After": retry_header})

    async def limits(request: web.Request, ctx: RequestContext, call_next) -> web.StreamResponse:
        if ctx.method != "POST" or ctx.path not in _GUARDED:
            return await call_next(request, ctx)
        record = ctx.key
        key_id = record.key_id if record is not None else None
        key_limit = (record.concurrency or key_default) if record is not None else None
        # Everything from the checks to the increments runs without an await: no other
        # request can slip in between.
        if global_limit is not None and total[0] >= global_limit:
            raise busy("The proxy is at its concurrency limit; retry shortly.")
        if key_id is not None and key_limit is not None and in_flight.get(key_id, 0) >= key_limit:
            raise busy(f"This API key already has {key_limit} requests in flight; retry when one finishes.")
        if record is not None and record.rate_per_min:
            wait = take_token(key_id, record.rate_per_min)
            if wait > 0:
                raise APIError(429, f"Rate limit of {record.rate_per_min} requests per minute reached for this API key.",
                               code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})
        tpm = record.tokens_per_min if record is not None else None
        if tpm:
            wait = tokens.wait(key_id, tpm)
            if wait > 0:
                raise APIError(429, f"Limit of {tpm} tokens per minute reached for this API key.",
                               code="tokens_per_min_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})
        total[0] += 1
        if key_id is not None:
            in_flight[key_id] = in_flight.get(key_id, 0) + 1
        try:
            return await call_next(request, ctx)
        finally:
            if tpm:
                out = ctx.outcome
                if out is not None:
                    tokens.spend(key_id, tpm, out.input_tokens + out.output_tokens)
            total[0] -= 1
            if key_id is not None:
                left = in_flight[key_id] - 1
                if left:
                    in_flight[key_id] = left
                else:
                    del in_flight[key_id]

    return limits
