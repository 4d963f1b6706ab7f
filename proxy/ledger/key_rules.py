"""The rules of keys, shared by every backend (sqlite/keys.py, postgres/keys.py, and the request
path's lookup in sqlite.py and postgres.py): what a new key, a limit change and a top-up may
hold, which secret a presented one matches, what each KeyStore change means (which
changes bump key_generation, when a key cannot be rotated), and how an audit entry is stored.

The values part is pure: values in, checked values or ValueError out. `RuledKeyStore` holds
the KeyStore operations built from them, once; a backend mixes it in and supplies only the
SQL of each change (the `_write_*` methods), so the backends differ in SQL and driver code.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import hmac
import json
import secrets
from typing import Any, NamedTuple

from proxy.ledger.base import NO_LIMITS, AuditEntry, KeyLimits, KeyRecord, LedgerError, UnknownKey
from proxy.ledger.interface import KeyStore
from proxy.ledger.levels import check_metadata, check_tags
from proxy.ledger.schema import as_int, hash_secret, key_record_of, models_json, new_secret, opt_limit
from proxy.ledger.usage import MAX_AMOUNT

# The limit columns of a key, in the order the backends' INSERT lists them after the balance.
LIMIT_COLUMNS = ("allowed_models", "concurrency", "rate_per_min", "expires_at", "tokens_per_min",
                 "daily_budget_micros", "monthly_budget_micros", "blocked", "tags", "metadata")
# Where a new key sits (proxy/ledger/levels.py) and whether it has a purse of its own: fixed at creation.
PLACEMENT_COLUMNS = ("org_id", "team_id", "user_id", "own_balance")
# Every column of a new key's row, in the order of NewKey.row().
INSERT_COLUMNS = ("key_id", "name", "prefix", "secret_sha256", "balance_micros", *LIMIT_COLUMNS,
                  *PLACEMENT_COLUMNS, "revoked", "created_at")
PREFIX_CHARS = 12  # the secret's first characters kept for display ("sk-rp-" + 6)

# Compared against when a presented secret matches no row, so both paths do the same work.
DUMMY_HASH = hashlib.sha256(b"responses-proxy: no such key").digest()


def opt_budget(value: Any, what: str) -> int | None:
    """A budget in micros: a positive integer, or None (no budget)."""
    return opt_limit(value, what)


def opt_time(value: Any, what: str) -> float | None:
    """An expiry: Unix seconds (a finite number > 0), or None (never)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e11:
        raise ValueError(f"{what} must be a Unix time in seconds (None: never), not {value!r}")
    return float(value)


_CHECKS = {
    "allowed_models": lambda value, _what: models_json(value),
    "concurrency": opt_limit,
    "rate_per_min": opt_limit,
    "expires_at": opt_time,
    "tokens_per_min": opt_limit,
    "daily_budget_micros": opt_budget,
    "monthly_budget_micros": opt_budget,
    "blocked": lambda value, what: False if value is None else _flag(value, what),
    "tags": lambda value, _what: check_tags(value),
    "metadata": lambda value, _what: check_metadata(value),
}


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false")
    return value


class NewKey(NamedTuple):
    """A key to create, as both backends insert it."""

    key_id: str
    secret: str  # shown once to the caller, never stored
    digest: bytes  # what is stored: hash_secret(secret)
    name: str
    balance: int
    limits: tuple  # the LIMIT_COLUMNS values
    placement: tuple = (None, None, None, True)  # the PLACEMENT_COLUMNS values

    @property
    def prefix(self) -> str:
        return self.secret[:PREFIX_CHARS]

    def row(self, now: float) -> tuple:
        """The keys row, in INSERT_COLUMNS order."""
        return (self.key_id, self.name, self.prefix, self.digest, self.balance, *self.limits, *self.placement,
                False, now)


def new_key(name: Any, balance_micros: Any, limits: KeyLimits, placement: dict[str, Any] | None = None) -> NewKey:
    """A key to create: its name, balance and limits checked (a limit UNSET is None), a fresh
    id and secret. `placement`: its level columns (LevelStore.placement) and own_balance."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("a key needs a name")
    balance = as_int(balance_micros, "balance_micros")
    given = limits.given()
    values = tuple(_CHECKS[c](given.get(c), c) for c in LIMIT_COLUMNS)
    place = placement or {}
    where = (place.get("org_id"), place.get("team_id"), place.get("user_id"), bool(place.get("own_balance", True)))
    if not where[3] and where[:3] == (None, None, None):
        raise ValueError("a key without a balance of its own must sit under a team or a user")
    secret = new_secret()
    return NewKey("key_" + secrets.token_hex(8), secret, hash_secret(secret), name.strip(), balance, values, where)


def limit_changes(limits: KeyLimits) -> dict[str, Any]:
    """The columns a set_limits call changes (UNSET: left alone, None: cleared), checked."""
    return {column: _CHECKS[column](value, column) for column, value in limits.given().items()}


def topped_up(key_id: str, balance: int | None, amount: int) -> int:
    """The balance after a top-up (a negative one corrects it), never below 0 nor above the
    largest amount the ledger keeps; UnknownKey when the key has no balance (no row)."""
    if balance is None:
        raise UnknownKey(key_id)
    if balance + amount < 0:
        raise ValueError(f"the balance would go below zero ({balance} + {amount})")
    if balance + amount > MAX_AMOUNT:
        raise ValueError(f"the balance would exceed {MAX_AMOUNT} micros ({balance} + {amount})")
    return balance + amount


def check_rotatable(key_id: str, revoked: Any) -> None:
    """A key may get a new secret unless it is missing (revoked None: no row) or revoked."""
    if revoked is None:
        raise UnknownKey(key_id)
    if revoked:
        raise LedgerError(f"key {key_id!r} is revoked: create a new key instead")


def presented_key(digest: bytes, row: Any) -> KeyRecord | None:
    """The key a presented secret (its `digest`) finds: `row` is (secret_sha256, *KEY_COLUMNS)
    found by the digest, or None. The index finds the row; the decision is a constant-time
    compare of the hashes, done on both the found and the not-found path. A revoked or expired
    key is found too (`revoked`, `expired()`): the caller refuses it, and can tell the holder of
    its secret why."""
    stored = bytes(row[0]) if row else DUMMY_HASH
    if not hmac.compare_digest(stored, digest) or row is None:
        return None
    return key_record_of(tuple(row)[1:])


def previous_key(digest: bytes, row: Any) -> KeyRecord | None:
    """The key whose previous secret (a rotation's, kept for its grace) a presented one is:
    `row` is (prev_secret_sha256, *KEY_COLUMNS) found by the digest, or None. Marked
    presented_previous: the caller refuses it once grace_until has passed, saying why."""
    found = presented_key(digest, row)
    return None if found is None else dataclasses.replace(found, presented_previous=True)


# The audit table's columns as both backends read them (audit_entry); they insert the rest.
AUDIT_COLUMNS = "seq, created_at, actor, action, key_id, details"
AUDIT_INSERT_COLUMNS = "created_at, actor, action, key_id, details"


def audit_values(now: float, actor: str, action: str, key_id: str | None, details: dict[str, Any]) -> tuple:
    """An audit row in AUDIT_INSERT_COLUMNS order: the details as JSON (sorted keys; a value
    JSON has no type for, as its str)."""
    return now, str(actor), str(action), key_id, json.dumps(details, sort_keys=True, default=str)


def audit_entry(row: Any) -> AuditEntry:
    """An audit row, read in AUDIT_COLUMNS order."""
    return AuditEntry(row[0], row[1], row[2], row[3], row[4], json.loads(row[5]))


class RuledKeyStore(KeyStore):
    """KeyStore's changes by the rules above; a backend supplies the SQL of each (`_write_*`,
    each one transaction). A change a cached lookup could miss (limits, revoke, rotate) bumps
    key_generation after it, also on error: a cache flush is always safe."""

    async def create_key(self, name: str, balance_micros: int = 0, limits: KeyLimits = NO_LIMITS,
                         placement: dict[str, Any] | None = None) -> tuple[str, KeyRecord]:
        key = new_key(name, balance_micros, limits, placement)
        return key.secret, await self._write_new_key(key)

    async def top_up(self, key_id: str, micros: int) -> int:
        return await self._write_top_up(key_id, as_int(micros, "micros", minimum=None))

    async def set_limits(self, key_id: str, limits: KeyLimits) -> KeyRecord:
        changes = limit_changes(limits)
        try:
            return await self._write_limits(key_id, changes)
        finally:
            self.key_generation += 1

    async def revoke(self, key_id: str) -> None:
        try:
            await self._write_revoked(key_id)
        finally:
            self.key_generation += 1  # after the commit: caches filled before it are stale

    async def rotate_key(self, key_id: str, grace_s: float = 0.0) -> tuple[str, KeyRecord]:
        secret = new_secret()
        grace = float(grace_s)
        if not 0 <= grace <= 90 * 86400:
            raise ValueError("grace_s must be between 0 and 90 days")
        try:
            return secret, await self._write_secret(key_id, secret[:PREFIX_CHARS], hash_secret(secret), grace)
        finally:
            self.key_generation += 1

    async def delete_key(self, key_id: str) -> None:
        """Delete a key: revoked for good and left out of list_keys; its usage rows and audit
        entries stay (both are append-only), so reports still add up."""
        try:
            await self._write_deleted(key_id)
        finally:
            self.key_generation += 1

    @abc.abstractmethod
    async def _write_new_key(self, key: NewKey) -> KeyRecord:
        """Insert key.row(now) and, for a balance, its first top-up row; the record."""

    @abc.abstractmethod
    async def _write_top_up(self, key_id: str, amount: int) -> int:
        """Add `amount` to the balance (topped_up checks it, under the row's lock) and record
        the top-up; the new balance."""

    @abc.abstractmethod
    async def _write_limits(self, key_id: str, changes: dict[str, Any]) -> KeyRecord:
        """Set the changed columns (none: just read the key); UnknownKey; the record."""

    @abc.abstractmethod
    async def _write_revoked(self, key_id: str) -> None:
        """Mark the key revoked; UnknownKey."""

    @abc.abstractmethod
    async def _write_secret(self, key_id: str, prefix: str, digest: bytes, grace_s: float) -> KeyRecord:
        """Replace the key's secret (check_rotatable first, under the row's lock), the old one
        kept as the previous secret for `grace_s` seconds (0: none); the record."""

    @abc.abstractmethod
    async def _write_deleted(self, key_id: str) -> None:
        """Mark the key revoked and deleted; UnknownKey."""
