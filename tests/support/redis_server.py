"""A throwaway redis-server for the tests: its own port, no persistence, a temporary directory.

    server = RedisServer(tmp_dir); server.start()
    server.url              # redis://127.0.0.1:<port>/0
    server.stop(); server.start()   # the same port again (scale-out tests: Redis goes away and comes back)

A missing redis-server is a failure, never a skip (CI installs Debian's package).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, directory: Path, port: int | None = None) -> None:
        if not Path(REDIS_SERVER).exists():
            raise RuntimeError("redis-server is not installed (apt-get install redis-server): the Redis tests need it")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} (port {self.port})")
            if self.ping():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def command(self, *args: str) -> bytes:
        """One command in RESP, its raw reply (enough for FLUSHALL, DBSIZE...)."""
        payload = f"*{len(args)}\r\n".encode() + b"".join(
            f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(payload)
            return s.recv(65536)

    def flush(self) -> None:
        assert self.command("FLUSHALL").startswith(b"+OK")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        deadline = time.monotonic() + 5
        while self.ping() and time.monotonic() < deadline:  # pragma: no cover - the port is free before we return
            time.sleep(0.02)
