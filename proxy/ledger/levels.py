"""The levels above keys: organisations, teams and users, and the money rules they add.

    org  ──  team  ──  user  ──  key          (each link optional: a key may sit under a team alone)

A level is a row of its own (`levels`), created through the admin API or the CLI. It can carry a
prepaid balance (a shared purse its keys draw from), a budget (spend per period: daily, weekly,
monthly or a custom length, reset on the operator's clock: a UTC offset), limits (rate, tokens
per minute, concurrency) and allowed models. A key names its level when it is created
(`team_id` / `user_id`); the levels above follow from the parents and are written on the key's
row (`org_id`, `team_id`, `user_id`). A level's parent and a key's levels never change: the
request path reads a key's levels from its row without a lock (the money rows are locked).

A request is admitted only when every level above its key admits it, in the same hold:

    room(level) = min(balance - held, budget - spent this period - held)   (the parts it has)
    held        = the open holds of every key under the level (leases included)
    granted     = min(high, key's own room (when it has a balance of its own), each level's room)

and a settle debits the same amount from the key (when it has a balance of its own) and from
every level: balance -= debit where there is a balance, spent += debit where there is a budget
(a period that ended starts afresh). The debit is clamped at the smallest balance on the way
(money never goes below zero anywhere), never at a budget: work a worker did is billed.
So at every level, balance drop == the debits of the rows of the keys under it.

This module is pure (values in, values out); the SQL is each backend's (sqlite/levels.py,
postgres/levels.py), in the transaction of the hold or the settle.
"""

from __future__ import annotations

import calendar
import json
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from proxy.ledger.usage import MAX_AMOUNT

KINDS = ("org", "team", "user")
# The kind of a level's parent: a user sits in a team, a team in an organisation.
PARENT_KIND = {"org": None, "team": "org", "user": "team"}
# The key column naming each kind (keys.org_id / team_id / user_id; usage joins on them).
KEY_COLUMN = {"org": "org_id", "team": "team_id", "user": "user_id"}

PERIODS = ("daily", "weekly", "monthly")
_CUSTOM_PERIOD = re.compile(r"(\d{1,4})([hd])")
_OFFSET = re.compile(r"([+-])(\d{2}):(\d{2})")

# The columns both backends read a level by, in LevelRecord's order.
LEVEL_COLUMNS = ("level_id, kind, name, parent_id, balance_micros, budget_micros, budget_period, budget_reset,"
                 " period_spent, period_end, allowed_models, concurrency, rate_per_min, tokens_per_min, blocked,"
                 " tags, metadata, created_at")
# What create / update may set, and which of them are money (dollars accepted as *_usd).
LEVEL_FIELDS = ("name", "parent_id", "balance_micros", "budget_micros", "budget_period", "budget_reset",
                "allowed_models", "concurrency", "rate_per_min", "tokens_per_min", "blocked", "tags", "metadata")
# Never changed after creation: a level's parent (the keys under it carry it on their rows).
FIXED_FIELDS = ("parent_id",)


@dataclass(frozen=True)
class LevelRecord:
    level_id: str
    kind: str  # org | team | user
    name: str
    parent_id: str | None
    balance_micros: int | None  # None: no purse of its own (its keys' money is elsewhere)
    budget_micros: int | None  # spend per period; None: no budget
    budget_period: str | None  # daily | weekly | monthly | "<N>h" | "<N>d"
    budget_reset: str  # the clock the periods follow: a UTC offset, "+00:00"
    period_spent: int  # debited in the period ending at period_end
    period_end: float | None
    allowed_models: tuple[str, ...] | None
    concurrency: int | None
    rate_per_min: int | None
    tokens_per_min: int | None
    blocked: bool
    tags: tuple[str, ...]
    metadata: dict[str, Any]
    created_at: float

    def spent(self, now: float | None = None) -> int:
        """Spend in the current period."""
        return spent_now(self.period_spent, self.period_end, time.time() if now is None else now)

    def has_limits(self) -> bool:
        return bool(self.concurrency or self.rate_per_min or self.tokens_per_min)


def level_record_of(row: Iterable[Any]) -> LevelRecord:
    r = tuple(row)
    models = json.loads(r[10]) if r[10] is not None else None
    return LevelRecord(
        level_id=r[0], kind=r[1], name=r[2], parent_id=r[3], balance_micros=r[4], budget_micros=r[5],
        budget_period=r[6], budget_reset=r[7] or "+00:00", period_spent=r[8] or 0, period_end=r[9],
        allowed_models=tuple(models) if models is not None else None, concurrency=r[11], rate_per_min=r[12],
        tokens_per_min=r[13], blocked=bool(r[14]), tags=tuple(json.loads(r[15])) if r[15] else (),
        metadata=json.loads(r[16]) if r[16] else {}, created_at=r[17])


def kind_of(level_id: str) -> str | None:
    """The kind a level id names by its prefix ("team_1f2e..."), None for anything else."""
    kind = level_id.partition("_")[0]
    return kind if kind in KINDS else None


def new_level_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(8)}"


# ---------------------------------------------------------------- periods


def check_period(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and (value in PERIODS or _CUSTOM_PERIOD.fullmatch(value)):
        if value not in PERIODS and int(value[:-1]) == 0:
            raise ValueError("budget_period must be longer than 0")
        return value
    raise ValueError(f"budget_period must be one of {', '.join(PERIODS)} or a length such as '12h' or '14d', "
                     f"not {value!r}")


def check_reset(value: Any) -> str:
    """The clock budgets reset on: a UTC offset "+HH:MM" / "-HH:MM", also written "UTC-08:00" (None: UTC)."""
    if value is None:
        return "+00:00"
    if isinstance(value, str) and value.upper().startswith("UTC"):  # "UTC-08:00": no leading '-' for a shell's flags
        value = value[3:] or "+00:00"
    match = _OFFSET.fullmatch(value) if isinstance(value, str) else None
    if match is None or int(match[2]) > 14 or int(match[3]) > 59:
        raise ValueError(f"budget_reset must be a UTC offset such as '+00:00' or 'UTC-08:00', not {value!r}")
    return value


def _offset_s(reset: str) -> int:
    match = _OFFSET.fullmatch(reset)
    if match is None:
        return 0
    seconds = int(match[2]) * 3600 + int(match[3]) * 60
    return -seconds if match[1] == "-" else seconds


def period_bounds(period: str, reset: str, now: float) -> tuple[float, float]:
    """The period containing `now`: (start, end) as Unix times, on the clock `reset` names.
    daily: midnight to midnight; weekly: Monday 00:00; monthly: the 1st 00:00; "<N>h" / "<N>d":
    lengths counted from 1970-01-05 (a Monday) 00:00 on that clock."""
    offset = _offset_s(reset)
    local = datetime.fromtimestamp(now + offset, UTC)
    if period == "monthly":
        start = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        days = calendar.monthrange(start.year, start.month)[1]
        end = start + timedelta(days=days)
        return start.timestamp() - offset, end.timestamp() - offset
    if period == "daily":
        length = 86400
    elif period == "weekly":
        length = 7 * 86400
    else:
        length = int(period[:-1]) * (3600 if period[-1] == "h" else 86400)
    epoch = 4 * 86400  # 1970-01-05, a Monday
    start_s = (now + offset - epoch) // length * length + epoch - offset
    return float(start_s), float(start_s + length)


def new_clock(current: tuple[str | None, str], columns: dict[str, object]) -> bool:
    """Whether a change of a level's columns moves its budget's clock (the period or its reset):
    then its period starts anew. The same values again (a console saving every field) do not:
    the spend counted this period stays, or an edit would be a way round the budget."""
    period, reset = current
    return (("budget_period" in columns and columns["budget_period"] != period)
            or ("budget_reset" in columns and columns["budget_reset"] != reset))


def spent_now(period_spent: int, period_end: float | None, now: float) -> int:
    """What a level spent in the current period: its counter while the period it counts for
    lasts, else nothing (the counter is reset by the next debit)."""
    return period_spent if period_end is not None and now < period_end else 0


# ---------------------------------------------------------------- the money rules


class Purse(NamedTuple):
    """One level's money in a hold or settle transaction, read under its row lock."""

    level_id: str
    balance: int | None
    budget: int | None
    spent: int  # this period's, already reset when the period ended
    held: int  # the open holds of the keys under it (a lease being grown excluded)


def level_room(purse: Purse) -> int | None:
    """What a level lets its keys hold more of; None: it bounds nothing."""
    room = None
    if purse.balance is not None:
        room = purse.balance - purse.held
    if purse.budget is not None:
        left = purse.budget - purse.spent - purse.held
        room = left if room is None else min(room, left)
    return room


def chain_room(own: int | None, purses: Iterable[Purse]) -> tuple[int, str | None]:
    """The room of a key and the levels above it: (the smallest, the level that sets it (None:
    the key itself, or nothing bounds it)). `own`: the key's own balance minus its holds, None
    when the key has no purse of its own. Nothing bounding it at all: MAX_AMOUNT."""
    room, binding = (MAX_AMOUNT if own is None else own), None
    for purse in purses:
        level = level_room(purse)
        if level is not None and level < room:
            room, binding = level, purse.level_id
    return room, binding


def chain_balance(own: int | None, purses: Iterable[Purse]) -> int:
    """The most a settle may debit by the balances on the way (never a budget)."""
    balance = MAX_AMOUNT if own is None else own
    for purse in purses:
        if purse.balance is not None and purse.balance < balance:
            balance = purse.balance
    return balance


def debit_changes(level: tuple[str, int | None, int | None, str | None, str, int, float | None],
                  debit: int, now: float) -> tuple[int | None, int, float | None]:
    """A level's (balance, period_spent, period_end) after `debit`: `level` is its (id, balance,
    budget, period, reset, period_spent, period_end) as read. The balance never below 0 (the
    debit was clamped at it); the spend counted in the period of `now` (a new one starts at 0)."""
    _, balance, budget, period, reset, spent, end = level
    new_balance = None if balance is None else max(0, balance - debit)
    if budget is None or period is None:
        return new_balance, spent, end
    if end is None or now >= end:
        _, end = period_bounds(period, reset, now)
        spent = 0
    return new_balance, spent + debit, end


def key_levels(org_id: str | None, team_id: str | None, user_id: str | None) -> tuple[str, ...]:
    """A key's level ids, top down (org, team, user), without the empty ones."""
    return tuple(level for level in (org_id, team_id, user_id) if level is not None)


# ---------------------------------------------------------------- what a level (or a key) may hold

_MAX_TAGS = 32
_MAX_METADATA_BYTES = 4096


def check_tags(value: Any) -> str | None:
    """Tags: a list of short strings, stored as JSON (None / []: none)."""
    if value is None or value == []:
        return None
    if (not isinstance(value, list) or len(value) > _MAX_TAGS
            or not all(isinstance(t, str) and 0 < len(t) <= 64 for t in value)):
        raise ValueError(f"tags must be a list of at most {_MAX_TAGS} strings of 1 to 64 characters")
    return json.dumps(sorted(set(value)))


def check_metadata(value: Any) -> str | None:
    """Metadata: a JSON object the operator keeps beside it (None / {}: none), at most 4 KiB."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ValueError("metadata must be a JSON object")
    text = json.dumps(value, sort_keys=True)
    if len(text) > _MAX_METADATA_BYTES:
        raise ValueError(f"metadata must be at most {_MAX_METADATA_BYTES} bytes of JSON")
    return text


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise ValueError(f"{what} must be a non-empty string of at most 200 characters")
    return value.strip()


def _opt_money(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_AMOUNT:
        raise ValueError(f"{what} must be a non-negative integer of micros (None: none), not {value!r}")
    return value


def _opt_positive(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_AMOUNT:
        raise ValueError(f"{what} must be a positive integer (None: none), not {value!r}")
    return value


def _models(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [m for m in (part.strip() for part in value.split(",")) if m]
    if not isinstance(value, list) or not all(isinstance(m, str) and m for m in value):
        raise ValueError(f"{what} must be a list of model names (a name ending in '*' matches a prefix)")
    return json.dumps(value)


def _blocked(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false")
    return value


_COLUMN_CHECKS = {
    "name": _name,
    "balance_micros": _opt_money,
    "budget_micros": _opt_positive,
    "budget_period": lambda v, _w: check_period(v),
    "budget_reset": lambda v, _w: check_reset(v),
    "allowed_models": _models,
    "concurrency": _opt_positive,
    "rate_per_min": _opt_positive,
    "tokens_per_min": _opt_positive,
    "blocked": _blocked,
    "tags": lambda v, _w: check_tags(v),
    "metadata": lambda v, _w: check_metadata(v),
}


def level_columns(fields: dict[str, Any], *, creating: bool) -> dict[str, Any]:
    """The columns a create or an update writes, checked (ValueError naming the field). An
    update cannot move a level (parent_id) nor touch its balance (top-ups do that, recorded)."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if name == "parent_id" or (name == "balance_micros" and not creating):
            if not creating:
                raise ValueError(f"{name} cannot be changed"
                                 + (": top the level up instead" if name == "balance_micros" else
                                    ": create a new level instead"))
            continue
        check = _COLUMN_CHECKS.get(name)
        if check is None:
            raise ValueError(f"unknown field {name!r}")
        out[name] = check(value, name)
    if creating and "name" not in out:
        raise ValueError("a level needs a name")
    if (out.get("budget_micros") is not None) != (out.get("budget_period") is not None) and creating:
        raise ValueError("budget_micros and budget_period go together")
    return out


def check_parent(kind: str, parent: LevelRecord | None, parent_id: Any) -> None:
    """A new level's parent: a team's is an organisation (or none), a user's a team (or none)."""
    if parent_id is None:
        return
    if parent is None:
        raise ValueError(f"parent_id: no level {parent_id!r}")
    if parent.kind != PARENT_KIND[kind]:
        raise ValueError(f"parent_id: a {kind}'s parent must be a {PARENT_KIND[kind] or 'nothing'},"
                         f" not a {parent.kind}")


def key_chain(nodes: Iterable[LevelRecord]) -> dict[str, str | None]:
    """The level columns of a key (or the ancestors of a level) from the levels above it, walked
    up from its own level: {"org_id": ..., "team_id": ..., "user_id": ...}."""
    out: dict[str, str | None] = {"org_id": None, "team_id": None, "user_id": None}
    for node in nodes:
        out[KEY_COLUMN[node.kind]] = node.level_id
    return out
