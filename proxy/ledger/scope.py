"""What an admin may see and change: everything (an `admin`, or a `viewer`, who reads only and
is stopped before any handler), or the teams a `team_admin` runs (admin.keys[].teams, or the
teams single sign-on mapped). The service layer (proxy/ledger/service.py, level_service.py)
asks the scope before every read and change, so the admin API, the console and the CLI share
one rule:

  * a team admin sees their teams, the users in them, the keys under either, and those keys'
    usage; anything else is "not found" (404: they cannot learn it exists);
  * they create keys and users under their teams, change those keys' and users' limits and
    budgets, rotate, block, delete; the money comes from the team's purse: they cannot top up
    anything, give a key a balance of its own, nor change a team (its budget is the owner's).
"""

from __future__ import annotations

from proxy.ledger.base import KeyRecord, LedgerError, UnknownKey
from proxy.ledger.levels import LevelRecord


class NotPermitted(LedgerError):
    """An admin's role does not allow this change (the admin API's 403 insufficient_role)."""


class Scope:
    def __init__(self, teams: frozenset[str] | None = None, who: str = "") -> None:
        self.teams = teams  # None: everything
        self.who = who

    @property
    def everything(self) -> bool:
        return self.teams is None

    def key_visible(self, record: KeyRecord) -> bool:
        return self.teams is None or record.team_id in self.teams

    def level_visible(self, level: LevelRecord) -> bool:
        if self.teams is None:
            return True
        return (level.kind == "team" and level.level_id in self.teams) or (
            level.kind == "user" and level.parent_id in self.teams)

    def require_key(self, record: KeyRecord) -> KeyRecord:
        if not self.key_visible(record):
            raise UnknownKey(record.key_id)
        return record

    def require_level(self, level: LevelRecord) -> LevelRecord:
        if not self.level_visible(level):
            raise UnknownKey(level.level_id)
        return level

    def require_everything(self, what: str) -> None:
        """Refuse a team admin `what` (a top-up, a change to a team or an organisation)."""
        if self.teams is not None:
            raise NotPermitted(f"{self.who or 'a team admin'} is a team_admin: {what} is the owner's to do")


EVERYTHING = Scope()
