"""A throwaway PostgreSQL cluster for the tests: initdb into a temp dir, one server on
127.0.0.1 and a free port, trust auth for loopback, stopped at the end.

    server = PgServer()          # raises PgUnavailable (a test failure, never a skip) without binaries
    server.start()
    server.dsn                   # postgresql://postgres@127.0.0.1:PORT/postgres
    server.create_database("t1") # -> its dsn
    server.stop(); server.start()   # same port, same data dir (the scale-out tests' outage)
    PgServer(settings={"max_connections": "12"})   # server settings over the defaults below
    server.close()               # stop and delete the data dir

Binaries: $PG_BIN, else the newest /usr/lib/postgresql/*/bin (Debian's `postgresql` package,
which make test-deps installs), else `initdb` on $PATH. PostgreSQL refuses to run as root, so as
root the server runs as the `postgres` user the Debian package creates, else `nobody`
(the data dir is chowned to it; `subprocess`'s user=/group= switch before exec).

Durability is off (fsync, synchronous_commit, full_page_writes): the cluster lives as long
as the test session and a power cut loses nothing anyone needs; a fast shutdown (stop())
still checkpoints everything, so stop()/start() keeps every committed row.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class PgUnavailable(RuntimeError):
    """No PostgreSQL server binaries (install Debian's `postgresql`, or set PG_BIN)."""


def find_bin_dir() -> Path:
    env = os.environ.get("PG_BIN")
    candidates = [env] if env else []

    def version(path: str) -> tuple:
        try:
            return tuple(int(p) for p in Path(path).parent.name.split("."))
        except ValueError:
            return (0,)

    candidates += [str(Path(p).parent) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                                                       key=lambda p: version(str(Path(p).parent)), reverse=True)]
    which = shutil.which("initdb")
    if which:
        candidates.append(str(Path(which).parent))
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists() and (Path(candidate) / "postgres").exists():
            return Path(candidate)
    raise PgUnavailable("PostgreSQL server binaries not found (apt-get install postgresql, or set PG_BIN); "
                        "the postgres ledger tests need a real server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as() -> tuple[int, int] | None:
    """(uid, gid) to run the server as; None when not root (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return entry.pw_uid, entry.pw_gid
    raise PgUnavailable("running as root and neither a `postgres` nor a `nobody` user exists")


class PgServer:
    def __init__(self, *, base_dir: str | None = None, settings: dict[str, str] | None = None) -> None:
        self.bin = find_bin_dir()
        self.settings = dict(settings or {})  # `-c name=value` after the defaults (the last one wins)
        self.user = _run_as()
        self.root = Path(tempfile.mkdtemp(prefix="rp-pg-", dir=base_dir))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._serial = 0
        if self.user is not None:
            os.chmod(self.root, 0o755)
            os.chown(self.root, *self.user)
        self._initdb()

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _popen_kwargs(self) -> dict:
        if self.user is None:
            return {}
        return {"user": self.user[0], "group": self.user[1], "extra_groups": []}

    def _initdb(self) -> None:
        proc = subprocess.run(
            [str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
             "--encoding=UTF8", "--locale=C", "--no-sync"],
            capture_output=True, text=True, timeout=120, cwd=str(self.root), **self._popen_kwargs())
        if proc.returncode != 0:
            raise PgUnavailable(f"initdb failed ({proc.returncode}): {proc.stderr[-2000:]}")
        with open(self.data / "pg_hba.conf", "w") as hba:  # loopback only, trusted
            hba.write("host all all 127.0.0.1/32 trust\n")

    def start(self, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        log = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
                 "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
                 "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                 "-c", "max_connections=200", "-c", "shared_buffers=32MB",
                 *(arg for name, value in self.settings.items() for arg in ("-c", f"{name}={value}"))],
                stdout=log, stderr=subprocess.STDOUT, cwd=str(self.root), start_new_session=True,
                **self._popen_kwargs())
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PgUnavailable(f"postgres exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            if self._accepts():
                return
            time.sleep(0.05)
        raise PgUnavailable(f"postgres did not accept connections in {timeout}s: {self.log.read_text()[-2000:]}")

    def _accepts(self) -> bool:
        proc = subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"],
                              capture_output=True, timeout=10)
        return proc.returncode == 0

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (SIGINT): clients are disconnected, everything committed is kept."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # our own child, by its pid
            proc.wait(10)

    def _cluster_pids(self) -> list[int]:
        """The postmaster and its children (each backend is its own session: PostgreSQL calls
        setsid in every child, so the postmaster's process group does not reach them)."""
        pids = [self.proc.pid]
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                with open(stat) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:  # ppid
                pids.append(int(stat.split("/")[2]))
        return pids

    def freeze(self) -> None:
        """SIGSTOP the whole cluster: a server that holds its connections open and answers
        nothing, as across a partitioned network."""
        for pid in self._cluster_pids():
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self._cluster_pids():
            os.kill(pid, signal.SIGCONT)

    def psql(self, sql: str, database: str = "postgres") -> str:
        proc = subprocess.run(
            [str(self.bin / "psql") if (self.bin / "psql").exists() else "psql",
             "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", database,
             "-v", "ON_ERROR_STOP=1", "-qAtc", sql],
            capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"psql failed: {proc.stderr.strip()}")
        return proc.stdout

    def create_database(self, prefix: str = "t") -> tuple[str, str]:
        """A fresh, empty database: (its name, its dsn)."""
        self._serial += 1
        name = f"{prefix}_{os.getpid()}_{self._serial}"
        self.psql(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return name, self.dsn_for(name)

    def drop_database(self, name: str) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "PgServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
