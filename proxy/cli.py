"""The console script: `responses-proxy serve` (the default) and `responses-proxy keys ...`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from proxy.config import Config, ConfigError


def _default_config() -> str | None:
    found = Path("config.yaml")
    return str(found) if found.exists() else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="responses-proxy", description=__doc__)
    parser.add_argument("--config", default=os.environ.get("RESPONSES_PROXY_CONFIG") or _default_config(),
                        help="config.yaml (default: ./config.yaml if present, else the embedded defaults)")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the proxy (the default command)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--workers", type=int, help="processes sharing the port (SO_REUSEPORT)")
    try:
        from proxy.ledger.cli import add_key_commands
    except ImportError:  # pragma: no cover - the ledger package is part of the product
        add_key_commands = None
    if add_key_commands is not None:
        add_key_commands(sub)
    return parser


def _serve(config: Config, args: argparse.Namespace) -> int:
    from aiohttp import web

    from proxy.app import build_app
    from proxy.logs import configure

    server = config.section("server")
    host = args.host or os.environ.get("RESPONSES_PROXY_HOST") or server["host"]
    port = args.port or int(os.environ.get("RESPONSES_PROXY_PORT") or server["port"])
    configure(server.get("log_format", "auto"), server.get("log_level", "info"))
    try:
        import uvloop
    except ImportError:
        uvloop = None
    app = build_app(config)
    print(f"responses-proxy listening on http://{host}:{port}", flush=True)
    web.run_app(app, host=host, port=port, print=None, access_log=None, handler_cancellation=True,
                loop=uvloop.new_event_loop() if uvloop else None, reuse_port=bool(getattr(args, "reuse_port", False)))
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
