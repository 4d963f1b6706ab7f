"""The rules of a key's values, shared by every backend (sqlite_keys.py, pg_keys.py): what a
new key, a limit change and a top-up may hold. Pure: values in, checked values or ValueError
out; the backends only write what these return."""

from __future__ import annotations

import secrets
from typing import Any, NamedTuple

from proxy.ledger.base import UNSET
from proxy.ledger.schema import _int, _models_json, _opt_limit, hash_secret, new_secret
from proxy.ledger.usage import MAX_AMOUNT

# The limit columns of a key, in the order the backends' INSERT lists them after the balance.
LIMIT_COLUMNS = ("allowed_models", "concurrency", "rate_per_min", "expires_at", "tokens_per_min",
                 "daily_budget_micros", "monthly_budget_micros")


def opt_budget(value: Any, what: str) -> int | None:
    """A budget in micros: a positive integer, or None (no budget)."""
    return _opt_limit(value, what)


def opt_time(value: Any, what: str) -> float | None:
    """An expiry: Unix seconds (a finite number > 0), or None (never)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e11:
        raise ValueError(f"{what} must be a Unix time in seconds (None: never), not {value!r}")
    return float(value)


_CHECKS = {
    "allowed_models": lambda value, _what: _models_json(value),
    "concurrency": _opt_limit,
    "rate_per_min": _opt_limit,
    "expires_at": opt_time,
    "tokens_per_min": _opt_limit,
    "daily_budget_micros": opt_budget,
    "monthly_budget_micros": opt_budget,
}


class NewKey(NamedTuple):
    """A key to create, as both backends insert it."""

    key_id: str
    secret: str  # shown once to the caller, never stored
    digest: bytes  # what is stored: hash_secret(secret)
    name: str
    balance: int
    limits: tuple  # the LIMIT_COLUMNS values


def new_key(name: Any, balance_micros: Any, limits: dict[str, Any]) -> NewKey:
    """A key to create: its name, balance and limits checked, a fresh id and secret."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("a key needs a name")
    balance = _int(balance_micros, "balance_micros")
    values = tuple(_CHECKS[c](limits.get(c), c) for c in LIMIT_COLUMNS)
    secret = new_secret()
    return NewKey("key_" + secrets.token_hex(8), secret, hash_secret(secret), name.strip(), balance, values)


def limit_changes(limits: dict[str, Any]) -> dict[str, Any]:
    """The columns a set_limits call changes (UNSET: left alone, None: cleared), checked."""
    return {column: _CHECKS[column](value, column) for column, value in limits.items() if value is not UNSET}


def topped_up(balance: int, amount: int) -> int:
    """The balance after a top-up (a negative one corrects it), never below 0 nor above the
    largest amount the ledger keeps."""
    if balance + amount < 0:
        raise ValueError(f"the balance would go below zero ({balance} + {amount})")
    if balance + amount > MAX_AMOUNT:
        raise ValueError(f"the balance would exceed {MAX_AMOUNT} micros ({balance} + {amount})")
    return balance + amount
