"""The one service layer of key management and usage reports: the keys CLI
(proxy/ledger/cli.py) and the admin API (proxy/admin/) both go through it, so the rules
(what a field may hold, what is audited, how a time range or a budget period is read)
exist once.

    service = KeyService(ledger, actor="admin:ops")      # or "cli:<user>"
    secret, record = await service.create({"name": "team-a", "balance_micros": 5_000_000})
    await service.update(record.key_id, {"tokens_per_min": 20000, "daily_budget_micros": 1_000_000})

Every change writes one audit entry (who, what, when, the changed fields) after it
commits; a secret is never in one (nor in any dict this module returns, but create's and
rotate's own return value, shown once). Input comes as a mapping of JSON values (HTTP
bodies; the CLI builds the same mapping from its flags); anything wrong is a ValueError
whose message names the field, which the callers turn into a 400 / exit 1.
"""

from __future__ import annotations

import calendar
import csv
import io
import re
import time
from collections.abc import Iterable
from dataclasses import asdict
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from proxy.ledger.base import (
    KEY_LIMIT_FIELDS,
    UNSET,
    USAGE_GROUPS,
    USAGE_STATUSES,
    KeyLimits,
    KeyRecord,
    LedgerError,
    UnknownKey,
    UsageRecord,
    UsageTotals,
)
from proxy.ledger.interface import ConsoleReads, Ledger, RequestLedger
from proxy.ledger.scope import EVERYTHING, Scope
from proxy.ledger.usage import MAX_AMOUNT

# The fields a key's limits are set with (create and update take them all): KeyLimits'.
LIMIT_FIELDS = KEY_LIMIT_FIELDS
# Money a person types may come in dollars: each of these stands for its micros field (not both).
USD_FIELDS = {"balance_usd": "balance_micros", "daily_budget_usd": "daily_budget_micros",
              "monthly_budget_usd": "monthly_budget_micros"}
UPDATE_FIELDS = (*LIMIT_FIELDS, "daily_budget_usd", "monthly_budget_usd")
# Where a new key sits (proxy/ledger/levels.py); fixed once it is made.
PLACE_FIELDS = ("team_id", "user_id")
CREATE_FIELDS = ("name", "balance_micros", "balance_usd", *PLACE_FIELDS, *UPDATE_FIELDS)
_DOLLARS = re.compile(r"[+-]?\$?(\d{1,3}(,\d{3})+|\d{1,3}(_\d{3})+|\d+)(\.\d+)?|[+-]?\$?\.\d+")
_DURATION = re.compile(r"\+?(\d{1,6})([smhdw])")
_YEAR_2000 = 946_684_800.0
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def micros_of_usd(value: Any, what: str, *, signed: bool = False) -> int:
    """An amount of dollars ("1.50", "$1,250.00", 1.5; "-0.25" when `signed`) as micro-dollars,
    exactly; ValueError naming `what` otherwise. Thousands separators (',' or '_') only between
    groups of three digits: "1,50" is no amount (a decimal comma read as a separator credits $150)."""
    text = str(value).strip() if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    if _DOLLARS.fullmatch(text) is None:
        raise ValueError(f"{what}: not an amount of dollars: {text[:40]!r} (e.g. 1.50, 1,250.00 or -0.25)")
    try:
        amount = Decimal(text.replace("$", "", 1).replace(",", "").replace("_", "")) * 1_000_000
    except InvalidOperation:
        raise ValueError(f"{what}: not an amount of dollars: {text[:40]!r}") from None
    if not amount.is_finite() or amount != amount.to_integral_value():
        raise ValueError(f"{what} {text!r} is finer than a micro-dollar (at most 6 decimals)")
    if amount < 0 and not signed:
        raise ValueError(f"{what} {text!r} must not be negative")
    if abs(amount) > MAX_AMOUNT:
        raise ValueError(f"{what} {text!r} is out of range: at most {usd(MAX_AMOUNT)}")
    return int(amount)


def in_micros(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with each dollar field (USD_FIELDS) as its micros field; both given is a ValueError."""
    if not any(name in data for name in USD_FIELDS):
        return data
    out = dict(data)
    for name, micros in USD_FIELDS.items():
        if name in out:
            if micros in out:
                raise ValueError(f"give {name} or {micros}, not both")
            value = out.pop(name)
            out[micros] = None if value is None else micros_of_usd(value, name)
    return out


def parse_duration(value: Any, what: str) -> float:
    """A length of time: seconds (a number) or "90s", "30m", "12h", "7d", "2w"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 90 * 86400:
        return float(value)
    if isinstance(value, str) and (match := _DURATION.fullmatch(value.strip())):
        seconds = int(match.group(1)) * _SECONDS[match.group(2)]
        if seconds <= 90 * 86400:
            return float(seconds)
    raise ValueError(f"{what} must be seconds or a length such as 30m, 12h, 7d (at most 90 days), "
                     f"not {str(value)[:40]!r}")


def parse_expiry(value: Any, what: str = "expires_at", now: float | None = None) -> float | None:
    """When a key expires: a time (parse_time), or a time from now ("30d", "12h", "+90m", "2w").
    A time before 2000 is refused (a forgotten unit, "30", is Unix second 30 and would expire the
    key at once; a recent past time expires it now, on purpose), and so is one past parse_time's
    range (year 5138: it could not be shown)."""
    if isinstance(value, str) and (match := _DURATION.fullmatch(value.strip())):
        when = (time.time() if now is None else now) + int(match.group(1)) * _SECONDS[match.group(2)]
        if when >= 1e11:
            raise ValueError(f"{what} {value.strip()!r} is out of range")
        return when
    at = parse_time(value, what)
    if at is not None and at < _YEAR_2000:
        raise ValueError(f"{what} {str(value)[:40]!r} is before 2000: a time from now needs its unit (30d, 12h, 2w)")
    return at
MAX_PAGE = 1000


def parse_time(value: Any, what: str) -> float | None:
    """A time as Unix seconds: a number, a numeric string, or ISO 8601 ("2026-12-01",
    "2026-12-01T10:00:00Z"; no zone means UTC). None / "" -> None."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a time (Unix seconds or ISO 8601)")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
            except ValueError:
                raise ValueError(f"{what} must be Unix seconds or ISO 8601 (e.g. 2026-12-01T10:00:00Z), "
                                 f"not {text[:40]!r}") from None
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=UTC)
            seconds = parsed.timestamp()
    if not 0 <= seconds < 1e11:
        raise ValueError(f"{what} is out of range")
    return seconds


def iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def period_starts(now: float | None = None) -> tuple[float, float]:
    """(start of the UTC day, start of the UTC calendar month) containing `now`: the periods
    daily and monthly budgets reset at."""
    t = time.gmtime(time.time() if now is None else now)
    day = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
    month = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
    return float(day), float(month)


def usd(micros: int | None) -> str:
    """An amount of micro-dollars (the ledger's and the API's unit) as a person reads it, exactly:
    cents always, then the further digits it has (2810 -> "$0.00281", 1_500_000 -> "$1.50",
    1_234_567_890 -> "$1,234.56789"). The dashboard's money() writes the same."""
    if micros is None:
        return "-"
    whole, frac = divmod(abs(micros), 1_000_000)
    digits = f"{frac:06d}"
    digits = digits[:2] + digits[2:].rstrip("0")
    return f"{'-' if micros < 0 else ''}${whole:,}.{digits}"


def key_dict(record: KeyRecord) -> dict[str, Any]:
    """A key as JSON (never the secret: the record does not have it), times also in ISO 8601."""
    data = asdict(record)
    data["allowed_models"] = list(record.allowed_models) if record.allowed_models is not None else None
    data["created"] = iso(record.created_at)
    data["expires"] = iso(record.expires_at)
    data["expired"] = record.expired()
    return data


def _opt_int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a positive integer or null")
    if not 1 <= value <= MAX_AMOUNT:
        raise ValueError(f"{what} must be a positive integer or null, not {value}")
    return value


def _models(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [m.strip() for m in value.split(",") if m.strip()]
        if value in ([], ["*"]):
            return None
    if not isinstance(value, list) or not value or not all(isinstance(m, str) and m and len(m) <= 256 for m in value):
        raise ValueError("allowed_models must be a non-empty list of model names, or null for every model")
    return value


def parse_limits(data: dict[str, Any]) -> KeyLimits:
    """The limit fields present in `data`, checked; absent fields are UNSET (left as they are
    by an update, no limit for a new key)."""
    out: dict[str, Any] = {}
    for name in LIMIT_FIELDS:
        if name not in data:
            continue
        value = data[name]
        if name == "allowed_models":
            out[name] = _models(value)
        elif name == "expires_at":
            out[name] = parse_expiry(value, name)
        elif name in ("blocked", "tags", "metadata"):
            out[name] = value  # checked by the ledger's key rules (proxy/ledger/key_rules.py)
        else:
            out[name] = _opt_int(value, name)
    return KeyLimits(**out)


def _fields(data: Any, allowed: Iterable[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(map(str, unknown))[:200]} (known: {', '.join(allowed)})")
    return data


class KeyService:
    """Key management with an audit entry per change. `actor` names who acts (never a secret).
    It takes the whole Ledger: the changes and their audit are the KeyStore's, a key's summary
    reads the balance and spend as the request path does (RequestLedger)."""

    def __init__(self, ledger: Ledger, actor: str, scope: Scope = EVERYTHING) -> None:
        self.ledger = ledger
        self.actor = actor
        self.scope = scope  # what this admin may see and change (proxy/ledger/scope.py)

    async def _audit(self, action: str, key_id: str | None, details: dict[str, Any]) -> None:
        await self.ledger.append_audit(self.actor, action, key_id, details)

    async def create(self, data: dict[str, Any]) -> tuple[str, KeyRecord]:
        data = in_micros(_fields(data, CREATE_FIELDS))
        name = data.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise ValueError("name must be a non-empty string of at most 200 characters")
        balance = data.get("balance_micros", 0)
        if isinstance(balance, bool) or not isinstance(balance, int) or not 0 <= balance <= MAX_AMOUNT:
            raise ValueError("balance_micros must be a non-negative integer")
        limits = parse_limits(data)
        placement: dict[str, Any] = dict(await self.ledger.placement(data.get("team_id"), data.get("user_id")))
        under = placement["team_id"] or placement["user_id"]
        if not self.scope.everything:
            if placement["team_id"] not in (self.scope.teams or ()):
                raise ValueError("team_id or user_id: a team admin creates keys under their own teams")
            if balance:
                self.scope.require_everything("a key's own balance (money beside the team's)")
        # A key under a level without a balance of its own draws on its levels' purse.
        placement["own_balance"] = not under or "balance_micros" in data
        secret, record = await self.ledger.create_key(name, balance, limits, placement)
        where = {k: v for k, v in placement.items() if v is not None and k != "own_balance"}
        await self._audit("key.create", record.key_id, {"name": record.name, "balance_micros": balance,
                                                        "prefix": record.prefix, **where, **limits.given()})
        return secret, record

    async def get(self, key_id: str) -> KeyRecord:
        record = await self.ledger.get_key(key_id)
        if record is None:
            raise UnknownKey(key_id)
        return self.scope.require_key(record)

    async def list(self) -> list[KeyRecord]:
        return [r for r in await self.ledger.list_keys() if self.scope.key_visible(r)]

    async def top_up(self, key_id: str, micros: Any) -> int:
        if isinstance(micros, bool) or not isinstance(micros, int) or abs(micros) > MAX_AMOUNT:
            raise ValueError("micros must be an integer (negative corrects the balance)")
        await self.get(key_id)
        self.scope.require_everything("a top-up")
        if micros > 0 and (await self.get(key_id)).revoked:  # money nobody can spend; a correction (< 0) stays
            raise LedgerError(f"key {key_id} is revoked: a top-up would never be spent")
        balance = await self.ledger.top_up(key_id, micros)
        await self._audit("key.topup", key_id, {"micros": micros, "balance_micros": balance})
        return balance

    async def update(self, key_id: str, data: dict[str, Any]) -> KeyRecord:
        given = in_micros(_fields(data, (*UPDATE_FIELDS, *PLACE_FIELDS)))
        moved = [name for name in PLACE_FIELDS if name in given]
        if moved:
            raise ValueError(f"{moved[0]} cannot be changed: a key stays where it was made (create a new key)")
        limits = parse_limits(given)
        changes = limits.given()
        if not changes:
            raise ValueError(f"nothing to change: give one of {', '.join(LIMIT_FIELDS)}")
        await self.get(key_id)
        record = await self.ledger.set_limits(key_id, limits)
        await self._audit("key.update", key_id, changes)
        return record

    async def set_blocked(self, key_id: str, blocked: bool) -> KeyRecord:
        """Block (refused, 403, until unblocked) or unblock a key."""
        await self.get(key_id)
        record = await self.ledger.set_limits(key_id, KeyLimits(blocked=blocked))
        await self._audit("key.block" if blocked else "key.unblock", key_id, {})
        return record

    async def revoke(self, key_id: str) -> None:
        await self.get(key_id)
        await self.ledger.revoke(key_id)
        await self._audit("key.revoke", key_id, {})

    async def delete(self, key_id: str) -> None:
        await self.get(key_id)
        await self.ledger.delete_key(key_id)
        await self._audit("key.delete", key_id, {})

    async def rotate(self, key_id: str, grace: Any = None) -> tuple[str, KeyRecord]:
        """A new secret; the old one keeps working for `grace` ("1h", "30m", seconds; none: 0)."""
        grace_s = parse_duration(grace, "grace") if grace not in (None, "", 0) else 0.0
        await self.get(key_id)
        secret, record = await self.ledger.rotate_key(key_id, grace_s)
        await self._audit("key.rotate", key_id, {"prefix": record.prefix, "grace_s": grace_s})
        return secret, record

    async def summary(self, record: KeyRecord, now: float | None = None) -> dict[str, Any]:
        """Balance, what is available (minus holds), spend today and this month, and what is
        left of each budget: the key holder's view (GET /v1/key) and the admin's `show`."""
        return await key_summary(self.ledger, record, now)


async def key_summary(ledger: RequestLedger, record: KeyRecord, now: float | None = None) -> dict[str, Any]:
    day, month = period_starts(now)
    spend_day = await ledger.spend_since(record.key_id, day)
    spend_month = await ledger.spend_since(record.key_id, month)
    available = await ledger.available(record.key_id)
    return {
        "balance_micros": record.balance_micros,
        "available_micros": max(0, available),
        "spend_today_micros": spend_day,
        "spend_month_micros": spend_month,
        "daily_budget_remaining_micros": (None if record.daily_budget_micros is None
                                          else max(0, record.daily_budget_micros - spend_day)),
        "monthly_budget_remaining_micros": (None if record.monthly_budget_micros is None
                                            else max(0, record.monthly_budget_micros - spend_month)),
    }


async def budget_room(ledger: RequestLedger, record: KeyRecord, now: float | None = None) -> int | None:
    """What the key's budgets still allow in their current periods (the smaller one); None
    without a budget. Read from settled usage: requests in flight are not in it yet, so
    concurrent requests may together pass a budget by at most their holds (the balance
    itself stays a hard bound)."""
    if record.daily_budget_micros is None and record.monthly_budget_micros is None:
        return None
    day, month = period_starts(now)
    room: list[int] = []
    if record.daily_budget_micros is not None:
        room.append(record.daily_budget_micros - await ledger.spend_since(record.key_id, day))
    if record.monthly_budget_micros is not None:
        room.append(record.monthly_budget_micros - await ledger.spend_since(record.key_id, month))
    return max(0, min(room))


# ----------------------------------------------------------------------------- usage reports

# A row's `model` is the client's string as sent, `served_model` what served it (null: a row
# from before it was kept); totals' "model" group and the `model` filter mean the served model.
USAGE_FIELDS = ("request_id", "key_id", "model", "served_model", "worker", "status", "input_tokens",
                "cached_tokens", "output_tokens", "reasoning_tokens", "cost_micros", "debited_micros", "created_at",
                "created")
TOTAL_FIELDS = ("requests", "input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens",
                "cost_micros", "debited_micros")


class UsageQuery:
    """A usage report's parameters, checked: a time range [since, until), filters, a page
    (limit and the cursor of the previous page) or a grouping, and a format."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.since = parse_time(params.get("since"), "since")
        self.until = parse_time(params.get("until"), "until")
        if self.since is not None and self.until is not None and self.until <= self.since:
            raise ValueError("until must be after since")
        self.key_id = params.get("key_id") or None
        # One level's keys (team_id, user_id or org_id): the ledger's filters take a level id where
        # a key id goes (proxy/ledger/rollup.py).
        levels = [(name, params[name]) for name in ("team_id", "user_id", "org_id") if params.get(name)]
        if len(levels) > 1 or (levels and self.key_id):
            raise ValueError("filter by one of key_id, team_id, user_id, org_id")
        if levels:
            name, value = levels[0]
            if not isinstance(value, str) or not value.startswith(name[:-3] + "_"):
                raise ValueError(f"{name} must be a {name[:-3]} id ({name[:-3]}_...)")
            self.key_id = value
        self.model = params.get("model") or None
        self.endpoint = params.get("endpoint") or None
        raw_statuses = params.get("status") or ""
        self.statuses = tuple(s.strip() for s in (raw_statuses.split(",") if isinstance(raw_statuses, str)
                                                  else raw_statuses) if s.strip()) or None
        unknown = [s for s in self.statuses or () if s not in USAGE_STATUSES]
        if unknown:
            raise ValueError(f"status must be among {', '.join(sorted(USAGE_STATUSES))}, not {unknown[0][:40]!r}")
        self.format = (params.get("format") or "json").lower()
        if self.format not in ("json", "csv"):
            raise ValueError("format must be json or csv")
        self.limit = bounded_int(params.get("limit"), "limit", 100, 1, MAX_PAGE)
        self.cursor = bounded_int(params.get("cursor"), "cursor", None, 1, MAX_AMOUNT)
        raw = params.get("group_by") or ""
        groups = tuple(g.strip() for g in (raw.split(",") if isinstance(raw, str) else raw) if g.strip())
        bad = [g for g in groups if g not in USAGE_GROUPS]
        if bad or len(set(groups)) != len(groups):
            raise ValueError(f"group_by must be distinct names of {', '.join(USAGE_GROUPS)}")
        if "day" in groups and "hour" in groups:
            raise ValueError("group_by takes day or hour, not both")
        self.group_by = groups

    async def rows(self, ledger: ConsoleReads) -> tuple[list[tuple[int, UsageRecord]], int | None]:
        """A page of rows, newest first, and the cursor of the next page (None: last page)."""
        found = await ledger.usage_rows(since=self.since, until=self.until, key_id=self.key_id, model=self.model,
                                        before_seq=self.cursor, limit=self.limit + 1, statuses=self.statuses,
                                        endpoint=self.endpoint)
        more = len(found) > self.limit
        found = found[:self.limit]
        return found, (found[-1][0] if more and found else None)

    async def totals(self, ledger: ConsoleReads) -> list[UsageTotals]:
        return await ledger.usage_totals(self.group_by, since=self.since, until=self.until,
                                         key_id=self.key_id, model=self.model)

    async def total_rows(self, ledger: ConsoleReads) -> list[dict[str, Any]]:
        """The totals as the console shows them (JSON, CSV, a table): one dict each, keyed by
        `total_columns`."""
        return [totals_dict(t) for t in await self.totals(ledger)]

    @property
    def total_columns(self) -> tuple[str, ...]:
        """A total row's columns in their order: the groups, then the sums."""
        return (*self.group_by, *TOTAL_FIELDS)


def bounded_int(value: Any, what: str, default: Any, lo: int, hi: int) -> Any:
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an integer") from None
    if not lo <= number <= hi:
        raise ValueError(f"{what} must be from {lo} to {hi}")
    return number


def usage_dict(record: UsageRecord) -> dict[str, Any]:
    data = {name: getattr(record, name) for name in USAGE_FIELDS if name != "created"}
    data["created"] = iso(record.created_at)
    return data


def totals_dict(total: UsageTotals) -> dict[str, Any]:
    group = dict(total.group)
    for bucket in ("day", "hour"):
        if bucket in group:
            group[bucket] = iso(group[bucket])
    return {**group, **{name: getattr(total, name) for name in TOTAL_FIELDS}}


def to_csv(rows: list[dict[str, Any]], columns: Iterable[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        # A cell starting with = + - @ is a formula to a spreadsheet: quote it as text.
        writer.writerow({k: ("'" + v if isinstance(v, str) and v[:1] in "=+-@" else v) for k, v in row.items()})
    return out.getvalue()


__all__ = ["KeyService", "KeyLimits", "parse_limits", "UsageQuery", "key_dict", "key_summary", "budget_room",
           "usage_dict", "totals_dict", "to_csv", "parse_time", "period_starts", "iso", "UNSET"]


DEMO_NAME = "demo"  # the demo key's name (serve --demo-key, make run)
DEMO_ACTOR = "system:demo-key"  # who the audit log says made it


async def new_demo_key(ledger: Ledger, balance_micros: int) -> str:
    """The demo key made anew at start (its secret, to print once): the last one revoked, both
    changes audited like any other."""
    service = KeyService(ledger, DEMO_ACTOR)
    for record in await ledger.list_keys():
        if record.name == DEMO_NAME and not record.revoked:
            await service.revoke(record.key_id)
    secret, _ = await service.create({"name": DEMO_NAME, "balance_micros": balance_micros})
    return secret
