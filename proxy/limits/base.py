"""What a limits backend counts, and the interface both backends share.

middlewares/limits.py is the policy (which limit, which 429, which Retry-After); a backend
only counts: `admit(ask)` takes a concurrency slot (global and per key) and a rate token
and checks the tokens-per-minute bucket, all or nothing; `release(ticket, used)` gives the
slot back and debits the tokens the request used. The memory backend counts in this
process (proxy/limits/memory.py); the Redis one in a Redis every replica shares
(proxy/limits/redis_backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

# Which limit refused a request (Refused.scope).
GLOBAL = "global"  # limits.global_concurrency
KEY = "key"  # the key's concurrency (or limits.default_key_concurrency)
RATE = "rate"  # the key's rate_per_min
TOKENS = "tokens"  # the key's tokens_per_min


class Ask(NamedTuple):
    """One request's admission: the limits in force for it (read from the key record each
    time, so a changed limit applies to the next request). None: no such limit. Immutable
    (a NamedTuple: one is made for every request)."""

    key_id: str | None
    global_limit: int | None
    key_limit: int | None
    rate_per_min: int | None
    tokens_per_min: int | None


@dataclass(frozen=True, slots=True)
class Refused:
    scope: str  # GLOBAL, KEY, RATE or TOKENS
    wait_s: float = 0.0  # RATE, TOKENS: seconds until the bucket allows one more


class LimitsUnavailable(Exception):
    """The shared counter cannot be reached and `limits.redis.on_error` is `closed`."""


class Counter(Protocol):
    async def admit(self, ask: Ask) -> Any:
        """A ticket (hand it to release), or a Refused. Raises LimitsUnavailable."""

    async def release(self, ticket: Any, used_tokens: int | None) -> None:
        """The ticket's slot given back; `used_tokens` (input + output, None when the request
        has no outcome) debited from its key's tokens-per-minute bucket. Never raises."""
