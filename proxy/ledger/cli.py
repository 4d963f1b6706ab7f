"""Key management on the ledger database, through the same service layer as the admin API
(proxy/ledger/service.py: one copy of the rules; every change is in the audit log as
"cli:<user>").

    responses-proxy keys create NAME [--balance MICROS | --balance-usd 1.50] [--models a,b]
                                     [--concurrency N] [--rate N] [--tpm N]
                                     [--daily-budget MICROS | --daily-budget-usd AMOUNT] [--monthly-budget ...]
                                     [--expires WHEN | --expires 30d]
    responses-proxy keys list
    responses-proxy keys show KEY_ID
    responses-proxy keys topup KEY_ID (MICROS | --usd AMOUNT)   (negative corrects)
    responses-proxy keys limits KEY_ID [--models a,b|*] [--concurrency N|none] [--rate N|none]
                                       [--tpm N|none] [--daily-budget N|none] [--monthly-budget N|none]
                                       [--expires WHEN|none]
    responses-proxy keys revoke KEY_ID
    responses-proxy keys rotate KEY_ID         (a new secret, printed once; same key and balance)
    responses-proxy keys usage [--key KEY_ID] [--model M] [--since T] [--until T] [--limit N]
                               [--group-by key,model,worker,day|hour] [--format table|json|csv]
    responses-proxy keys audit [--key KEY_ID] [--limit N]
    responses-proxy keys spool [replay]        (postgres: settlements waiting in the local spool; replay
                                                applies them now; exit 1 while some still wait)

Times (WHEN, T) are Unix seconds or ISO 8601 (UTC unless a zone is given).

Also `python -m proxy.ledger.cli [--config FILE] [--db PATH] keys ...`.
The secret is printed once, by `create`; nothing else ever prints it (only its prefix).

Which ledger: the one the server would open (ledger.backend sqlite or postgres: with
postgres, `ledger.dsn` names the database, and stderr says `ledger: postgres host:port/db`),
found as `serve` finds its config (--config, else $RESPONSES_PROXY_CONFIG, else ./config.yaml,
else the embedded defaults), its
`ledger.path` taken relative to that file; `--db PATH` names the file itself. Every command
prints `ledger: /absolute/path` on stderr first. A ledger file that does not exist is never
made by accident: every command but `create` refuses (exit 1); `create` makes a new one
where a config file or --db says, but under the embedded defaults (no config file found)
only in a directory that already exists, as data/ does once a server has run there.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.config import settings as config_settings
from proxy.ledger import UNSET, ConsoleReads, KeyRecord, LedgerError, open_ledger, resolve_path
from proxy.ledger.level_cli import add_level_commands, run_level_command
from proxy.ledger.level_service import LevelService
from proxy.ledger.postgres.spool import PgSpoolOps
from proxy.ledger.service import (
    USAGE_FIELDS,
    KeyService,
    UsageQuery,
    iso,
    key_dict,
    micros_of_usd,
    parse_expiry,
    parse_time,
    to_csv,
    usage_dict,
    usd,
)
from proxy.ledger.usage import MAX_AMOUNT


def _usd_amount(text: str, signed: bool) -> int:
    """An amount in dollars ("1.50", "$1.50", "-0.25" when `signed`) -> micro-dollars, exactly."""
    try:
        return micros_of_usd(text, "amount", signed=signed)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _usd(text: str) -> int:
    return _usd_amount(text, signed=False)


def _usd_signed(text: str) -> int:
    return _usd_amount(text, signed=True)


def _micros(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer number of micro-units: {text!r}") from None
    if abs(value) > MAX_AMOUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: at most {MAX_AMOUNT} micro-units")
    return value


def _nonneg(text: str) -> int:
    value = _micros(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _positive(text: str) -> int:
    """A concurrency or rate limit: 0 would read as "nothing allowed" to one person and
    "unlimited" to another, so it is refused; no limit is `none` (keys limits) or leaving
    the option out (keys create)."""
    value = _micros(text)
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be at least 1, not {text!r} (to lift the limit, leave it out or use `keys limits ... none`)")
    return value


def _limit(text: str) -> int | None:
    """A limit for `keys limits`: a positive integer, or none/off/unlimited to clear it."""
    if text.lower() in ("none", "off", "unlimited", "-"):
        return None
    return _positive(text)


def _models(text: str) -> list[str] | None:
    """a,b -> [a, b]; "*" or "all" clears the restriction."""
    if text.strip().lower() in ("*", "all", "none"):
        return None
    models = [m.strip() for m in text.split(",") if m.strip()]
    if not models:
        raise argparse.ArgumentTypeError("--models needs at least one model (or * for all)")
    return models


def _when(text: str) -> float | None:
    """A point in time for a report (--since, --until): Unix seconds or ISO 8601."""
    try:
        return parse_time(text, "time")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _expiry(text: str) -> float | None:
    """When a key expires (--expires): a future time, or from now (30d, 12h, 2w)."""
    try:
        return parse_expiry(text, "--expires")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _when_or_none(text: str) -> float | None:
    return None if text.lower() in ("none", "never", "off", "-") else _expiry(text)


def add_key_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add `keys ...` to a parser's subparsers; returns the `keys` parser."""
    json_flag = argparse.ArgumentParser(add_help=False)
    json_flag.add_argument("--json", action="store_true", help="machine-readable output")

    keys = subparsers.add_parser("keys", help="manage API keys and balances")
    # SUPPRESS: when absent here, a value given before `keys` stands.
    keys.add_argument("--config", default=argparse.SUPPRESS, help="config.yaml whose ledger to open")
    keys.add_argument("--db", default=argparse.SUPPRESS, metavar="PATH",
                      help="the SQLite ledger file itself (overrides the config)")
    sub = keys.add_subparsers(dest="keys_command", metavar="COMMAND")
    sub.required = True

    create = sub.add_parser("create", parents=[json_flag], help="create a key (prints the secret once)")
    create.add_argument("name")
    amount = create.add_mutually_exclusive_group()
    amount.add_argument("--balance", type=_nonneg, default=0, metavar="MICROS", help="initial balance, micro-units")
    amount.add_argument("--balance-usd", type=_usd, dest="balance_usd", metavar="AMOUNT", help="e.g. 1.50")
    create.add_argument("--models", type=_models, default=None, metavar="A,B", help="allowed models (default: all)")
    create.add_argument("--concurrency", type=_positive, default=None, metavar="N")
    create.add_argument("--rate", type=_positive, default=None, metavar="N", help="requests per minute")
    create.add_argument("--tpm", type=_positive, default=None, metavar="N", help="tokens per minute")
    for period in ("daily", "monthly"):
        budget = create.add_mutually_exclusive_group()
        budget.add_argument(f"--{period}-budget", dest=f"{period}_budget", type=_positive, default=None,
                            metavar="MICROS")
        budget.add_argument(f"--{period}-budget-usd", dest=f"{period}_budget", type=_usd, metavar="AMOUNT",
                            help="in dollars, e.g. 25")
    create.add_argument("--expires", type=_expiry, default=None, metavar="WHEN",
                        help="Unix seconds, ISO 8601, or from now: 30d, 12h, 2w")
    create.add_argument("--team", default=None, metavar="TEAM_ID", help="under a team (no balance: the team pays)")
    create.add_argument("--user", default=None, metavar="USER_ID", help="under a user (their team follows)")

    sub.add_parser("list", parents=[json_flag], help="list keys (never the secrets)")

    topup = sub.add_parser("topup", parents=[json_flag], help="add to a balance (negative corrects)")
    topup.add_argument("key_id")
    topup_amount = topup.add_mutually_exclusive_group(required=True)
    topup_amount.add_argument("micros", type=_micros, nargs="?", metavar="MICROS", help="micro-dollars")
    topup_amount.add_argument("--usd", type=_usd_signed, metavar="AMOUNT", help="dollars, e.g. 5 or 1.50 or -0.25")

    limits = sub.add_parser("limits", parents=[json_flag], help="change a key's limits")
    limits.add_argument("key_id")
    limits.add_argument("--models", type=_models, default=UNSET, metavar="A,B|*")
    limits.add_argument("--concurrency", type=_limit, default=UNSET, metavar="N|none")
    limits.add_argument("--rate", type=_limit, default=UNSET, metavar="N|none")
    limits.add_argument("--tpm", type=_limit, default=UNSET, metavar="N|none", help="tokens per minute")
    for period in ("daily", "monthly"):
        budget = limits.add_mutually_exclusive_group()
        budget.add_argument(f"--{period}-budget", dest=f"{period}_budget", type=_limit, default=UNSET,
                            metavar="MICROS|none")
        budget.add_argument(f"--{period}-budget-usd", dest=f"{period}_budget", type=_usd, metavar="AMOUNT")
    limits.add_argument("--expires", type=_when_or_none, default=UNSET, metavar="WHEN|none")

    show = sub.add_parser("show", parents=[json_flag], help="a key, its spend today and this month")
    show.add_argument("key_id")

    rotate = sub.add_parser("rotate", parents=[json_flag], help="a new secret for a key (printed once)")
    rotate.add_argument("key_id")
    rotate.add_argument("--grace", default=None, metavar="30m|12h|SECONDS",
                        help="the old secret keeps working this long (default: it stops at once)")

    audit = sub.add_parser("audit", parents=[json_flag], help="the audit log of key changes")
    audit.add_argument("--key", dest="key", default=None, metavar="KEY_ID")
    audit.add_argument("--limit", type=_nonneg, default=50, metavar="N")

    revoke = sub.add_parser("revoke", parents=[json_flag], help="revoke a key")
    revoke.add_argument("key_id")

    spool = sub.add_parser("spool", parents=[json_flag],
                           help="settlements waiting in the local spool (postgres); `spool replay` applies them")
    spool.add_argument("action", nargs="?", choices=("show", "replay"), default="show")

    _add_usage(sub, json_flag)
    for name, what in (("block", "refuse a key (403) until it is unblocked"), ("unblock", "take a blocked key back"),
                       ("delete", "revoke a key for good and leave it out of the list (its usage stays)")):
        sub.add_parser(name, parents=[json_flag], help=what).add_argument("key_id")
    add_level_commands(subparsers, json_flag)
    return keys


def _add_usage(sub: Any, json_flag: argparse.ArgumentParser) -> None:
    usage = sub.add_parser("usage", parents=[json_flag], help="recent usage records")
    usage.add_argument("--key", dest="key", default=None, metavar="KEY_ID")
    usage.add_argument("--limit", type=_nonneg, default=20, metavar="N")
    usage.add_argument("--model", default=None, metavar="MODEL", help="one served model")
    usage.add_argument("--since", type=_when, default=None, metavar="T")
    usage.add_argument("--until", type=_when, default=None, metavar="T")
    usage.add_argument("--group-by", dest="group_by", default=None, metavar="key,model,worker,endpoint,team,day|hour")
    usage.add_argument("--format", dest="format", choices=("table", "json", "csv"), default=None)


_money = usd  # every amount a person reads is in dollars (proxy.ledger.service.usd); JSON keeps micros


# What a `keys show` field that is not set means, by name (a limit not set is no limit).
_UNSET_MEANS = {"allowed_models": "every model", "expires_at": "never", "expires": "never",
                "daily_budget_micros": "no budget", "monthly_budget_micros": "no budget"}


def _show_line(name: str, value: Any) -> str:
    """A `keys show` line: an amount in dollars, its micros beside it; a field that is not set
    says what that means; a list as its items."""
    if value is None:
        return f"{name.removesuffix('_micros')}: {_UNSET_MEANS.get(name, 'no limit')}"
    if name.endswith("_micros") and isinstance(value, int) and not isinstance(value, bool):
        return f"{name.removesuffix('_micros')}: {_money(value)} ({value} micros)"
    if isinstance(value, (list, tuple)):
        return f"{name}: {', '.join(map(str, value)) or '(none)'}"
    return f"{name}: {value}"


def _key_dict(record: KeyRecord) -> dict[str, Any]:
    return key_dict(record)


def _key_line(record: KeyRecord) -> str:
    models = ",".join(record.allowed_models) if record.allowed_models is not None else "*"
    conc = "-" if record.concurrency is None else str(record.concurrency)
    rate = "-" if record.rate_per_min is None else str(record.rate_per_min)
    tpm = "-" if record.tokens_per_min is None else str(record.tokens_per_min)
    budgets = "/".join(_money(b) for b in (record.daily_budget_micros, record.monthly_budget_micros))
    expires = (iso(record.expires_at) or "-")[:10]
    return (
        f"{record.key_id:<20} {record.name[:24]:<24} {record.prefix + '...':<16} "
        f"{record.balance_micros:>16} {_money(record.balance_micros):>16} {models[:30]:<30} "
        f"{conc:>5} {rate:>6} {tpm:>8} {budgets:>21} {expires:>10} {'yes' if record.revoked else 'no':>7}"
    )


_KEY_HEADER = (
    f"{'KEY_ID':<20} {'NAME':<24} {'PREFIX':<16} {'BALANCE_MICROS':>16} {'BALANCE_USD':>16} {'MODELS':<30} "
    f"{'CONC':>5} {'RATE':>6} {'TPM':>8} {'BUDGET_DAY/MONTH':>21} {'EXPIRES':>10} {'REVOKED':>7}"
)


def _ledger_section(args: argparse.Namespace, config: Any) -> Any:
    """config.ledger (a Config's, or the defaults'), --db making it that SQLite file."""
    section = config.ledger if config is not None else config_settings.of("ledger")
    db = getattr(args, "db", None)
    if db:
        section = dataclasses.replace(section, backend="sqlite", path=str(db))
    return section


def _base_dir(args: argparse.Namespace, config: Any) -> Any:
    """Where a relative ledger path lives: the same rule as the app (proxy/app.py), i.e. the
    config file's directory, else the current directory; an explicit --db is taken as typed."""
    if getattr(args, "db", None):
        return None
    path = getattr(config, "path", None)
    return path.parent if path is not None else None


def _where(args: argparse.Namespace, config: Any) -> str:
    if getattr(args, "db", None):
        return "--db"
    path = getattr(config, "path", None)
    return str(Path(path).resolve()) if path is not None else "the embedded defaults (no config.yaml found)"


_HOW = ("run it in the directory of the server's config.yaml, or pass --config FILE "
        "(or set RESPONSES_PROXY_CONFIG), or --db PATH")


def _locate(args: argparse.Namespace, config: Any) -> Any:
    """The ledger section to open, its path made absolute; raises LedgerError when the
    command would make a ledger nobody asked for."""
    section = _ledger_section(args, config)
    backend = section.backend
    if backend == "none":
        raise LedgerError(f"ledger.backend is none in {_where(args, config)}: there are no keys to manage")
    if backend == "postgres":  # a database server: nothing is made by accident (the schema is migrated)
        from proxy.ledger.postgres.ledger import redact

        print(f"ledger: postgres {redact(section.dsn or '')}", file=sys.stderr, flush=True)
        return section  # its spool_path: relative to the config's folder, as for the server (open_ledger)
    path = resolve_path(section.path, _base_dir(args, config) or Path.cwd())
    if path != ":memory:":
        path = str(Path(path).resolve())
    print(f"ledger: {path}", file=sys.stderr, flush=True)
    if path != ":memory:" and not Path(path).exists():
        if "create" not in (getattr(args, "keys_command", None), getattr(args, "level_command", None)):
            raise LedgerError(f"no ledger at {path} (config: {_where(args, config)}); {_HOW}")
        if getattr(config, "path", None) is None and not getattr(args, "db", None) and not Path(path).parent.is_dir():
            raise LedgerError(f"no ledger at {path} and no directory {Path(path).parent} to make one in "
                              f"(config: {_where(args, config)}); {_HOW}, or create that directory first")
        print(f"ledger: {path} does not exist yet: creating it", file=sys.stderr, flush=True)
    return dataclasses.replace(section, path=path)


def _actor() -> str:
    import getpass

    try:
        return "cli:" + getpass.getuser()
    except Exception:  # no user name in this environment
        return "cli"


def _limits_of(args: argparse.Namespace, unset: Any) -> dict[str, Any]:
    """The service's limit fields from the flags (those left at `unset` are left out)."""
    pairs = (("allowed_models", args.models), ("concurrency", args.concurrency), ("rate_per_min", args.rate),
             ("tokens_per_min", args.tpm), ("daily_budget_micros", args.daily_budget),
             ("monthly_budget_micros", args.monthly_budget), ("expires_at", args.expires))
    return {name: value for name, value in pairs if value is not unset}


def _print_secret(secret: str, record: KeyRecord, as_json: bool, out: Any) -> None:
    if as_json:
        print(json.dumps({"secret": secret, **_key_dict(record)}), file=out)
        return
    print(f"key_id:  {record.key_id}", file=out)
    print(f"secret:  {secret}", file=out)
    if record.own_balance:
        print(f"balance: {_money(record.balance_micros)} ({record.balance_micros} micros)", file=out)
    else:
        print(f"balance: the purse of {record.user_id or record.team_id}'s levels", file=out)
    if record.grace_until is not None:
        print(f"the previous secret works until {iso(record.grace_until)}", file=out)
    print("The secret is shown once and is not stored; keep it now.", file=out)


async def _usage(ledger: ConsoleReads, args: argparse.Namespace, out: Any) -> None:
    fmt = args.format or ("json" if getattr(args, "json", False) else "table")
    query = UsageQuery({"since": args.since, "until": args.until, "key_id": args.key, "model": args.model,
                        "group_by": args.group_by or "", "limit": max(1, min(args.limit or 1, 1000))})
    if query.group_by:
        rows = await query.total_rows(ledger)
        columns = list(query.total_columns)
    else:
        page, _ = await query.rows(ledger)
        rows = [usage_dict(r) for _, r in page][:args.limit]
        columns = list(USAGE_FIELDS)
    if fmt == "json":
        print(json.dumps(rows), file=out)
    elif fmt == "csv":
        print(to_csv(rows, columns), file=out, end="")
    elif query.group_by:
        print("  ".join(f"{_column(c):>14}" for c in columns), file=out)
        for row in rows:
            print("  ".join(f"{_cell(c, row[c])[:24]:>14}" for c in columns), file=out)
    else:
        print(f"{'CREATED':<20} {'REQUEST_ID':<36} {'KEY_ID':<20} {'MODEL':<24} {'IN':>8} {'CACHED':>8} "
              f"{'OUT':>8} {'COST_USD':>12} {'DEBITED_USD':>12} STATUS", file=out)
        for r in rows:
            print(f"{r['created']:<20} {r['request_id'][:36]:<36} {r['key_id']:<20} {r['model'][:24]:<24} "
                  f"{r['input_tokens']:>8} {r['cached_tokens']:>8} {r['output_tokens']:>8} "
                  f"{_money(r['cost_micros']):>12} "
                  f"{_money(r['debited_micros']):>12} {r['status']}", file=out)


def _column(name: str) -> str:
    """A table's heading: an amount is shown in dollars (its JSON and CSV keep micros)."""
    return name.removesuffix("_micros").upper() + "_USD" if name.endswith("_micros") else name.upper()


def _cell(name: str, value: Any) -> str:
    return _money(value) if name.endswith("_micros") else str(value)


async def _command(service: KeyService, args: argparse.Namespace, out: Any) -> None:
    cmd = args.keys_command
    as_json = getattr(args, "json", False)
    if cmd == "create":
        balance = args.balance_usd if args.balance_usd is not None else args.balance
        place = {name: value for name, value in (("team_id", args.team), ("user_id", args.user)) if value}
        money = {"balance_micros": balance} if balance or not place else {}  # under a level: its purse pays
        secret, record = await service.create({"name": args.name, **money, **place, **_limits_of(args, None)})
        _print_secret(secret, record, as_json, out)
    elif cmd in ("block", "unblock"):
        record = await service.set_blocked(args.key_id, cmd == "block")
        print(json.dumps(_key_dict(record)) if as_json else f"{args.key_id}: {cmd}ed", file=out)
    elif cmd == "delete":
        await service.delete(args.key_id)
        print(json.dumps({"key_id": args.key_id, "deleted": True}) if as_json else f"{args.key_id}: deleted",
              file=out)
    elif cmd == "list":
        records = await service.list()
        if as_json:
            print(json.dumps([_key_dict(r) for r in records]), file=out)
        else:
            print(_KEY_HEADER, file=out)
            for record in records:
                print(_key_line(record), file=out)
    elif cmd == "show":
        record = await service.get(args.key_id)
        data = {**_key_dict(record), **await service.summary(record)}
        print(json.dumps(data) if as_json else "\n".join(_show_line(k, v) for k, v in data.items()), file=out)
    elif cmd == "topup":
        amount = args.usd if args.usd is not None else args.micros
        balance = await service.top_up(args.key_id, amount)
        if as_json:
            print(json.dumps({"key_id": args.key_id, "balance_micros": balance}), file=out)
        else:
            print(f"{args.key_id}: {'+' if amount >= 0 else ''}{_money(amount)}, balance {_money(balance)} "
                  f"({balance} micros)", file=out)
    elif cmd == "limits":
        changes = _limits_of(args, UNSET)
        record = await service.update(args.key_id, changes) if changes else await service.get(args.key_id)
        print(json.dumps(_key_dict(record)) if as_json else _KEY_HEADER + "\n" + _key_line(record), file=out)
    elif cmd == "revoke":
        await service.revoke(args.key_id)
        print(json.dumps({"key_id": args.key_id, "revoked": True}) if as_json else f"{args.key_id}: revoked",
              file=out)
    elif cmd == "rotate":
        secret, record = await service.rotate(args.key_id, args.grace)
        _print_secret(secret, record, as_json, out)
    elif cmd == "usage":
        await _usage(service.ledger, args, out)
    elif cmd == "audit":
        entries = [{"seq": e.seq, "created": iso(e.created_at), "actor": e.actor, "action": e.action,
                    "key_id": e.key_id, "details": e.details}
                   for e in await service.ledger.list_audit(key_id=args.key, limit=args.limit)]
        if as_json:  # one JSON document per command, an array for a listing (list, usage, audit)
            print(json.dumps(entries), file=out)
        for e in () if as_json else entries:
            print(f"{e['created']} {e['actor']:<16} {e['action']:<12} {e['key_id'] or '-':<20} "
                  f"{json.dumps(e['details'])}", file=out)


def _spool_lines(spool: Any, as_json: bool, out: Any) -> int:
    """Print the waiting records (never a secret: a record holds key ids and figures)."""
    records = spool.records()
    for record in records:
        usage = record.get("usage") or {}
        line = {"kind": record["kind"], "request_id": record["request_id"], "key_id": usage.get("key_id"),
                "cost_micros": usage.get("cost_micros"), "lease_id": record.get("lease_id")}
        print(json.dumps(line) if as_json else
              f"{line['kind']:<12} {line['request_id']:<40} {line['key_id'] or '-':<20} "
              f"{'-' if line['cost_micros'] is None else _money(line['cost_micros'])}", file=out)
    return len(records)


async def _spool(args: argparse.Namespace, config: Any, out: Any) -> int:
    """`keys spool [show|replay]`: what the postgres ledger could not write yet, from the files
    alone (show: no database needed), or replayed now (replay)."""
    section = _locate(args, config)
    ledger = open_ledger(section, base_dir=_base_dir(args, config))
    if not isinstance(ledger, PgSpoolOps):
        print(f"the {section.backend} ledger writes locally: it has no spool", file=out)
        return 0
    spool = ledger.spool
    applied = 0
    if args.action == "replay":
        try:
            await ledger.start()  # replays a waiting spool itself, before anything else
            try:
                applied = ledger.stats["replayed"] + await ledger.replay_spool()
            finally:
                await ledger.close()
        except LedgerError as exc:  # still broken: say why, and what still waits
            print(f"error: {exc}", file=sys.stderr, flush=True)
    waiting = _spool_lines(spool, args.json, out)
    rejected = spool.rejected()
    print(f"spool {spool.path}: {applied} applied now, {waiting} waiting"
          + (f", {len(rejected)} set aside in {spool.rejected_path} (never applicable: see the log)"
             if rejected else ""), file=sys.stderr, flush=True)
    return 1 if args.action == "replay" and waiting else 0


async def _run(args: argparse.Namespace, config: Any, out: Any) -> int:
    if getattr(args, "keys_command", None) == "spool":
        return await _spool(args, config, out)
    ledger = open_ledger(_locate(args, config), base_dir=_base_dir(args, config))
    await ledger.start()
    try:
        if getattr(args, "level_kind", None):
            await run_level_command(LevelService(ledger, _actor()), args, out)
        else:
            await _command(KeyService(ledger, _actor()), args, out)
        return 0
    finally:
        await ledger.close()


def run_key_command(args: argparse.Namespace, config: Any = None, out: Any = None) -> int:
    """Run a parsed `keys ...` command against the ledger in config["ledger"] (or args.db).
    Returns the exit status: 0 done, 1 refused (unknown key, bad value, storage error)."""
    try:
        return asyncio.run(_run(args, config, out or sys.stdout))
    except (LedgerError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.ledger.cli", description="ledger key management")
    parser.add_argument("--config", default=None,
                        help="config.yaml (its ledger section); default: $RESPONSES_PROXY_CONFIG, else ./config.yaml")
    parser.add_argument("--db", default=None, help="SQLite ledger path (overrides the config)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_key_commands(sub)
    args = parser.parse_args(argv)
    from proxy.config.load import Config, ConfigError, default_config

    try:
        config = Config.load(args.config or default_config())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_key_command(args, config)


if __name__ == "__main__":
    sys.exit(main())
