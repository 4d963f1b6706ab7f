"""The level store: organisations, teams and users (proxy/ledger/levels.py), created, changed and
topped up by the same rules on every backend. A backend supplies the SQL of each change (the
`_write_*` methods, one transaction each) and the reads; `RuledLevelStore` holds the rules once,
as key_rules.RuledKeyStore does for keys. Every change bumps key_generation: the request path
caches levels beside keys (middlewares/auth.py) and drops both on a change.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable
from typing import Any

from proxy.ledger.base import UnknownKey
from proxy.ledger.levels import KINDS, LevelRecord, check_parent, key_chain, level_columns, new_level_id
from proxy.ledger.schema import as_int
from proxy.ledger.usage import MAX_AMOUNT


class LevelStore(abc.ABC):
    key_generation: int = 0

    @abc.abstractmethod
    async def get_level(self, level_id: str) -> LevelRecord | None:
        """A level by id."""

    @abc.abstractmethod
    async def get_levels(self, level_ids: tuple[str, ...]) -> list[LevelRecord]:
        """The levels among `level_ids` that exist (any order): the request path's one read."""

    @abc.abstractmethod
    async def list_levels(self, kind: str | None = None, parent_id: str | None = None) -> list[LevelRecord]:
        """Levels, oldest first, optionally of one kind and one parent."""

    async def create_level(self, kind: str, fields: dict[str, Any]) -> LevelRecord:
        """A new level of `kind` with the given fields (LEVEL_FIELDS); ValueError naming a bad one."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}")
        fields = dict(fields)
        level_id = fields.pop("level_id", None)
        if level_id is None:
            level_id = new_level_id(kind)
        elif not isinstance(level_id, str) or not re.fullmatch(rf"{kind}_[a-z0-9_-]{{1,48}}", level_id):
            raise ValueError(f"level_id must be '{kind}_' and 1 to 48 of a-z 0-9 _ - (none: one is made)")
        elif await self.get_level(level_id) is not None:
            raise ValueError(f"level_id {level_id!r} is taken")
        columns = level_columns(fields, creating=True)
        parent_id = fields.get("parent_id")
        parent = await self.get_level(parent_id) if isinstance(parent_id, str) else None
        if parent_id is not None and not isinstance(parent_id, str):
            raise ValueError("parent_id must be a level id")
        check_parent(kind, parent, parent_id)
        return await self._write_new_level(level_id, kind, parent_id, columns)

    async def update_level(self, level_id: str, fields: dict[str, Any]) -> LevelRecord:
        columns = level_columns(fields, creating=False)
        try:
            return await self._write_level(level_id, columns)
        finally:
            self.key_generation += 1

    async def top_up_level(self, level_id: str, micros: int) -> int:
        """Add to a level's balance (negative corrects it, never below 0); a level without a
        balance gets one. The new balance."""
        amount = as_int(micros, "micros", minimum=None)

        def check(balance: int | None) -> int:
            new = (balance or 0) + amount
            if new < 0:
                raise ValueError(f"the balance would go below zero ({balance or 0} + {amount})")
            if new > MAX_AMOUNT:
                raise ValueError(f"the balance would exceed {MAX_AMOUNT} micros")
            return new

        try:
            return await self._write_level_top_up(level_id, amount, check)
        finally:
            self.key_generation += 1

    async def chain_of(self, level_id: str) -> list[LevelRecord]:
        """The level and the levels above it, bottom up. UnknownKey for a missing one."""
        chain: list[LevelRecord] = []
        next_id: str | None = level_id
        while next_id is not None and len(chain) < len(KINDS):
            level = await self.get_level(next_id)
            if level is None:
                raise UnknownKey(next_id)
            chain.append(level)
            next_id = level.parent_id
        return chain

    async def placement(self, team_id: Any, user_id: Any) -> dict[str, str | None]:
        """The level columns of a new key placed under `user_id` (its team and organisation
        follow) or `team_id`; both given must agree. ValueError naming the field."""
        for name, value in (("team_id", team_id), ("user_id", user_id)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a level id")
        if user_id is None and team_id is None:
            return {"org_id": None, "team_id": None, "user_id": None}
        start = user_id if user_id is not None else team_id
        try:
            chain = await self.chain_of(start)
        except UnknownKey:
            raise ValueError(f"{'user_id' if user_id is not None else 'team_id'}: no such level {start!r}") from None
        want = "user" if user_id is not None else "team"
        if chain[0].kind != want:
            raise ValueError(f"{want}_id: {start!r} is a {chain[0].kind}, not a {want}")
        columns = key_chain(chain)
        if team_id is not None and columns["team_id"] != team_id:
            raise ValueError(f"user_id: user {user_id!r} is not in team {team_id!r}")
        return columns

    @abc.abstractmethod
    async def _write_new_level(self, level_id: str, kind: str, parent_id: str | None,
                               columns: dict[str, Any]) -> LevelRecord:
        """Insert the level (and its first top-up for a balance); the record."""

    @abc.abstractmethod
    async def _write_level(self, level_id: str, columns: dict[str, Any]) -> LevelRecord:
        """Set the columns (a new budget clock starts a new period); UnknownKey; the record."""

    @abc.abstractmethod
    async def _write_level_top_up(self, level_id: str, amount: int, check: Callable[[int | None], int]) -> int:
        """Set the balance to check(balance) under the row's lock and record the top-up."""

