"""Key management on the ledger database (no admin HTTP surface).

    responses-proxy keys create NAME [--balance MICROS | --balance-usd 1.50] [--models a,b]
                                     [--concurrency N] [--rate N]
    responses-proxy keys list
    responses-proxy keys topup KEY_ID MICROS
    responses-proxy keys limits KEY_ID [--models a,b|*] [--concurrency N|none] [--rate N|none]
    responses-proxy keys revoke KEY_ID
    responses-proxy keys usage [--key KEY_ID] [--limit N]

Also `python -m proxy.ledger.cli [--config FILE] [--db PATH] keys ...`.
The secret is printed once, by `create`; nothing else ever prints it (only its prefix).

Which ledger: the one the server would open, found as `serve` finds its config (--config,
else $RESPONSES_PROXY_CONFIG, else ./config.yaml, else the embedded defaults), its
`ledger.path` taken relative to that file; `--db PATH` names the file itself. Every command
prints `ledger: /absolute/path` on stderr first. A ledger file that does not exist is never
made by accident: every command but `create` refuses (exit 1); `create` makes a new one
where a config file or --db says, but under the embedded defaults (no config file found)
only in a directory that already exists, as data/ does once a server has run there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Sequence

from proxy.ledger import UNSET, KeyRecord, LedgerError, open_ledger, resolve_path
from proxy.ledger.usage import MAX_AMOUNT

MICROS = 1_000_000


def _usd(text: str) -> int:
    try:
        value = Decimal(text) * MICROS
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not an amount: {text!r}") from None
    if not value.is_finite() or value != value.to_integral_value() or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative whole number of micro-units")
    if value > MAX_AMOUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: at most {MAX_AMOUNT} micro-units")
    return int(value)


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

    sub.add_parser("list", parents=[json_flag], help="list keys (never the secrets)")

    topup = sub.add_parser("topup", parents=[json_flag], help="add to a balance (negative corrects)")
    topup.add_argument("key_id")
    topup.add_argument("micros", type=_micros)

    limits = sub.add_parser("limits", parents=[json_flag], help="change a key's limits")
    limits.add_argument("key_id")
    limits.add_argument("--models", type=_models, default=UNSET, metavar="A,B|*")
    limits.add_argument("--concurrency", type=_limit, default=UNSET, metavar="N|none")
    limits.add_argument("--rate", type=_limit, default=UNSET, metavar="N|none")

    revoke = sub.add_parser("revoke", parents=[json_flag], help="revoke a key")
    revoke.add_argument("key_id")

    usage = sub.add_parser("usage", parents=[json_flag], help="recent usage records")
    usage.add_argument("--key", dest="key", default=None, metavar="KEY_ID")
    usage.add_argument("--limit", type=_nonneg, default=20, metavar="N")
    return keys


def _money(micros: int) -> str:
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), MICROS)
    return f"{sign}{whole}.{frac:06d}"


def _key_dict(record: KeyRecord) -> dict[str, Any]:
    data = asdict(record)
    data["allowed_models"] = list(record.allowed_models) if record.allowed_models is not None else None
    return data


def _key_line(record: KeyRecord) -> str:
    models = ",".join(record.allowed_models) if record.allowed_models is not None else "*"
    conc = "-" if record.concurrency is None else str(record.concurrency)
    rate = "-" if record.rate_per_min is None else str(record.rate_per_min)
    return (
        f"{record.key_id:<20} {record.name[:24]:<24} {record.prefix + '...':<16} "
        f"{record.balance_micros:>16} {_money(record.balance_micros):>14} {models[:30]:<30} "
        f"{conc:>5} {rate:>6} {'yes' if record.revoked else 'no':>7}"
    )


_KEY_HEADER = (
    f"{'KEY_ID':<20} {'NAME':<24} {'PREFIX':<12} {'BALANCE_MICROS':>16} {'BALANCE':>14} {'MODELS':<30} "
    f"{'CONC':>5} {'RATE':>6} {'REVOKED':>7}"
)


def _ledger_section(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    section: dict[str, Any] = {}
    if config is not None:
        section = dict(config.section("ledger") if hasattr(config, "section") else config.get("ledger", {}))
    db = getattr(args, "db", None)
    if db:
        section = {**section, "backend": "sqlite", "path": db}
    return section


def _base_dir(args: argparse.Namespace, config: Any) -> Any:
    """Where a relative ledger path lives: the same rule as the app (proxy/http/app.py), i.e. the
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


def _locate(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """The ledger section to open, its path made absolute; raises LedgerError when the
    command would make a ledger nobody asked for."""
    section = _ledger_section(args, config)
    backend = str(section.get("backend", "sqlite")).lower()
    if backend == "none":
        raise LedgerError(f"ledger.backend is none in {_where(args, config)}: there are no keys to manage")
    path = resolve_path(str(section.get("path") or "data/ledger.db"), _base_dir(args, config) or Path.cwd())
    if path != ":memory:":
        path = str(Path(path).resolve())
    print(f"ledger: {path}", file=sys.stderr, flush=True)
    if path != ":memory:" and not Path(path).exists():
        if args.keys_command != "create":
            raise LedgerError(f"no ledger at {path} (config: {_where(args, config)}); {_HOW}")
        if getattr(config, "path", None) is None and not getattr(args, "db", None) and not Path(path).parent.is_dir():
            raise LedgerError(f"no ledger at {path} and no directory {Path(path).parent} to make one in "
                              f"(config: {_where(args, config)}); {_HOW}, or create that directory first")
        print(f"ledger: {path} does not exist yet: creating it", file=sys.stderr, flush=True)
    return {**section, "path": path}


async def _run(args: argparse.Namespace, config: Any, out: Any) -> int:
    ledger = open_ledger(_locate(args, config))
    await ledger.start()
    try:
        cmd = args.keys_command
        as_json = getattr(args, "json", False)
        if cmd == "create":
            balance = args.balance_usd if args.balance_usd is not None else args.balance
            secret, record = await ledger.create_key(
                args.name, balance, allowed_models=args.models, concurrency=args.concurrency, rate_per_min=args.rate
            )
            if as_json:
                print(json.dumps({"secret": secret, **_key_dict(record)}), file=out)
            else:
                print(f"key_id:  {record.key_id}", file=out)
                print(f"secret:  {secret}", file=out)
                print(f"balance: {record.balance_micros} micros ({_money(record.balance_micros)})", file=out)
                print("The secret is shown once and is not stored; keep it now.", file=out)
        elif cmd == "list":
            records = await ledger.list_keys()
            if as_json:
                print(json.dumps([_key_dict(r) for r in records]), file=out)
            else:
                print(_KEY_HEADER, file=out)
                for record in records:
                    print(_key_line(record), file=out)
        elif cmd == "topup":
            balance = await ledger.top_up(args.key_id, args.micros)
            if as_json:
                print(json.dumps({"key_id": args.key_id, "balance_micros": balance}), file=out)
            else:
                print(f"{args.key_id}: balance {balance} micros ({_money(balance)})", file=out)
        elif cmd == "limits":
            record = await ledger.set_limits(
                args.key_id, allowed_models=args.models, concurrency=args.concurrency, rate_per_min=args.rate
            )
            print(json.dumps(_key_dict(record)) if as_json else _KEY_HEADER + "\n" + _key_line(record), file=out)
        elif cmd == "revoke":
            await ledger.revoke(args.key_id)
            print(json.dumps({"key_id": args.key_id, "revoked": True}) if as_json else f"{args.key_id}: revoked",
                  file=out)
        elif cmd == "usage":
            records = await ledger.list_usage(args.key, args.limit)
            if as_json:
                print(json.dumps([asdict(r) for r in records]), file=out)
            else:
                print(f"{'REQUEST_ID':<36} {'KEY_ID':<20} {'MODEL':<24} {'IN':>8} {'CACHED':>8} {'OUT':>8} "
                      f"{'COST':>12} {'DEBITED':>12} STATUS", file=out)
                for r in records:
                    print(f"{r.request_id[:36]:<36} {r.key_id:<20} {r.model[:24]:<24} {r.input_tokens:>8} "
                          f"{r.cached_tokens:>8} {r.output_tokens:>8} {r.cost_micros:>12} "
                          f"{r.debited_micros if r.debited_micros is not None else '-':>12} {r.status}", file=out)
        else:  # pragma: no cover - argparse refuses unknown commands
            print(f"unknown keys command {cmd!r}", file=sys.stderr)
            return 2
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
