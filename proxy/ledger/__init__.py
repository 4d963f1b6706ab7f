"""The durable ledger: API keys, prepaid balances, holds and usage records.

The auth and balance middlewares talk to a `Ledger` only through this interface, so a
second backend (Redis) can follow without touching them. `open_ledger(section)` picks
the backend from the "ledger" config section.

Money is integer micro-units of the account currency everywhere (no floats).

The flow for one request:
  lookup_key(secret)              -> KeyRecord (auth; callers may cache it, see key_generation)
  hold_up_to(request_id, key_id, min, max, ttl_s)  reserves min(available, max) in one
                                  atomic step; InsufficientBalance if available < min
  hold(request_id, key_id, amount, ttl_s)  reserves exactly `amount`; InsufficientBalance if it cannot
  settle(request_id, usage)       debits the real cost exactly once and drops the hold
  release(request_id)             drops the hold without charge (nothing was produced)
  expire_holds()                  drops holds whose ttl has passed (crashed requests)

Backends with `supports_leases` (SQLiteLedger) also offer lease_grow / lease_commit, which
proxy.ledger.lease.Leases uses to take request holds from a per-process lease in memory and
commit settles in batches (see that module); the balance middleware goes through Leases.

Key management and the operator's console (create / rotate / limits / budgets / expiry, the
audit log, usage rows and totals over time ranges, spend since a time) are abstract methods
of the same interface; proxy.ledger.service holds their rules, shared by the keys CLI and the
admin API (proxy/admin/).

Secrets never appear in logs, exception messages or reprs; they are stored as sha256.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proxy.ledger.base import (  # the interface, re-exported: callers import it from the package
    SECRET_PREFIX,
    UNSET,
    USAGE_GROUPS,
    USAGE_STATUSES,
    AuditEntry,
    DuplicateRequest,
    Hold,
    InsufficientBalance,
    KeyRecord,
    Ledger,
    LedgerError,
    LedgerFault,
    LedgerUnavailable,
    UnknownKey,
    UsageRecord,
    UsageTotals,
)

__all__ = [
    "KeyRecord",
    "Hold",
    "UsageRecord",
    "UsageTotals",
    "USAGE_GROUPS",
    "AuditEntry",
    "USAGE_STATUSES",
    "LedgerError",
    "LedgerUnavailable",
    "LedgerFault",
    "UnknownKey",
    "DuplicateRequest",
    "InsufficientBalance",
    "Ledger",
    "UNSET",
    "open_ledger",
    "SECRET_PREFIX",
]


def resolve_path(path: str, base_dir: str | Path | None = None) -> str:
    """A relative ledger path is taken relative to base_dir (default: the current directory)."""
    if path == ":memory:":
        return path
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = Path(base_dir if base_dir is not None else Path.cwd()) / p
    return str(p)


def open_ledger(config_section: dict[str, Any] | None, base_dir: str | Path | None = None) -> Ledger:
    """The backend named by the "ledger" config section (not started: `await ledger.start()`).

    sqlite: {"backend": "sqlite", "path": "data/ledger.db", "synchronous": "FULL",
             "hold_synchronous": "NORMAL", "busy_timeout_ms": 5000, "max_batch": 1024,
             "settle_linger_ms": 5}
    postgres: {"backend": "postgres", "dsn": "postgresql://user@host/db", "pool_min": 1, "pool_max": 10,
               "statement_timeout_ms": 5000, "connect_timeout_s": 5,
               "spool_path": "data/ledger-spool.jsonl", "unavailable_retry_after_s": 5}
    """
    section = dict(config_section or {})
    backend = str(section.get("backend", "sqlite")).lower()
    if backend == "sqlite":
        from proxy.ledger.sqlite import SQLiteLedger

        return SQLiteLedger(
            resolve_path(str(section.get("path") or "data/ledger.db"), base_dir),
            synchronous=str(section.get("synchronous", "FULL")),
            hold_synchronous=str(section.get("hold_synchronous", "NORMAL")),
            busy_timeout_ms=int(section.get("busy_timeout_ms", 5000)),
            max_batch=int(section.get("max_batch", 1024)),
            settle_linger_s=float(section.get("settle_linger_ms", 5)) / 1000,
        )
    if backend == "postgres":
        from proxy.ledger.postgres import PostgresLedger

        dsn = section.get("dsn")
        if not dsn:
            raise LedgerError("ledger.backend is postgres but ledger.dsn is empty (is its environment variable set?)")
        return PostgresLedger(
            str(dsn),
            pool_min=int(section.get("pool_min", 1)),
            pool_max=int(section.get("pool_max", 10)),
            statement_timeout_ms=int(section.get("statement_timeout_ms", 5000)),
            connect_timeout_s=float(section.get("connect_timeout_s", 5)),
            spool_path=resolve_path(str(section.get("spool_path") or "data/ledger-spool.jsonl"), base_dir),
            unavailable_retry_after_s=float(section.get("unavailable_retry_after_s", 5)),
        )
    raise LedgerError(f"unknown ledger backend {backend!r} (known: sqlite, postgres)")
