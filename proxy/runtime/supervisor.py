"""`serve --workers N`: N serving processes on one port (SO_REUSEPORT), one supervisor.

The parent does the once-only start-up work (the demo key: created and printed once,
here, so `make run` still prints exactly one `demo key:` line), then forks N children.
Each child builds its own app (its own event loop, client session, ledger connection and
writer thread, embedded simulator if any) and listens with SO_REUSEPORT; the kernel
spreads new connections over them. The parent forwards SIGTERM/SIGINT/SIGHUP to the
children (a HUP makes each reload its configuration, proxy/runtime/reload.py; the others stop
them) and exits when they have exited; if one child dies on its own, the others are
stopped too (the process manager restarts the whole set), and the exit code says so.

Shared state across processes:
  * the SQLite ledger is shared safely: WAL mode, each process has its own connection
    and writer thread, and every hold is checked and written inside BEGIN IMMEDIATE
    (the database-wide write lock), so two processes cannot both spend the same money.
  * limits: with `limits.backend: memory` (the default) they are counted per process, so
    the configured `limits.global_concurrency` and `limits.default_key_concurrency` are
    divided by N (rounded up) for each child. This is an approximation: the kernel hashes
    connections onto processes, so one process may refuse while another has room, and a
    key's own `concurrency` (set with `keys limits`), `rate_per_min` and `tokens_per_min`
    apply per process (up to N times the value in total). With `limits.backend: redis` every
    child counts in the one Redis (proxy/limits/redis_backend.py), so nothing is divided.
  * /metrics: prometheus_client's multiprocess mode (proxy/runtime/metrics.py). The supervisor
    sets PROMETHEUS_MULTIPROC_DIR before forking: a fresh temporary directory, removed at
    exit, unless the operator set it (then its *.db files are cleared first, as
    prometheus_client requires between runs); each child writes its figures there and any
    child's /metrics merges them all; a child's live gauges go when it exits
    (mark_process_dead).
"""

from __future__ import annotations

import asyncio
import glob
import math
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from proxy.config.load import Config

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def _create_demo_key(config: Config) -> None:
    """What middlewares/auth.py does at start, done once for all the children."""
    from proxy.ledger import open_ledger
    from proxy.ledger.service import new_demo_key

    section = config.ledger
    if section.backend == "none":
        return
    base = config.path.parent if config.path else None
    ledger = open_ledger(section, base_dir=base)
    await ledger.start()
    try:
        secret = await new_demo_key(ledger, config.balance.demo_balance_micros)
        print(f"demo key: {secret}", file=sys.stdout, flush=True)
    finally:
        await ledger.close()


def _child_config(config: Config, workers: int) -> None:
    """Per-process shares of the in-memory limits (documented above); Redis limits are global."""
    limits = config.limits
    if limits.backend != "redis":
        shares = {name: max(1, math.ceil(value / workers)) for name in ("global_concurrency", "default_key_concurrency")
                  if (value := getattr(limits, name)) is not None}
        config.update("limits", **shares)


def _metrics_dir() -> tuple[str, bool]:
    """The directory the children share their metrics in, and whether it is ours to remove."""
    named = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if named:
        os.makedirs(named, exist_ok=True)
        for stale in glob.glob(os.path.join(named, "*.db")):  # a previous run's figures
            os.remove(stale)
        return named, False
    path = tempfile.mkdtemp(prefix="responses-proxy-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path, True


def _process_dead(pid: int, path: str) -> None:
    try:
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, path)
    except (ImportError, OSError):  # pragma: no cover - a metrics file is never worth a failed shutdown
        pass


def supervise(config: Config, host: str, port: int, workers: int,
              serve_one: Callable[..., int]) -> int:
    from proxy.runtime.listen import bind_sockets, listen_error

    try:  # a port in use or a bad host: one line, before "listening on" and before the demo key and any fork
        for sock in bind_sockets(host, port, reuse_port=True):
            sock.close()
    except OSError as exc:
        print(f"responses-proxy: {listen_error(host, port, exc)}", file=sys.stderr, flush=True)
        return 2
    # The ledger's schema made once, here, before any child opens it: N processes creating a new
    # SQLite file at once race on its schema ("database is locked").
    if config.ledger.backend != "none":
        from proxy.ledger import LedgerError, migrate_ledger

        try:
            asyncio.run(migrate_ledger(config.ledger, config.path.parent if config.path else None))
        except (LedgerError, OSError) as exc:
            print(f"responses-proxy: cannot start: {exc}", file=sys.stderr, flush=True)
            return 2
    if config.auth.enabled and config.auth.demo_key:
        asyncio.run(_create_demo_key(config))
        config.update("auth", demo_key=False)  # the children must not create (and revoke) their own
    from proxy.runtime.local_keys import announce_admin_key

    announce_admin_key(config, host, port)
    _child_config(config, workers)
    metrics_dir, remove_metrics_dir = _metrics_dir()
    try:
        return _run_children(config, host, port, workers, serve_one, metrics_dir)
    finally:
        if remove_metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _await_ready(ready_fd: int, workers: int) -> bool:
    """Whether every child said it is ready (its sockets listening, its app started) before any
    exited: each writes one byte on the pipe. A child that exits first ends the wait (its exit is
    seen, not reaped, so the wait loop below still reports it)."""
    said = 0
    while said < workers:
        readable, _, _ = select.select([ready_fd], [], [], 0.2)
        if readable:
            data = os.read(ready_fd, 64)
            if not data:  # every write end closed: the children are gone
                return False
            said += len(data)
        elif os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return False
    return True


def _run_children(config: Config, host: str, port: int, workers: int, serve_one: Callable[..., int],
                  metrics_dir: str) -> int:
    children: dict[int, int] = {}
    ready_fd, said_fd = os.pipe()
    stopping = False

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = stopping or signum != signal.SIGHUP  # a HUP reloads each child (proxy/runtime/reload.py)
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    for index in range(workers):
        pid = os.fork()
        if pid == 0:  # the child
            for sig in FORWARDED:
                signal.signal(sig, signal.SIG_IGN if sig == signal.SIGHUP else signal.SIG_DFL)  # HUP: see proxy.cli
            os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the parent only; it forwards once
            os.environ["RESPONSES_PROXY_WORKER"] = str(index)
            os.close(ready_fd)
            code = 1

            def ready() -> None:
                try:
                    os.write(said_fd, b"r")
                except OSError:  # the supervisor stopped waiting (another child failed): it stops this one too
                    pass

            try:
                code = serve_one(config, host, port, reuse_port=True, announce=False, on_ready=ready)
            except BaseException as exc:  # report and leave with a code, never return into the parent's code
                if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    print(f"responses-proxy worker {index}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = index
    os.close(said_fd)
    # "listening" means listening: printed once every child accepts, never before (a script that
    # waits for the line may connect at once).
    if _await_ready(ready_fd, workers):
        print(f"responses-proxy listening on http://{host}:{port} ({workers} processes)", flush=True)
    os.close(ready_fd)

    exit_code = 0
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for clarity
            continue
        children.pop(pid, None)
        _process_dead(pid, metrics_dir)
        code = os.waitstatus_to_exitcode(status)
        if not stopping:
            # A child died on its own: stop the rest, report failure.
            print(f"responses-proxy: worker process {pid} exited ({code}); stopping the others",
                  file=sys.stderr, flush=True)
            exit_code = 1
            forward(signal.SIGTERM, None)
            deadline = time.monotonic() + 30
            while children and time.monotonic() < deadline:
                done, _ = os.waitpid(-1, os.WNOHANG)
                if done:
                    children.pop(done, None)
                    _process_dead(done, metrics_dir)
                else:
                    time.sleep(0.05)
            for left in children:
                os.kill(left, signal.SIGKILL)
        elif code not in (0, -signal.SIGTERM, -signal.SIGINT):
            exit_code = exit_code or 1
    return exit_code
