"""The ledger's values: the records, `KeyLimits` and the errors every backend and caller shares.

The abstract interface built on them is proxy/ledger/interface.py (`RequestLedger`, `KeyStore`,
`ConsoleReads` and their union `Ledger`). proxy.ledger (the package) re-exports both with
`open_ledger`; backends (proxy.ledger.sqlite) import them from these modules, so the package can
import its backends without an import cycle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from proxy.protocol.models import resolve_model, strip_vendor

SECRET_PREFIX = "sk-rp-"
USAGE_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled", "error"})


class _Unset:
    """Sentinel for a KeyLimits field: "not given", so set_limits leaves that limit as it is
    (None means "clear it") and create_key starts the key without it."""

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


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's limits as one value: what create_key starts a key with and what set_limits
    changes. A field left UNSET is not given: create_key reads it as None (no limit), set_limits
    leaves the key's value as it is; None clears a limit. The values are checked by the ledger
    (proxy/ledger/key_rules.py) and, from JSON, by proxy/ledger/service.py parse_limits."""

    allowed_models: Sequence[str] | _Unset | None = UNSET  # None: every model
    concurrency: int | _Unset | None = UNSET  # requests in flight
    rate_per_min: int | _Unset | None = UNSET  # requests per minute
    tokens_per_min: int | _Unset | None = UNSET  # input + output tokens per minute
    daily_budget_micros: int | _Unset | None = UNSET  # spend per UTC day
    monthly_budget_micros: int | _Unset | None = UNSET  # spend per UTC calendar month
    expires_at: float | _Unset | None = UNSET  # Unix time; None: never
    blocked: bool | _Unset | None = UNSET  # refused until unblocked
    tags: Sequence[str] | _Unset | None = UNSET
    metadata: dict[str, Any] | _Unset | None = UNSET

    def given(self) -> dict[str, Any]:
        """The fields given (not UNSET) by name, in field order: what set_limits changes and
        what an audit entry records."""
        return {name: value for name in KEY_LIMIT_FIELDS if (value := getattr(self, name)) is not UNSET}


NO_LIMITS = KeyLimits()  # every field UNSET: a new key without limits

# KeyLimits' field names, in order (the admin API's and the CLI's limit fields are these).
KEY_LIMIT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(KeyLimits))


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
    expires_at: float | None = None  # Unix time after which the key is refused
    tokens_per_min: int | None = None  # input + output tokens per minute (middlewares/limits.py)
    daily_budget_micros: int | None = None  # spend per UTC day, on top of the balance
    monthly_budget_micros: int | None = None  # spend per UTC calendar month

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at

    # Added by the organisation (issue 39); defaults keep older callers working.
    org_id: str | None = None  # the levels above the key (proxy/ledger/levels.py), fixed at creation
    team_id: str | None = None
    user_id: str | None = None
    own_balance: bool = True  # False: the key has no purse of its own; its levels' pay
    blocked: bool = False  # refused until unblocked (a revoke is for good)
    tags: tuple[str, ...] = ()
    metadata: dict[str, Any] | None = None
    grace_until: float | None = None  # a rotated key's previous secret works until then
    presented_previous: bool = False  # lookup_key found it by that previous secret

    @property
    def levels(self) -> tuple[str, ...]:
        """The key's level ids, top down (org, team, user)."""
        return tuple(level for level in (self.org_id, self.team_id, self.user_id) if level is not None)

    def allows_model(self, model: str, served: Callable[[str], bool] | None = None) -> bool:
        """True when the key may use `model` (models_allow over its allowed_models)."""
        allowed = self.allowed_models
        return allowed is None or model in allowed or models_allow(allowed, model, served)


def models_allow(allowed: Sequence[str] | None, model: str, served: Callable[[str], bool] | None = None) -> bool:
    """True when `allowed` (None: every model) admits `model`: it is listed, or it means
    (proxy.protocol.models.resolve_model over the `served` names) the same served model as a
    listed name, or a listed pattern ending in '*' ("qwen/*") matches it. Without `served`, the
    listed names stand for themselves. Keys and levels (proxy/ledger/levels.py) share it."""
    if allowed is None or model in allowed:
        return True
    if any(m.endswith("*") and model.startswith(m[:-1]) for m in allowed):
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
    # The model that served it (proxy.protocol.models.resolve_model: one of the names the workers
    # serve), beside `model`, the client's string as sent (any alias, "vendor/name"...). The
    # console groups and filters by it: a bounded set, whatever strings clients send. None: rows
    # from before it was kept; those are grouped under `model` (grouped_model).
    served_model: str | None = None
    # The API path the request came in on (/v1/responses, /v1/chat/completions, /v1/messages, ...);
    # None: rows from before it was kept (all of them Responses).
    endpoint: str | None = None
    # What carried it (http | websocket) and how long it took, from its arrival to its settlement
    # (the end of its answer), in ms; None: rows from before they were kept.
    transport: str | None = None
    latency_ms: float | None = None

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
USAGE_GROUPS = ("key", "model", "worker", "day", "hour", "team", "user", "org", "endpoint")


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


# What each cause of a LedgerUnavailable / LedgerFault (proxy/ledger/postgres/errors.py classifies
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
    "spool_full": "the ledger's local spool is on a full disk",
    "spool_unwritable": "the ledger's local spool cannot be written",
}


class LedgerUnavailable(LedgerError):
    """The ledger's storage cannot be reached now (a database down, a timeout): the request
    path answers 503 with Retry-After `retry_after_s`, never 500; settlements that cannot
    reach it are spooled (proxy/ledger/spool.py) and replayed when it answers again."""

    def __init__(self, message: str = "the ledger database is unreachable", retry_after_s: float = 5.0,
                 reason: str = "unreachable") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason  # /readyz's cause: "unreachable", "too_many_connections" (FAULT_EXPLAINED's keys)


class LedgerDataRefused(LedgerUnavailable):
    """The database refused one operation for its data (SQLSTATE class 22: a NUL in a text, a
    value out of range): that operation alone fails; the ledger is in no fault for it, and a
    spooled settlement refused so is set aside (`<spool>.rejected`), never stopping the others."""


class LedgerFault(LedgerUnavailable):
    """The ledger's database answers, but in a way no retry fixes (a rejected password, a
    missing table): the operator must act. Answered like LedgerUnavailable (503, settlements
    spooled and kept until a replay after the repair applies them), with its `cause` named
    (proxy/ledger/postgres/errors.py) in the 503, in /readyz and in the log."""

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
        self.level: str | None = None  # the level above the key whose room was the smallest (levels.py)

STATIC_PREFIX = "static:"  # key_id of a static key (auth.static_keys in config.yaml): "static:<name>"


def is_static(record: KeyRecord) -> bool:
    """A key from config.yaml (auth.static_keys), not the ledger: it has no balance to hold."""
    return record.key_id.startswith(STATIC_PREFIX)
