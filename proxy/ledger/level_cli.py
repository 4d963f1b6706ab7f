"""`responses-proxy orgs|teams|users ...`: the levels above keys from the command line, through
the same service as the admin API (proxy/ledger/level_service.py), one JSON convention with
`keys` (--json: one document; a listing is an array).

    responses-proxy orgs create acme --id org_acme --balance-usd 1000
    responses-proxy teams create ml --id team_ml --org org_acme --budget-usd 100 --period weekly
    responses-proxy users create ann --team team_ml --budget-usd 10 --period daily
    responses-proxy keys create ann-laptop --user user_...      # draws on the team's purse
    responses-proxy teams show team_ml                            # balance, spent this period, room
    responses-proxy teams update team_ml --rate 600 --models 'qwen/*'
    responses-proxy teams topup team_ml --usd 50
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from proxy.ledger.level_service import LevelService, level_dict
from proxy.ledger.levels import KINDS
from proxy.ledger.service import usd

_PARENT = {"team": ("--org", "the organisation it belongs to"), "user": ("--team", "the team it belongs to")}


def _none_or(kind: Any):
    def parse(text: str) -> Any:
        return None if text.strip().lower() in ("none", "null", "") else kind(text)
    return parse


def _level_flags(parser: argparse.ArgumentParser, updating: bool) -> None:
    unset = argparse.SUPPRESS  # a flag not given is not changed (update) or not set (create)
    parser.add_argument("--budget-usd", dest="budget_usd", default=unset, metavar="AMOUNT|none",
                        type=_none_or(str), help="spend per period, in dollars")
    parser.add_argument("--period", dest="budget_period", default=unset, metavar="daily|weekly|monthly|12h|14d")
    parser.add_argument("--reset", dest="budget_reset", default=unset, metavar="UTC+HH:MM",
                        help="the clock periods follow: a UTC offset, e.g. UTC-08:00")
    parser.add_argument("--models", dest="allowed_models", default=unset, metavar="A,B|none",
                        type=_none_or(str), help="allowed models ('qwen/*': a prefix)")
    for flag, dest in (("--concurrency", "concurrency"), ("--rate", "rate_per_min"), ("--tpm", "tokens_per_min")):
        parser.add_argument(flag, dest=dest, default=unset, type=_none_or(int), metavar="N|none")
    parser.add_argument("--tags", default=unset, type=lambda t: [x for x in t.split(",") if x], metavar="A,B")
    if updating:
        parser.add_argument("--block", dest="blocked", action="store_const", const=True, default=unset)
        parser.add_argument("--unblock", dest="blocked", action="store_const", const=False, default=unset)


def add_level_commands(subparsers: Any, json_flag: argparse.ArgumentParser) -> None:
    """Add `orgs`, `teams`, `users` to the top-level subparsers."""
    for kind in KINDS:
        top = subparsers.add_parser(f"{kind}s", help=f"manage {kind}s (their budgets, limits and models)")
        top.add_argument("--config", default=argparse.SUPPRESS, help="config.yaml whose ledger to open")
        top.add_argument("--db", default=argparse.SUPPRESS, metavar="PATH", help="the SQLite ledger file itself")
        top.set_defaults(level_kind=kind)
        sub = top.add_subparsers(dest="level_command", metavar="COMMAND", required=True)
        create = sub.add_parser("create", parents=[json_flag], help=f"create a {kind}")
        create.add_argument("name")
        create.add_argument("--id", dest="level_id", default=argparse.SUPPRESS, metavar=f"{kind}_NAME")
        if kind in _PARENT:
            flag, what = _PARENT[kind]
            create.add_argument(flag, dest="parent_id", default=argparse.SUPPRESS, help=what)
        create.add_argument("--balance-usd", dest="balance_usd", default=argparse.SUPPRESS, metavar="AMOUNT",
                            help="a purse its keys share (none: they pay from elsewhere)")
        _level_flags(create, updating=False)
        sub.add_parser("list", parents=[json_flag], help=f"every {kind}")
        for name, what in (("show", "its balance, spend this period and room"), ("update", "change it"),
                           ("topup", "add to its balance")):
            command = sub.add_parser(name, parents=[json_flag], help=what)
            command.add_argument("level_id")
            if name == "update":
                command.add_argument("--name", default=argparse.SUPPRESS)
                _level_flags(command, updating=True)
            elif name == "topup":
                command.add_argument("--usd", required=True, metavar="AMOUNT", help="dollars (negative corrects)")


_FIELDS = ("level_id", "name", "parent_id", "balance_usd", "budget_usd", "budget_period", "budget_reset",
           "allowed_models", "concurrency", "rate_per_min", "tokens_per_min", "tags", "blocked")


def _given(args: argparse.Namespace) -> dict[str, Any]:
    data = {name: getattr(args, name) for name in _FIELDS if hasattr(args, name)}
    if isinstance(data.get("allowed_models"), str):
        data["allowed_models"] = [m.strip() for m in data["allowed_models"].split(",") if m.strip()]
    return data


def _line(level: dict[str, Any]) -> str:
    money = f"balance {usd(level['balance_micros'])}" if level["balance_micros"] is not None else "no purse"
    budget = (f", budget {usd(level['budget_micros'])}/{level['budget_period']} "
              f"(spent {usd(level['spent_this_period_micros'])})" if level["budget_micros"] is not None else "")
    return f"{level['level_id']:<24} {level['name'][:24]:<24} {level['parent_id'] or '-':<24} {money}{budget}"


async def run_level_command(service: LevelService, args: argparse.Namespace, out: Any) -> None:
    from proxy.ledger.service import micros_of_usd

    kind, cmd, as_json = args.level_kind, args.level_command, getattr(args, "json", False)
    if cmd == "list":
        levels = [level_dict(lv) for lv in await service.list(kind)]
        print(json.dumps(levels) if as_json else "\n".join(_line(lv) for lv in levels), file=out)
        return
    if cmd == "create":
        level = level_dict(await service.create(kind, _given(args)))
    elif cmd == "update":
        changes = {name: value for name, value in _given(args).items() if name != "level_id"}
        level = level_dict(await service.update(args.level_id, changes, kind))
    elif cmd == "topup":
        balance = await service.top_up(args.level_id, micros_of_usd(args.usd, "--usd", signed=True), kind)
        print(json.dumps({f"{kind}_id": args.level_id, "balance_micros": balance}) if as_json else
              f"{args.level_id}: balance {usd(balance)} ({balance} micros)", file=out)
        return
    else:  # show
        level = await service.summary(await service.get(args.level_id, kind))
    if as_json:
        print(json.dumps(level), file=out)
        return
    print(_line(level), file=out)
    if cmd == "show":
        room = level["available_micros"]
        print(f"held now: {usd(level['held_micros'])}; may still hold: {'unbounded' if room is None else usd(room)}; "
              f"keys: {', '.join(level['keys']) or '(none)'}", file=out)
