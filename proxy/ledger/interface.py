"""The ledger interface, split by who uses it:

  * `RequestLedger`: the request path (middlewares/auth.py, middlewares/balance.py through
    proxy/ledger/lease.py): key lookup, holds, settles, releases, spend for budgets, and the
    lease operations, declared here with `supports_leases` so no caller probes for them;
  * `KeyStore`: key management and its audit log (proxy/ledger/service.py, which the keys CLI
    and the admin API call);
  * `ConsoleReads`: the operator's reads (usage rows and totals, the audit log, a request's
    usage record).

`Ledger` is their union plus the lifecycle: every backend implements it, the app and the CLI
hold one object, and each caller is typed against the part it uses.
"""

from __future__ import annotations

import abc
from typing import Any

from proxy.ledger.base import (
    NO_LIMITS,
    AuditEntry,
    Hold,
    InsufficientBalance,
    KeyLimits,
    KeyRecord,
    LedgerError,
    UsageRecord,
    UsageTotals,
)
from proxy.ledger.level_store import LevelStore

__all__ = ["RequestLedger", "KeyStore", "ConsoleReads", "Ledger"]

# (lease id, give back, new ttl or None, drop?) per lease of a lease_commit
LeaseChange = tuple[str, int, float | None, bool]


class RequestLedger(abc.ABC):
    """What a request needs of the ledger. Every method is safe to call concurrently."""

    # True when the backend implements hold_up_to's lease_return, lease_grow and lease_commit
    # (proxy/ledger/lease.py); else Leases always takes the exact per-request path.
    supports_leases: bool = False

    # The folder of the lease journals (proxy/ledger/lease_journal.py): leased usage rows on
    # local disk before their answers end, beside the ledger's own files. None: no local disk.
    lease_journal_path: str | None = None

    # The cause of a fault no retry fixes (LedgerFault.cause), while it lasts; None when
    # healthy. Leases are not spent meanwhile and /readyz names it.
    fault: str | None = None

    # Bumped (after the commit) by every change to a key made through THIS object (revoke,
    # set_limits, rotate_key: KeyStore). An in-process cache of lookup_key results remembers
    # the value it saw before its lookup and drops entries filled under an older one, so a
    # revoke through the same ledger takes effect at once; changes by other processes (the
    # CLI, other workers) are only bounded by the cache's TTL.
    key_generation: int = 0

    @abc.abstractmethod
    async def lookup_key(self, secret: str) -> KeyRecord | None:
        """The key for a presented secret, a revoked or expired one included (the caller refuses
        those, telling why); None for a secret no key has."""

    @abc.abstractmethod
    async def available(self, key_id: str) -> int:
        """Balance minus the open (unexpired) holds. UnknownKey if there is no such key."""

    @abc.abstractmethod
    async def hold(self, request_id: str, key_id: str, amount_micros: int, ttl_s: float) -> Hold:
        """Reserve funds atomically. InsufficientBalance if available < amount;
        DuplicateRequest if the request id has a hold or was settled; UnknownKey."""

    async def hold_up_to(
        self, request_id: str, key_id: str, min_micros: int, max_micros: int, ttl_s: float,
        *, lease_return: tuple[str, int] | None = None,
    ) -> Hold:
        """Hold min(available, max_micros) if available >= min_micros, else raise
        InsufficientBalance(available, min_micros); DuplicateRequest / UnknownKey as hold().
        `lease_return` = (lease id, micros), only with supports_leases: first give that much
        of a lease back, in the same transaction, kept even when the hold is refused.

        This default is correct for any backend whose hold() is atomic (hold() re-checks, so
        a race can only make it retry, never overdraw) but costs two round trips; backends
        override it with a single atomic operation (SQLiteLedger does)."""
        if lease_return is not None:
            raise LedgerError(f"{type(self).__name__} has no leases (supports_leases is False)")
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
        after (proxy/ledger/postgres/spool.py), so the answer does not wait on a round trip; a
        local ledger's commit is that file: it settles now."""
        await self.settle(request_id, usage, linger=False)

    async def settled(self, timeout: float = 2.0) -> None:  # noqa: B027 - a hook: a local ledger has nothing to wait for
        """Wait (at most `timeout`, never raising) until every settle_behind of this object is
        applied; a local ledger applies them at once."""

    @abc.abstractmethod
    async def release(self, request_id: str, *, linger: bool = True, key_id: str | None = None) -> bool:
        """Drop a hold without charge. True if there was one. `linger` as for settle().
        `key_id`, when the caller knows it: a hold of the request still on its way (its client
        left while it was in flight) can never be made after this release (PostgreSQL: a
        zero tombstone under the key's row lock; SQLite: its one writer runs them in order)."""

    @abc.abstractmethod
    async def expire_holds(self, now: float | None = None) -> int:
        """Drop holds with expires_at <= now; returns how many."""

    @abc.abstractmethod
    async def spend_since(self, key_id: str, since: float) -> int:
        """The sum of debited_micros of the key's usage records with created_at >= since
        (budgets on the request path, and GET /v1/key: one indexed range read)."""

    # leases (proxy/ledger/lease.py): only called when supports_leases is True
    async def lease_grow(
        self, lease_id: str, key_id: str, min_micros: int, max_micros: int, ttl_s: float, share: int = 2
    ) -> tuple[int, bool]:
        """Add min(max_micros, available // share) to the hold row `lease_id` (created if
        missing) and push its expiry to now + ttl_s; nothing when that is below min_micros.
        available excludes the lease itself. Returns (granted, whether the row was still
        there unexpired before)."""
        raise LedgerError(f"{type(self).__name__} has no leases (supports_leases is False)")

    async def lease_commit(
        self, usages: list[tuple[str, UsageRecord]], leases: list[LeaseChange]
    ) -> tuple[list[int | BaseException | None], set[str]]:
        """One transaction: record each (lease id, usage) exactly once and debit its cost from
        the balance (clamped at it), taking the debit off the lease's hold row too, so
        available = balance - holds does not move; then for each (lease id, give back, ttl,
        drop) of `leases`: give that much back (never below 0), push the expiry to now + ttl
        (None: leave it), or drop the row. Returns (per usage: the debit, None if already
        recorded, or the error; the lease ids whose row had expired or vanished)."""
        raise LedgerError(f"{type(self).__name__} has no leases (supports_leases is False)")


class KeyStore(abc.ABC):
    """Key management (proxy/ledger/service.py: the keys CLI and the admin API)."""

    key_generation: int = 0  # RequestLedger's: bumped by set_limits, revoke and rotate_key

    @abc.abstractmethod
    async def create_key(
        self, name: str, balance_micros: int = 0, limits: KeyLimits = NO_LIMITS,
        placement: dict[str, Any] | None = None,
    ) -> tuple[str, KeyRecord]:
        """A new key; returns the secret (shown once, never stored) and the record. A limit
        left UNSET in `limits` is None (no limit). `placement`: the levels it sits under
        (LevelStore.placement's columns) and own_balance (False: its levels pay)."""

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
    async def set_limits(self, key_id: str, limits: KeyLimits) -> KeyRecord:
        """Change limits; a field UNSET in `limits` is left alone, None clears it. Bumps
        key_generation."""

    @abc.abstractmethod
    async def revoke(self, key_id: str) -> None:
        """Revoke a key (lookup_key finds it revoked from now on). Bumps key_generation."""

    @abc.abstractmethod
    async def rotate_key(self, key_id: str, grace_s: float = 0.0) -> tuple[str, KeyRecord]:
        """A new secret for the same key (same id, balance, limits, usage); the old secret
        stops working when `grace_s` seconds have passed (0: at once; lookup_key finds it
        meanwhile, marked presented_previous). Returns the new secret, shown once. UnknownKey;
        LedgerError for a revoked key. Bumps key_generation."""

    @abc.abstractmethod
    async def delete_key(self, key_id: str) -> None:
        """Revoke the key for good and leave it out of list_keys (its rows stay). Bumps
        key_generation."""

    @abc.abstractmethod
    async def append_audit(self, actor: str, action: str, key_id: str | None, details: dict[str, Any]) -> AuditEntry:
        """Append one entry to the audit log of key changes (append-only; its time is the
        ledger's now)."""


class ConsoleReads(abc.ABC):
    """The operator's reads (the admin API and dashboard, the keys CLI, the key metrics)."""

    @abc.abstractmethod
    async def usage(self, request_id: str) -> UsageRecord | None:
        """The usage record of a settled request."""

    @abc.abstractmethod
    async def list_usage(self, key_id: str | None = None, limit: int = 50) -> list[UsageRecord]:
        """The most recent usage records, newest first (optionally for one key)."""

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
                         statuses: tuple[str, ...] | None = None,
                         endpoint: str | None = None) -> list[tuple[int, UsageRecord]]:
        """Usage records as (seq, record), newest first: created_at in [since, until),
        optionally of one key, one model (the served model: UsageRecord.grouped_model), one
        endpoint (the API path; rows from before it was kept count as /v1/responses) and some
        statuses, seq < before_seq (the next page's cursor)."""

    @abc.abstractmethod
    async def usage_totals(self, group_by: tuple[str, ...], *, since: float | None = None,
                           until: float | None = None, key_id: str | None = None,
                           model: str | None = None, statuses: tuple[str, ...] | None = None) -> list[UsageTotals]:
        """Sums over usage records with created_at in [since, until) (and the filters),
        grouped by the USAGE_GROUPS names in `group_by` (none: one total), ordered by the
        group values. "day" / "hour" group by the UTC bucket's start (Unix seconds); "model"
        (and the `model` filter) is the served model (UsageRecord.grouped_model), never the
        client's unbounded string."""


class Ledger(RequestLedger, KeyStore, LevelStore, ConsoleReads):
    """The whole ledger: what a backend implements and what open_ledger returns."""

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
