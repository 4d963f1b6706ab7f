"""The servers behind the proxy's shared backends, for `python -m bench`'s backend rows: a
throwaway PostgreSQL (tests/support/pg_server.py: initdb into a temp dir, loopback, fsync off) for
`ledger.backend: postgres` and a redis-server (tests/support/redis_server.py: no persistence) for
`limits.backend: redis`, each pinned to a core once started, with its CPU time.

The CPU of a server is what the proxy's requests cost outside the proxy: for PostgreSQL the
postmaster and every backend and auxiliary process (its live children's CPU clocks, plus the
children it has reaped, from /proc/<pid>/stat's cutime and cstime), for redis-server its one
process (every thread).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # fields from the 3rd (state) on


def _clock(pid: int) -> float:
    """A live process's CPU seconds, every thread, to the ns (the kernel's per-process CPU clock)."""
    try:
        return time.clock_gettime((~pid << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        fields = _stat(pid)
        return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process, its live children and the children it has already reaped.

    A child alive at one reading and reaped by the next moves from the live sum to the parent's
    cutime/cstime whole, so the difference of two readings counts it once.
    """
    fields = _stat(pid)
    total = _clock(pid) + (int(fields[13]) + int(fields[14])) / TICK  # cutime, cstime
    for child in _children(pid):
        try:
            total += _clock(child)
        except (OSError, IndexError):  # exited between the listing and the read: in cutime next time
            pass
    return total


def pin(pid: int, cores: set[int], *, tree: bool = False) -> None:
    """Every thread of the process (and, with tree, of its children) on these cores; processes it
    forks later inherit it."""
    pids = [pid] + (_children(pid) if tree else [])
    for p in pids:
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass


class Backing:
    """The PostgreSQL and redis-server the backend rows run against; `with Backing(cores): ...`."""

    def __init__(self, cores: set[int]) -> None:
        self.cores = cores
        self.tmp = Path(tempfile.mkdtemp(prefix="rp-bench-backing-"))
        self.pg = None
        self.redis = None

    def __enter__(self) -> "Backing":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.support.pg_server import PgServer
        from tests.support.redis_server import RedisServer

        try:
            self.pg = PgServer()  # its own temp dir (one the postgres user can enter)
            self.pg.start()
            pin(self.pg.proc.pid, self.cores, tree=True)
            self.redis = RedisServer(self.tmp / "redis")
            self.redis.start()
            pin(self.redis.proc.pid, self.cores)
        except BaseException:
            self.__exit__()
            raise
        return self

    def pg_database(self, prefix: str) -> str:
        """A fresh database: its dsn."""
        return self.pg.create_database(prefix)[1]

    def pg_cpu(self) -> float:
        return tree_cpu(self.pg.proc.pid)

    def redis_cpu(self) -> float:
        return _clock(self.redis.proc.pid)

    def __exit__(self, *exc: object) -> None:
        if self.redis is not None:
            self.redis.stop()
        if self.pg is not None:
            self.pg.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
