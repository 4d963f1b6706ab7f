"""What `serve` takes from outside config.yaml: the command line's and the environment's values
of server.host, server.port and server.workers, checked as the file's keys are.

    host     --host, else $RESPONSES_PROXY_HOST, else server.host
    port     --port, else $RESPONSES_PROXY_PORT, else server.port
    workers  --workers, else server.workers ("auto" or 0: one process per core)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from proxy.config.types import ConfigError

if TYPE_CHECKING:  # for annotations only
    from proxy.config.load import Config


def port(value: object, source: str) -> int:
    """A port number from `source` (an option, a variable or a key: named in the error)."""
    try:
        found = int(str(value).strip())
    except ValueError:
        found = -1
    if not 1 <= found <= 65535:
        raise ConfigError(f"{source} must be a port number from 1 to 65535, not {value!r}")
    return found


def resolve_workers(value: object) -> int:
    """server.workers / --workers: a positive integer, or "auto" (or 0) = one process per core."""
    if value is None:
        return 1
    if (isinstance(value, str) and value.strip().lower() == "auto") or value == 0:
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


def listen(config: Config, host: str | None, port_arg: str | None, workers_arg: object) -> tuple[str, int, int]:
    """(host, port, processes) of `serve`, from its options, the environment and config.server."""
    server = config.server
    host = host or os.environ.get("RESPONSES_PROXY_HOST") or server.host
    if port_arg is not None:
        found = port(port_arg, "--port")
    elif os.environ.get("RESPONSES_PROXY_PORT"):
        found = port(os.environ["RESPONSES_PROXY_PORT"], "RESPONSES_PROXY_PORT")
    else:
        found = port(server.port, "server.port")
    workers = resolve_workers(workers_arg if workers_arg is not None else server.workers)
    if workers > 1:
        _one_simulator_port(config, workers)
        _one_signing_secret(config, workers)
    return host, found, workers


def _one_signing_secret(config: Config, workers: int) -> None:
    """Single sign-on's return lands on any process: one that did not sign its flow refuses it. A
    SQLite ledger's folder holds the secret every process shares (admin-session.key); a PostgreSQL
    ledger's processes each make their own unless admin.session_secret is set."""
    admin = config.admin
    if admin.oidc.issuer and not admin.session_secret and config.ledger.backend != "sqlite":
        raise ConfigError(f"{workers} processes and no admin.session_secret they can share: single sign-on "
                          "(admin.oidc) needs one (set admin.session_secret)")


def _one_simulator_port(config: Config, workers: int) -> None:
    """Every process of --workers N starts its own embedded simulator: one fixed port cannot hold them."""
    embedded = any(w.url == "embedded" for w in config.workers)
    if embedded and config.simulator.port:
        raise ConfigError(f"simulator.port is {config.simulator.port}, but with {workers} processes (serve --workers, "
                          "server.workers) each starts its own embedded simulator and only one can listen there: set "
                          "simulator.port: 0 (any free port) or serve with one process")
