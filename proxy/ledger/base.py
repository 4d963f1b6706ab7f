"""The ledger interface: the records, the errors and the abstract `Ledger` every backend implements.

proxy.ledger (the package) re-exports all of it with `open_ledger`; backends (proxy.ledger.sqlite)
import it from here, so the package can import its backends without an import cycle.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from proxy.upstream.models import resolve_model, strip_vendor


SECRET_PREFIX = "sk-rp-"
USAGE_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled", "error"})


class _Unset:
    """Sentinel for `set_limits`: "leave this limit as it is" (None means "clear it")."""

    _instance: "_Unset | None" = None

    def __new__(cls) -> "_Unset":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Any = _Unset()


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    name: str
    prefix: str  # first 12 characters of the secret ("sk-rp-" + 6), for display only
    balance_micros: int
    allowed_models: tuple[str, ...] | None  # None: every model
    concurrency: int | None
    rate_per_min: int | None
    revoked: bool
    created_at: float

    def allows_model(self, model: str, served: Callable[[str], bool] | None = None) -> bool:
        """True when the key may use `model`: it is listed, or it means (proxy.upstream.models.resolve_model
        over the `served` names) the same served model as a listed name. Without `served`, the
        listed names stand for themselves."""
        allowed = self.allowed_models
        if allowed is None or model in allowed:
            return True
        if served is None:  # a listed "vendor/name" means "name", as it would if "vendor/name" were not served
            return resolve_model(model, allowed) is not None or any(strip_vendor(m) == model for m in allowed)
        target = resolve_model(model, served)
        return target is not None and any(resolve_model(m, served) == target for m in allowed)


@dataclass
class Hold:
    request_id: str
    key_id: str
    amount_micros: int
    expires_at: float


@dataclass
class UsageRecord:
    request_id: str
    key_id: str
    model: str
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    reasoning_tokens: int
    cost_micros: int  # the real cost of the request
    status: str  # completed | incomplete | failed | cancelled | error
    created_at: float = field(default_factory=time.time)
    # What was actually taken from the balance: cost clamped at the balance (never below 0).
    # Filled in by the ledger; ignored on input to settle().
    debited_micros: int | None = None


class LedgerError(Exception):
    """A ledger operation that cannot be done (unknown key, storage failure...)."""


class UnknownKey(LedgerError):
    def __init__(self, key_id: str) -> None:
        super().__init__(f"unknown key id {key_id!r}")
        self.key_id = key_id


class DuplicateRequest(LedgerError):
    """hold() for a request id that already has a hold or is already settled."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} already has a hold or a usage record")
        self.request_id = request_id


class InsufficientBalance(LedgerError):
    def __init__(self, available_micros: int, requested_micros: int | None = None) -> None:
        message = f"insufficient balance: {available_micros} micros available"
        if requested_micros is not None:
            message += f", {requested_micros} requested"
        super().__init__(message)
        self.available_micros = available_micros
        self.requested_micros = requested_micros


class Ledger(abc.ABC):
    """The async ledger interface. Every method is safe to call concurrently."""

    # True when lease_grow / lease_commit exist (proxy/ledger/lease.py); else Leases always
    # takes the exact per-request path.
    supports_leases: bool = False

    # Bumped (after the commit) by every change to a key made through THIS object (revoke,
    # set_limits). An in-process cache of lookup_key results remembers the value it saw
    # before its lookup and drops entries filled under an older one, so a revoke through
    # the same ledger takes effect at once; changes by other processes (the CLI, other
    # workers) are only bounded by the cache's TTL.
    key_generation: int = 0

    # lifecycle
    @abc.abstractmethod
    async def start(self) -> None:
        """Open storage, create the schema, and expire holds whose ttl has passed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish every queued operation, then close storage. Idempotent."""

    async def __aenter__(self) -> "Ledger":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # the request path
    @abc.abstractmethod
    async def lookup_key(self, secret: str) -> KeyRecord | None:
        """The key for a presented secret; None for unknown or revoked keys."""

    @abc.abstractmethod
    async def available(self, key_id: str) -> int:
        """Balance minus the open (unexpired) holds. UnknownKey if there is no such key."""

    @abc.abstractmethod
    async def hold(self, request_id: str, key_id: str, amount_micros: int, ttl_s: float) -> Hold:
        """Reserve funds atomically. InsufficientBalance if available < amount;
        DuplicateRequest if the request id has a hold or was settled; UnknownKey."""

    async def hold_up_to(
        self, request_id: str, key_id: str, min_micros: int, max_micros: int, ttl_s: float
    ) -> Hold:
        """Hold min(available, max_micros) if available >= min_micros, else raise
        InsufficientBalance(available, min_micros); DuplicateRequest / UnknownKey as hold().

        This default is correct for any backend whose hold() is atomic (hold() re-checks, so
        a race can only make it retry, never overdraw) but costs two round trips; backends
        override it with a single atomic operation (SQLiteLedger does)."""
        if not 0 <= min_micros <= max_micros:
            raise ValueError("need 0 <= min_micros <= max_micros")
        available = 0
        for _ in range(3):
            available = await self.available(key_id)
            if available < min_micros:
                break
            try:
                return await self.hold(request_id, key_id, min(available, max_micros), ttl_s)
            except InsufficientBalance:
                continue  # another request took part of it meanwhile
        raise InsufficientBalance(max(available, 0), min_micros)

    @abc.abstractmethod
    async def settle(self, request_id: str, usage: UsageRecord, *, linger: bool = True) -> bool:
        """Record usage and debit its cost exactly once, dropping the hold in the same
        transaction. The debit is clamped at the balance (never below 0) and at the request's
        own hold while it exists; the record keeps both cost_micros and debited_micros. False
        (and no debit) if already settled. `linger`: the backend may wait a few ms for other
        settles to share the commit (False: someone is waiting for this one)."""

    @abc.abstractmethod
    async def release(self, request_id: str, *, linger: bool = True) -> bool:
        """Drop a hold without charge. True if there was one. `linger` as for settle()."""

    @abc.abstractmethod
    async def expire_holds(self, now: float | None = None) -> int:
        """Drop holds with expires_at <= now; returns how many."""

    @abc.abstractmethod
    async def usage(self, request_id: str) -> UsageRecord | None:
        """The usage record of a settled request."""

    @abc.abstractmethod
    async def list_usage(self, key_id: str | None = None, limit: int = 50) -> list[UsageRecord]:
        """The most recent usage records, newest first (optionally for one key)."""

    # key management (the CLI and tests)
    @abc.abstractmethod
    async def create_key(
        self,
        name: str,
        balance_micros: int = 0,
        allowed_models: list[str] | tuple[str, ...] | None = None,
        concurrency: int | None = None,
        rate_per_min: int | None = None,
    ) -> tuple[str, KeyRecord]:
        """A new key; returns the secret (shown once, never stored) and the record."""

    @abc.abstractmethod
    async def get_key(self, key_id: str) -> KeyRecord | None:
        """A key by id, revoked or not."""

    @abc.abstractmethod
    async def list_keys(self) -> list[KeyRecord]:
        """Every key, oldest first, revoked included."""

    @abc.abstractmethod
    async def top_up(self, key_id: str, micros: int) -> int:
        """Add to the balance (negative corrects it, never below 0); returns the new balance."""

    @abc.abstractmethod
    async def set_limits(
        self,
        key_id: str,
        *,
        allowed_models: Any = UNSET,
        concurrency: Any = UNSET,
        rate_per_min: Any = UNSET,
    ) -> KeyRecord:
        """Change limits; UNSET leaves a limit alone, None clears it."""

    @abc.abstractmethod
    async def revoke(self, key_id: str) -> None:
        """Revoke a key (lookup_key returns None for it from now on)."""
