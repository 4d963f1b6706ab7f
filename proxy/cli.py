"""The console script: `responses-proxy serve` (the default), `responses-proxy keys ...` and
`responses-proxy config reference [--markdown]|check`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable
from typing import Any

from proxy.config.load import Config, ConfigError, default_config
from proxy.config.serving import listen
from proxy.runtime.listen import bind_sockets, listen_error
from proxy.runtime.local_keys import LocalKeyError


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="responses-proxy", description=__doc__)
    parser.add_argument("--config", default=default_config(),
                        help="config.yaml (default: $RESPONSES_PROXY_CONFIG, else ./config.yaml if present, "
                             "else the embedded defaults)")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the proxy (the default command)")
    # Also accepted after the subcommand (`serve --config X`); SUPPRESS keeps the top-level value otherwise.
    serve.add_argument("--config", default=argparse.SUPPRESS, help="as the top-level --config")
    serve.add_argument("--host")
    serve.add_argument("--port", help="1-65535 (default: server.port)")
    serve.add_argument("--demo-key", action="store_true",
                       help="create a demo key at start and print it (auth.demo_key; make run sets it)")
    serve.add_argument("--workers", type=_workers_arg,
                       help="processes sharing the port (SO_REUSEPORT); a number or 'auto' (one per core); "
                            "default: server.workers from the config (1)")
    try:
        from proxy.ledger.cli import add_key_commands
    except ImportError:  # pragma: no cover - the ledger package is part of the product
        add_key_commands = None  # type: ignore[assignment]  # checked below
    if add_key_commands is not None:
        add_key_commands(sub)
    migrate = sub.add_parser("migrate", help="bring the ledger's schema up to this release (a deployment's "
                                             "migration job; serve also does it when it must)")
    migrate.add_argument("--config", default=argparse.SUPPRESS, help="as the top-level --config")
    conf = sub.add_parser("config", help="the configuration: its commented reference, or a check of a file")
    conf_sub = conf.add_subparsers(dest="config_command", required=True)
    ref = conf_sub.add_parser("reference", help="print the commented reference of every key (config.yaml is it)")
    ref.add_argument("--markdown", action="store_true", help="the README's table of every key instead")
    check = conf_sub.add_parser("check", help="load --config and build the app (middlewares included), start nothing")
    check.add_argument("--config", default=argparse.SUPPRESS, help="as the top-level --config")
    return parser


def _config_dir_on_path(config: Config) -> None:
    """An operator's middleware next to config.yaml (mycompany/audit.py) imports as mycompany.audit."""
    if config.path is not None:
        folder = str(config.path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)


def _serve(config: Config, args: argparse.Namespace) -> int:
    host, port, workers = listen(config, args.host, args.port, getattr(args, "workers", None))
    if getattr(args, "demo_key", False) and config.auth.enabled:
        config.update("auth", demo_key=True)
    _config_dir_on_path(config)
    _local_keys(config, workers)
    if workers > 1:
        from proxy.runtime.supervisor import supervise

        return supervise(config, host, port, workers, _serve_one)
    return _serve_one(config, host, port, reuse_port=bool(getattr(args, "reuse_port", False)))


def _local_keys(config: Config, workers: int) -> None:
    """The seal key, session secret and demo admin key the operator left unset (proxy/runtime/local_keys.py)."""
    from proxy.runtime.local_keys import ensure

    made = config.local_keys = ensure(config)
    for warning in made.warnings:
        print(f"responses-proxy: warning: {warning}", file=sys.stderr, flush=True)
    if workers > 1 and config.admin.keys and not made.session_shared:
        print(f"responses-proxy: warning: {workers} processes and no admin.session_secret they can share: a "
              "dashboard login is valid on one process only (set admin.session_secret)", file=sys.stderr, flush=True)


def _raise_nofile() -> None:
    """Each open stream costs two descriptors (client and upstream): lift the soft limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - not fatal: the old limit stays
        pass


_HUP_DURING_START: list[bool] = []  # a HUP that came before the app ran: reloaded once it does


def _note_hup(_signum: int, _frame: Any) -> None:
    _HUP_DURING_START.append(True)


def _reload_on_hup(app: Any) -> None:
    """SIGHUP (systemctl reload; the supervisor forwards it to each process): config.yaml read
    again (proxy/runtime/reload.py). One that came during start-up (noted by _note_hup: neither
    the default, which kills, nor a reload of a half-built app) is carried out now."""
    from proxy.runtime.reload import ReloadRefused, reload_app

    def hup() -> None:
        try:
            reload_app(app)
        except ReloadRefused:
            pass  # said in the log, once; the old configuration serves on

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, hup)
    if _HUP_DURING_START:
        _HUP_DURING_START.clear()
        loop.call_soon(hup)


def _serve_one(config: Config, host: str, port: int, *, reuse_port: bool = False, announce: bool = True,
               on_ready: Callable[[], None] | None = None) -> int:
    """One serving process: build the app, run it until SIGINT/SIGTERM."""
    from aiohttp import web

    from proxy.app import build_app
    from proxy.logs import configure

    configure(config.server.log_format, config.server.log_level)
    signal.signal(signal.SIGHUP, _note_hup)  # until the app runs (_reload_on_hup)
    _raise_nofile()
    try:
        import uvloop
    except ImportError:
        uvloop = None  # type: ignore[assignment]  # optional (the `fast` extra): checked before use
    app = build_app(config)
    try:
        sockets = bind_sockets(host, port, reuse_port=reuse_port)
    except OSError as exc:
        print(f"responses-proxy: {listen_error(host, port, exc)}", file=sys.stderr, flush=True)
        return 2
    started = False

    async def ready(_app: web.Application) -> None:
        # Appended last: runs once every cleanup context (ledger, simulator, demo key) is up.
        nonlocal started
        started = True
        _reload_on_hup(app)
        if announce:
            from proxy.runtime.local_keys import announce_admin_key

            announce_admin_key(config, host, port)
            print(f"responses-proxy listening on http://{host}:{port}", flush=True)
        if on_ready is not None:  # a --workers child: its supervisor says "listening" once every child is
            on_ready()

    app.on_startup.append(ready)
    from proxy.ledger import LedgerError, LedgerFault

    try:
        _run(app, sockets, uvloop.new_event_loop() if uvloop else asyncio.new_event_loop())
    except (ConfigError, LedgerError, OSError) as exc:
        if started:
            raise
        print(f"responses-proxy: cannot start: {exc}", file=sys.stderr, flush=True)
        # 2: the ledger's database refuses us in a way only its operator can fix (a wrong
        # password, a missing table); a supervisor should not restart us in a loop.
        return 2 if isinstance(exc, LedgerFault) else 1
    finally:
        for sock in sockets:
            sock.close()
    return 0


def _run(app, sockets: list, loop: asyncio.AbstractEventLoop) -> None:
    """web.run_app's sequence (start, serve until SIGINT/SIGTERM, clean up, close the loop), with
    the proxy's ProxyRunner: run_app always makes a plain web.AppRunner (parse_errors says why)."""
    from aiohttp import web

    from proxy.http.parse_errors import ProxyRunner

    asyncio.set_event_loop(loop)
    # keepalive_timeout: run_app's default (a plain AppRunner's is an hour).
    runner = ProxyRunner(app, handle_signals=True, access_log=None, handler_cancellation=True, keepalive_timeout=75.0)

    async def serve() -> None:
        await runner.setup()
        try:
            for sock in sockets:
                await web.SockSite(runner, sock).start()
            while True:  # noqa: ASYNC110 - serves until the task is cancelled; nothing is polled
                await asyncio.sleep(3600)
        finally:
            await runner.cleanup()

    main = loop.create_task(serve())
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


def _config_command(args: argparse.Namespace) -> int:
    if args.config_command == "reference":
        from proxy.config.reference import markdown_table, reference

        sys.stdout.write(markdown_table() if args.markdown else reference())
        return 0
    config = Config.load(args.config)
    _config_dir_on_path(config)
    from proxy.app import build_app

    build_app(config)  # the middleware factories check their sections here; nothing starts
    print(f"{args.config or 'the embedded defaults'}: ok")
    return 0


def _migrate(config: Config) -> int:
    from proxy.ledger import LedgerError, migrate_ledger

    try:
        print(asyncio.run(migrate_ledger(config.ledger, config.path.parent if config.path else None)), flush=True)
    except (LedgerError, OSError) as exc:
        print(f"responses-proxy: migrate: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "config":
            return _config_command(args)
        config = Config.load(args.config)
        if args.command == "migrate":
            return _migrate(config)
        if args.command in (None, "serve"):
            if args.command is None:
                args.host = args.port = args.workers = None
                args.demo_key = False
            return _serve(config, args)
        from proxy.ledger.cli import run_key_command

        return run_key_command(args, config)
    except (ConfigError, LocalKeyError) as exc:
        print(f"responses-proxy: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
