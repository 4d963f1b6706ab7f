"""The ledger interface: the records, the errors and the abstract `Ledger` every backend implements.

proxy.ledger (the package) re-exports all of it with `open_ledger`; backends (proxy.ledger.sqlite)
import it from here, so the package can import its backends without an import cycle.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from proxy.upstream.models import resolve_model, strip_vendor

SECRET_PREFIX = "sk-rp-"
USAGE_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled", "error"})


class _Unset:
    """Sentinel for `set_limits`: "leave this limit as it is" (None means "clear it")."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
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
    # Added by the operator's console (issue 18); defaults keep older callers working.
    expires_at: float | None = None  # Unix time after which lookup_key no longer finds it
    tokens_per_min: int | None = None  # input + output tokens per minute (middlewares/limits.py)
    daily_budget_micros: int | None = None  # spend per UTC day, on top of the balance
    monthly_budget_micros: int | None = None  # spend per UTC calendar month

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at

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
    worker: str | None = None  # the worker that answered (None: unknown, or rows from before it was kept)
    # The model that served it (proxy.upstream.models.resolve_model: one of the names the workers
    # serve), beside `model`, the client's string as sent (any alias, "vendor/name"...). The
    # console groups and filters by it: a bounded set, whatever strings clients send. None: rows
    # from before it was kept; those are grouped under `model` (grouped_model).
    served_model: str | None = None
    # The API path the request came in on (/v1/responses, /v1/chat/completions, /v1/messages, ...);
    # None: rows from before it was kept (all of them Responses).
    endpoint: str | None = None

    @property
    def grouped_model(self) -> str:
        """The model this row counts under in totals and the model filter: served_model, else model."""
        return self.model if self.served_model is None else self.served_model


# The usage columns both backends read, in UsageRecord's field order (a row is UsageRecord(*row));
# a page of rows reads seq first (UsageRecord(*row[1:])). And the most rows one page holds.
USAGE_RECORD_COLUMNS = ", ".join(f.name for f in fields(UsageRecord))
USAGE_ROW_COLUMNS = "seq, " + USAGE_RECORD_COLUMNS
MAX_PAGE = 100_000


def page_limit(limit: int) -> int:
    """A page's row count asked for, bounded to [0, MAX_PAGE]."""
    return max(0, min(int(limit), MAX_PAGE))


# The dimensions usage_totals groups by. "day" and "hour" are UTC buckets (their start, Unix time).
USAGE_GROUPS = ("key", "model", "worker", "day", "hour")


@dataclass(frozen=True)
class UsageTotals:
    """One group of usage_totals: its group values (by USAGE_GROUPS name) and its sums."""

    group: dict[str, Any]
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    reasoning_tokens: int
    cost_micros: int
    debited_micros: int


@dataclass(frozen=True)
class AuditEntry:
    """One change to a key: who (the admin key's name, "cli:<user>"), what, when, details.
    Details never hold a secret (proxy/ledger/service.py writes them)."""

    seq: int
    created_at: float
    actor: str
    action: str
    key_id: str | None
    details: dict[str, Any]


class LedgerError(Exception):
    """A ledger operation that cannot be done (unknown key, storage failure...)."""


# What each cause of a LedgerUnavailable / LedgerFault (proxy/ledger/pg_errors.py classifies
# the driver's errors) tells a client (the 503's message) and an operator (the log line).
FAULT_EXPLAINED = {
    "unreachable": "the ledger database cannot be reached",
    "too_many_connections": "the ledger database refuses more connections",
    "auth_failed": "the ledger database rejected the proxy's credentials",
    "database_missing": "the ledger database does not exist",
    "permission_denied": "the ledger database denies the proxy a privilege it needs",
    "schema_missing": "the ledger's tables are missing or changed in the database",
    "read_only": "the ledger database is read-only (a standby?)",
    "disk_full": "the ledger database's disk is full",
    "misconfigured": "the ledger database's connection settings are invalid",
    "database_error": "the ledger database answered with an unexpected error",
    "conflict": "the ledger database kept aborting the transaction",
}


class LedgerUnavailable(LedgerError):
    """The ledger's storage cannot be reached now (a database down, a timeout): the request
    path answers 503 with Retry-After `retry_after_s`, never 500; settlements that cannot
    reach it are spooled (proxy/ledger/spool.py) and replayed when it answers again."""

    def __init__(self, message: str = "the ledger database is unreachable", retry_after_s: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LedgerFault(LedgerUnavailable):
    """The ledger's database answers, but in a way no retry fixes (a rejected password, a
    missing table): the operator must act. Answered like LedgerUnavailable (503, settlements
    spooled and kept until a replay after the repair applies them), with its `cause` named
    (proxy/ledger/pg_errors.py) in the 503, in /readyz and in the log."""

    def __init__(self, message: str, retry_after_s: float = 5.0, cause: str = "database_error") -> None:
        super().__init__(message, retry_after_s)
        self.cause = cause


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

    # The cause of a fault no retry fixes (LedgerFault.cause), while it lasts; None when
    # healthy. Leases are not spent meanwhile and /readyz names it.
    fault: str | None = None

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

    async def __aenter__(self) -> Ledger:
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

    async def settle_behind(self, request_id: str, usage: UsageRecord) -> None:
        """Settle a request whose client waits for the end of its answer: the settlement is
        durable when this returns, and applied (as settle, exactly once) then or a moment
        later. A ledger on a database server writes it to a local file first and applies it
        after (proxy/ledger/pg_spool.py), so the answer does not wait on a round trip; a
        local ledger's commit is that file: it settles now."""
        await self.settle(request_id, usage, linger=False)

    async def settled(self, timeout: float = 2.0) -> None:  # noqa: B027 - a hook: a local ledger has nothing to wait for
        """Wait (at most `timeout`, never raising) until every settle_behind of this object is
        applied; a local ledger applies them at once."""

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
        *,
        tokens_per_min: int | None = None,
        daily_budget_micros: int | None = None,
        monthly_budget_micros: int | None = None,
        expires_at: float | None = None,
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
        tokens_per_min: Any = UNSET,
        daily_budget_micros: Any = UNSET,
        monthly_budget_micros: Any = UNSET,
        expires_at: Any = UNSET,
    ) -> KeyRecord:
        """Change limits; UNSET leaves a limit alone, None clears it. Bumps key_generation."""

    @abc.abstractmethod
    async def revoke(self, key_id: str) -> None:
        """Revoke a key (lookup_key returns None for it from now on)."""

    @abc.abstractmethod
    async def rotate_key(self, key_id: str) -> tuple[str, KeyRecord]:
        """A new secret for the same key (same id, balance, limits, usage); the old secret
        stops working at once (lookup_key). Returns the new secret, shown once. UnknownKey;
        LedgerError for a revoked key. Bumps key_generation."""

    # the operator's console (proxy/ledger/service.py, proxy/admin)
    @abc.abstractmethod
    async def append_audit(self, actor: str, action: str, key_id: str | None, details: dict[str, Any]) -> AuditEntry:
        """Append one entry to the audit log (append-only; its time is the ledger's now)."""

    @abc.abstractmethod
    async def list_audit(self, *, key_id: str | None = None, since: float | None = None,
                         until: float | None = None, before_seq: int | None = None,
                         limit: int = 100) -> list[AuditEntry]:
        """Audit entries, newest first: created_at in [since, until), seq < before_seq (the
        cursor of the next page), at most `limit`."""

    @abc.abstractmethod
    async def usage_rows(self, *, since: float | None = None, until: float | None = None,
                         key_id: str | None = None, model: str | None = None,
                         before_seq: int | None = None, limit: int = 100,
                         statuses: tuple[str, ...] | None = None) -> list[tuple[int, UsageRecord]]:
        """Usage records as (seq, record), newest first: created_at in [since, until),
        optionally of one key, one model (the served model: UsageRecord.grouped_model) and
        some statuses, seq < before_seq (the next page's cursor)."""

    @abc.abstractmethod
    async def usage_totals(self, group_by: tuple[str, ...], *, since: float | None = None,
                           until: float | None = None, key_id: str | None = None,
                           model: str | None = None, statuses: tuple[str, ...] | None = None) -> list[UsageTotals]:
        """Sums over usage records with created_at in [since, until) (and the filters),
        grouped by the USAGE_GROUPS names in `group_by` (none: one total), ordered by the
        group values. "day" / "hour" group by the UTC bucket's start (Unix seconds); "model"
        (and the `model` filter) is the served model (UsageRecord.grouped_model), never the
        client's unbounded string."""

    @abc.abstractmethod
    async def spend_since(self, key_id: str, since: float) -> int:
        """The sum of debited_micros of the key's usage records with created_at >= since
        (budgets and GET /v1/key: one indexed range read)."""
