"""The console script: `responses-proxy serve` (the default) and `responses-proxy keys ...`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from proxy.config import Config, ConfigError


def _default_config() -> str | None:
    found = Path("config.yaml")
    return str(found) if found.exists() else None


def _workers_arg(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of processes: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def resolve_workers(value: object) -> int:
    """server.workers / --workers: a positive integer, or "auto" (or 0) = one process per core."""
    if value is None:
        return 1
    if isinstance(value, str) and value.strip().lower() == "auto" or value == 0:
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"server.workers must be a positive integer or 'auto', not {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"server.workers must be a positive integer or 'auto', not {value!r}") from None
    if n < 1:
        raise ConfigError(f"server.workers must be a positive integer or 'auto', not {value!r}")
    return n


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="responses-proxy", description=__doc__)
    parser.add_argument("--config", default=os.environ.get("RESPONSES_PROXY_CONFIG") or _default_config(),
                        help="config.yaml (default: ./config.yaml if present, else the embedded defaults)")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the proxy (the default command)")
    # Also accepted after the subcommand (`serve --config X`); SUPPRESS keeps the top-level value otherwise.
    serve.add_argument("--config", default=argparse.SUPPRESS, help="as the top-level --config")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--workers", type=_workers_arg,
                       help="processes sharing the port (SO_REUSEPORT); a number or 'auto' (one per core); "
                            "default: server.workers from the config (1)")
    try:
        from proxy.ledger.cli import add_key_commands
    except ImportError:  # pragma: no cover - the ledger package is part of the product
        add_key_commands = None
    if add_key_commands is not None:
        add_key_commands(sub)
    return parser


def _serve(config: Config, args: argparse.Namespace) -> int:
    server = config.section("server")
    host = args.host or os.environ.get("RESPONSES_PROXY_HOST") or server["host"]
    port = args.port or int(os.environ.get("RESPONSES_PROXY_PORT") or server["port"])
    workers = resolve_workers(args.workers if getattr(args, "workers", None) is not None else server.get("workers", 1))
    if workers > 1:
        from proxy.supervisor import supervise

        return supervise(config, host, port, workers, _serve_one)
    return _serve_one(config, host, port, reuse_port=bool(getattr(args, "reuse_port", False)))


def _raise_nofile() -> None:
    """Each open stream costs two descriptors (client and upstream): lift the soft limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - not fatal: the old limit stays
        pass


def _serve_one(config: Config, host: str, port: int, *, reuse_port: bool = False, announce: bool = True) -> int:
    """One serving process: build the app, run it until SIGINT/SIGTERM."""
    from aiohttp import web

    from proxy.app import build_app
    from proxy.logs import configure

    server = config.section("server")
    configure(server.get("log_format", "auto"), server.get("log_level", "info"))
    _raise_nofile()
    try:
        import uvloop
    except ImportError:
        uvloop = None
    app = build_app(config)
    if announce:
        print(f"responses-proxy listening on http://{host}:{port}", flush=True)
    web.run_app(app, host=host, port=port, print=None, access_log=None, handler_cancellation=True,
                loop=uvloop.new_event_loop() if uvloop else None, reuse_port=reuse_port)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = Config.load(args.config)
        if args.command in (None, "serve"):
            if args.command is None:
                args.host = args.port = args.workers = None
            return _serve(config, args)
        from proxy.ledger.cli import run_key_command

        return run_key_command(args, config)
    except ConfigError as exc:
        print(f"responses-proxy: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
