"""The in-memory limits backend: counters of this process only (`limits.backend: memory`).

`serve --workers N` divides the global limits by N for each child (proxy/runtime/supervisor.py);
a key's own limits apply per process. Everything from the checks to the increments runs
without an await, so no other request of this process slips in between.
"""

from __future__ import annotations

import time

from proxy.limits.base import GLOBAL, KEY, RATE, TOKENS, Ask, Refused


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


class MemoryCounter:
    """Slots and buckets in dicts of this process; a ticket is the Ask itself."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.total = 0
        self.rates: dict[str, _Bucket] = {}
        self.tokens = _TokenBuckets()

    def _take_token(self, key_id: str, rate: int) -> float:
        """0 when a token was taken, else the seconds until one is there."""
        now = time.monotonic()
        per_s = rate / 60.0
        bucket = self.rates.get(key_id)
        if bucket is None:
            bucket = self.rates[key_id] = _Bucket(float(rate), now)
        bucket.tokens = min(float(rate), bucket.tokens + (now - bucket.stamp) * per_s)
        bucket.stamp = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / per_s

    def admit_now(self, ask: Ask) -> Ask | Refused:
        key_id = ask.key_id
        if ask.global_limit is not None and self.total >= ask.global_limit:
            return Refused(GLOBAL)
        if key_id is not None and ask.key_limit is not None and self.in_flight.get(key_id, 0) >= ask.key_limit:
            return Refused(KEY)
        if key_id is not None and ask.rate_per_min:
            wait = self._take_token(key_id, ask.rate_per_min)
            if wait > 0:
                return Refused(RATE, wait)
        if key_id is not None and ask.tokens_per_min:
            wait = self.tokens.wait(key_id, ask.tokens_per_min)
            if wait > 0:
                return Refused(TOKENS, wait)
        self.total += 1
        if key_id is not None:
            self.in_flight[key_id] = self.in_flight.get(key_id, 0) + 1
        return ask

    def release_now(self, ticket: Ask, used_tokens: int | None) -> None:
        key_id = ticket.key_id
        if key_id is not None and ticket.tokens_per_min and used_tokens is not None:
            self.tokens.spend(key_id, ticket.tokens_per_min, used_tokens)
        self.total -= 1
        if key_id is not None:
            left = self.in_flight[key_id] - 1
            if left:
                self.in_flight[key_id] = left
            else:
                del self.in_flight[key_id]

    async def admit(self, ask: Ask) -> Ask | Refused:
        return self.admit_now(ask)

    async def release(self, ticket: Ask, used_tokens: int | None) -> None:
        self.release_now(ticket, used_tokens)
