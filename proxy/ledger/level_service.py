"""Organisations, teams and users through one service, as keys go through KeyService: the admin
API (/admin/api/orgs, /teams, /users), the console and the CLI (`responses-proxy teams ...`) call
it, each change is audited with its actor (the audit's key_id column holds the level's id), and
the admin's scope (proxy/ledger/scope.py) is asked first.

    svc = LevelService(ledger, actor="admin:ops")
    team = await svc.create("team", {"name": "ml", "parent_id": org_id, "balance_usd": "500",
                                     "budget_usd": "100", "budget_period": "weekly"})
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from proxy.ledger.base import UnknownKey
from proxy.ledger.interface import Ledger
from proxy.ledger.levels import KEY_COLUMN, KINDS, LEVEL_FIELDS, LevelRecord, Purse, level_room, period_bounds
from proxy.ledger.scope import EVERYTHING, Scope
from proxy.ledger.service import iso, micros_of_usd

# Dollars a person types, each for its micros field (not both).
LEVEL_USD_FIELDS = {"balance_usd": "balance_micros", "budget_usd": "budget_micros"}
CREATE_LEVEL_FIELDS = ("level_id", *LEVEL_FIELDS, *LEVEL_USD_FIELDS)
UPDATE_LEVEL_FIELDS = tuple(f for f in CREATE_LEVEL_FIELDS
                            if f not in ("level_id", "parent_id", "balance_micros", "balance_usd"))
# What a team admin may change of a user in their team (never money, never where it sits).
TEAM_ADMIN_FIELDS = ("name", "budget_micros", "budget_usd", "budget_period", "budget_reset", "allowed_models",
                     "concurrency", "rate_per_min", "tokens_per_min", "blocked", "tags", "metadata")


def _given(data: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    unknown = sorted(set(map(str, data)) - set(allowed))
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)[:200]} (known: {', '.join(allowed)})")
    out = dict(data)
    for usd_name, micros_name in LEVEL_USD_FIELDS.items():
        if usd_name in out:
            if micros_name in out:
                raise ValueError(f"give {usd_name} or {micros_name}, not both")
            value = out.pop(usd_name)
            out[micros_name] = None if value is None else micros_of_usd(value, usd_name)
    return out


def level_dict(level: LevelRecord, now: float | None = None) -> dict[str, Any]:
    """A level as JSON: its fields, times in ISO 8601, this period's spend and when it ends."""
    at = time.time() if now is None else now
    data = asdict(level)
    data["allowed_models"] = list(level.allowed_models) if level.allowed_models is not None else None
    data["tags"] = list(level.tags)
    data["object"] = level.kind
    data["created"] = iso(level.created_at)
    data["spent_this_period_micros"] = level.spent(at)
    if level.budget_period is not None:
        start, end = period_bounds(level.budget_period, level.budget_reset, at)
        data["period_start"], data["period_end"] = iso(start), iso(end)
    else:
        data["period_start"] = data["period_end"] = None
    data.pop("period_spent")
    return data


class LevelService:
    def __init__(self, ledger: Ledger, actor: str, scope: Scope = EVERYTHING) -> None:
        self.ledger = ledger
        self.actor = actor
        self.scope = scope

    async def _audit(self, action: str, level_id: str, details: dict[str, Any]) -> None:
        await self.ledger.append_audit(self.actor, action, level_id, details)

    async def get(self, level_id: str, kind: str | None = None) -> LevelRecord:
        level = await self.ledger.get_level(level_id)
        if level is None or (kind is not None and level.kind != kind):
            raise UnknownKey(level_id)
        return self.scope.require_level(level)

    async def list(self, kind: str | None = None, parent_id: str | None = None) -> list[LevelRecord]:
        return [lv for lv in await self.ledger.list_levels(kind, parent_id) if self.scope.level_visible(lv)]

    async def create(self, kind: str, data: Any) -> LevelRecord:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}")
        fields = _given(data, CREATE_LEVEL_FIELDS)
        if not self.scope.everything:
            if kind != "user" or fields.get("parent_id") not in (self.scope.teams or ()):
                raise ValueError("parent_id: a team admin creates users in their own teams")
            if fields.get("balance_micros"):
                self.scope.require_everything("a user's own balance (money beside the team's)")
        level = await self.ledger.create_level(kind, fields)
        await self._audit(f"{kind}.create", level.level_id, {k: v for k, v in fields.items() if v is not None})
        return level

    async def update(self, level_id: str, data: Any, kind: str | None = None) -> LevelRecord:
        level = await self.get(level_id, kind)
        fields = _given(data, UPDATE_LEVEL_FIELDS if self.scope.everything else TEAM_ADMIN_FIELDS)
        if not self.scope.everything and level.kind != "user":
            self.scope.require_everything(f"a change to the {level.kind} itself (its budget, limits, models)")
        if not fields:
            raise ValueError(f"nothing to change: give one of {', '.join(UPDATE_LEVEL_FIELDS)}")
        updated = await self.ledger.update_level(level_id, fields)
        await self._audit(f"{level.kind}.update", level_id, fields)
        return updated

    async def top_up(self, level_id: str, micros: Any, kind: str | None = None) -> int:
        if isinstance(micros, bool) or not isinstance(micros, int):
            raise ValueError("micros must be an integer (negative corrects the balance)")
        level = await self.get(level_id, kind)
        self.scope.require_everything("a top-up")
        balance = await self.ledger.top_up_level(level_id, micros)
        await self._audit(f"{level.kind}.topup", level_id, {"micros": micros, "balance_micros": balance})
        return balance

    async def summary(self, level: LevelRecord) -> dict[str, Any]:
        """The level with what its keys may still hold (its room: balance and budget minus what
        is held and spent) and how many keys sit under it."""
        keys = [k for k in await self.ledger.list_keys() if getattr(k, KEY_COLUMN[level.kind]) == level.level_id]
        held = 0
        for record in keys:
            held += sum(h.amount_micros for h in await _holds(self.ledger, record.key_id))
        now = time.time()
        room = level_room(Purse(level.level_id, level.balance_micros, level.budget_micros, level.spent(now), held))
        return {**level_dict(level, now), "held_micros": held, "available_micros": room,
                "keys": [k.key_id for k in keys]}


async def _holds(ledger: Ledger, key_id: str) -> list[Any]:
    holds = getattr(ledger, "holds", None)  # both backends have it (a read for tools and this view)
    return await holds(key_id) if holds is not None else []
