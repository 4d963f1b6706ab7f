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

Backends with `supports_leases` (both of them) also implement lease_grow / lease_commit,
which proxy.ledger.lease.Leases uses to take request holds from a per-process lease in memory
and commit settles in batches (see that module); the balance middleware goes through Leases.

The interface is split by who uses it (proxy/ledger/interface.py): `RequestLedger` (the flow
above, spend since a time for budgets, leases), `KeyStore` (create / rotate / limits as one
`KeyLimits` value / top up / revoke, the audit log's writes) and `ConsoleReads` (the audit
log, usage rows and totals over time ranges); `Ledger` is their union, what a backend
implements. proxy.ledger.service holds the key and report rules, shared by the keys CLI and
the admin API (proxy/admin/).

Secrets never appear in logs, exception messages or reprs; they are stored as sha256.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from proxy.config import settings as config_settings
from proxy.config.types import ConfigError
from proxy.ledger.base import (  # the interface, re-exported: callers import it from the package
    SECRET_PREFIX,
    UNSET,
    USAGE_GROUPS,
    USAGE_STATUSES,
    AuditEntry,
    DuplicateRequest,
    Hold,
    InsufficientBalance,
    KeyLimits,
    KeyRecord,
    LedgerError,
    LedgerFault,
    LedgerUnavailable,
    UnknownKey,
    UsageRecord,
    UsageTotals,
)
from proxy.ledger.interface import ConsoleReads, KeyStore, Ledger, RequestLedger

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
    "RequestLedger",
    "KeyStore",
    "ConsoleReads",
    "KeyLimits",
    "UNSET",
    "open_ledger",
    "migrate_ledger",
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


def open_ledger(section: Any, base_dir: str | Path | None = None) -> Ledger:
    """The backend config.yaml `ledger` names (config.ledger), not started: `await ledger.start()`.

    A mapping of its keys (a tool's or a test's {"path": ...}) is read as that section, the
    rest at the schema's defaults.
    """
    if section is None or isinstance(section, Mapping):
        try:
            section = config_settings.of("ledger", {k: os.fspath(v) if isinstance(v, os.PathLike) else v
                                                    for k, v in (section or {}).items()})
        except ConfigError as exc:
            raise LedgerError(str(exc)) from None
    backend = section.backend
    if backend == "sqlite":
        from proxy.ledger.sqlite.ledger import SQLiteLedger

        return SQLiteLedger(
            resolve_path(section.path, base_dir),
            synchronous=section.synchronous,
            hold_synchronous=section.hold_synchronous,
            busy_timeout_ms=section.busy_timeout_ms,
            max_batch=section.max_batch,
            settle_linger_s=section.settle_linger_ms / 1000,
        )
    if backend == "postgres":
        from proxy.ledger.postgres.ledger import PostgresLedger

        if not section.dsn:
            raise LedgerError("ledger.backend is postgres but ledger.dsn is empty (is its environment variable set?)")
        return PostgresLedger(
            section.dsn,
            pool_min=section.pool_min,
            pool_max=section.pool_max,
            statement_timeout_ms=section.statement_timeout_ms,
            connect_timeout_s=section.connect_timeout_s,
            spool_path=resolve_path(section.spool_path, base_dir),
            unavailable_retry_after_s=float(section.unavailable_retry_after_s),
        )
    raise LedgerError(f"unknown ledger backend {backend!r} (known: sqlite, postgres)")


async def migrate_ledger(section: Any, base_dir: str | Path | None = None) -> str:
    """Bring the ledger config.yaml names up to this release's schema, and nothing else (no
    listener, no spool, no sweep): what `responses-proxy migrate` and a deployment's migration
    job run, so replicas starting together never race on it (their own start finds it current).
    -> one line saying what it did. LedgerError for a schema newer than this release knows."""
    if section.backend == "sqlite":
        import sqlite3

        from proxy.ledger.schema import SQLITE_SCHEMA_VERSION, apply_schema
        from proxy.ledger.sqlite.writer import private_files

        path = resolve_path(section.path, base_dir)

        def run() -> None:
            private_files(Path(path))  # made 0600 (and its folder 0700) before SQLite opens it, as the ledger does
            conn = sqlite3.connect(path, timeout=section.busy_timeout_ms / 1000)
            try:
                # WAL as the ledger opens it: switching a file's journal mode takes it whole, so it
                # is done here once, not by N processes opening it at once
                conn.execute("PRAGMA journal_mode = WAL")
                apply_schema(conn)
                conn.commit()
            finally:
                conn.close()

        await asyncio.to_thread(run)
        return f"ledger (sqlite) at {path}: schema at version {SQLITE_SCHEMA_VERSION}"
    if section.backend == "postgres":
        import asyncpg

        from proxy.ledger.postgres.schema import latest_version, migrate

        if not section.dsn:
            raise LedgerError("ledger.backend is postgres but ledger.dsn is empty (is its environment variable set?)")
        conn = await asyncpg.connect(section.dsn, timeout=section.connect_timeout_s)
        try:
            applied = await migrate(conn)
        finally:
            await conn.close()
        done = f"applied {', '.join(map(str, applied))}" if applied else "nothing to apply"
        return f"ledger (postgres): schema at version {latest_version()} ({done})"
    raise LedgerError(f"ledger.backend is {section.backend}: there is no ledger to migrate")
