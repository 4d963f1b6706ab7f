"""Shared fixtures: a real simulator and a real proxy, both on 127.0.0.1, real HTTP between.

    async def test_x(sim, make_proxy):
        proxy = await make_proxy(only("stateless"))   # only that built-in policy runs
        client = proxy.openai()          # openai.AsyncOpenAI pointed at the proxy
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

# Raw bytes captured from a real vLLM 0.32 (CPU build); a copy of ../shared/fixtures kept in the
# repository so a clean clone tests the same bytes.
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm-0.32-cpu"


POLICIES = ("stateless", "auth", "limits", "tools", "balance", "notices")


def only(*names: str, **points: list) -> dict[str, Any]:
    """Config overrides: only the built-in policies `names` run (the others get `enabled: false`),
    and custom middlewares at named points, e.g. only("stateless", after_auth=["tests.support.custom_mw:create"])."""
    unknown = set(names) - set(POLICIES)
    assert not unknown, f"not built-in policies: {unknown}"
    out: dict[str, Any] = {name: {"enabled": name in names} for name in POLICIES}
    if points:
        out["middlewares"] = points
    return out


def sim_input(**script) -> str:
    """An input text that scripts the simulator's answer (proxy/simulator/script.py)."""
    return "SIM:" + json.dumps(script)


def sse_events(raw: bytes) -> list[dict]:
    """The events of a Responses stream, parsed; the spec's terminal "data: [DONE]" is no
    event (tests/clients/test_interop.py checks it is there)."""
    return [orjson.loads(line[6:]) for line in raw.split(b"\n")
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


@pytest.fixture
async def http():
    """One aiohttp client session for the test, without a connection limit."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ProxyHandle:
    url: str
    app: web.Application
    runner: web.AppRunner
    api_key: str

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    spec: Any = None  # tests.support.sdk_check.SpecLog of the clients from openai()

    def openai(self, api_key: str | None = None, **kwargs: Any):
        """An openai client whose every Response and event is also judged by the Open Responses
        spec (tests/support/sdk_check.py, SpecCheckingTransport)."""
        import openai

        from tests.support.sdk_check import SpecCheckingTransport, SpecLog

        if self.spec is None:
            self.spec = SpecLog()
        if "http_client" not in kwargs:
            kwargs["http_client"] = openai.DefaultAsyncHttpxClient(transport=SpecCheckingTransport(self.spec))
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key or self.api_key, max_retries=0, **kwargs)

    @property
    def ledger(self):
        from proxy.app import LEDGER

        return self.app[LEDGER]


@pytest.fixture
async def sim():
    from proxy.simulator.server import Simulator

    async with Simulator() as simulator:
        yield simulator


@pytest.fixture
async def make_proxy(sim, tmp_path):
    from proxy import state
    from proxy.app import build_app
    from proxy.http.parse_errors import ProxyRunner
    from proxy.config.load import Config

    runners: list[web.AppRunner] = []
    handles: list[ProxyHandle] = []

    async def start(overrides: dict[str, Any] | None = None, *, workers: list[dict] | None = None) -> ProxyHandle:
        base: dict[str, Any] = {
            "workers": workers or [{"name": "sim", "url": sim.url, "dialect": "vllm", "models": ["tiny-org/tiny-model"],
                                    "timeouts": {"connect": 2, "first_byte": 10, "idle": 10, "total": 60}}],
            "ledger": {"path": str(tmp_path / "ledger.db")},
            "server": {"log_format": "json"},
        }
        config = Config.from_dict(base)
        if overrides:
            config = Config.from_dict({**base, **overrides})
        app = build_app(config)
        runner = ProxyRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        runners.append(runner)
        handle = ProxyHandle(url=f"http://127.0.0.1:{port}", app=app, runner=runner,
                             api_key=app.get(state.DEMO_KEY) or "no-auth")
        handles.append(handle)
        return handle

    yield start
    for runner in reversed(runners):
        await runner.cleanup()
    failures = [f for h in handles if h.spec is not None for f in h.spec.failures]
    assert not failures, f"answers outside the Open Responses spec: {failures[:3]}"



# --------------------------------------------------------------------------- waiting


async def eventually(probe, timeout: float = 10.0, *, what: str = "the condition", step: float = 0.02):
    """Wait for `probe()` (a plain or an async callable) to be truthy; its value. The one way a
    test waits for something to happen: polled every `step`, bounded by `timeout` only so that
    a failing test fails instead of hanging (a bound a busy machine never reaches: never a
    fixed sleep standing for "long enough"). AssertionError with the last value past it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s (last: {value!r})")
        await asyncio.sleep(step)


def unchanged_for(read, seconds: float):
    """A probe for `eventually`: true once `read()` has kept one value for `seconds` (a stall,
    which only time without progress shows: what a test of backpressure waits for)."""
    last: list = [object(), 0.0]

    def probe() -> bool:
        value, now = read(), time.monotonic()
        if value != last[0]:
            last[:] = [value, now]
        return now - last[1] >= seconds
    return probe


def eventually_sync(probe, timeout: float = 10.0, *, what: str = "the condition", step: float = 0.02):
    """`eventually` for code without an event loop (a test that drives a process from a plain
    function): `probe()` polled every `step` until truthy; its value, or AssertionError past
    `timeout` with the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s (last: {value!r})")
        time.sleep(step)

# --------------------------------------------------------------------------- a full file system

@contextmanager
def tiny_tmpfs(folder: Path) -> Iterator[Path]:
    """`folder` made a 64 KiB tmpfs for the test (root only: skipped, with the reason, elsewhere)."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path) -> Path:
    """Fill the file system of `folder` (ENOSPC from then on); the filler file, to remove for room."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


# --------------------------------------------------------------------------- Redis

@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One throwaway redis-server for the session (tests/support/redis_server.py). A missing
    redis-server fails the tests that use it: CI installs it."""
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_db(redis_server):
    """The session's Redis, running (a test may have stopped it) and empty."""
    if redis_server.proc is None:
        redis_server.start()
    redis_server.flush()
    return redis_server


@pytest.fixture(params=["memory", "redis"])
def limits_backend(request) -> dict[str, Any]:
    """`limits` settings of either backend (the Redis one on the session's server, emptied)."""
    if request.param == "memory":
        return {"backend": "memory"}
    server = request.getfixturevalue("redis_db")
    return {"backend": "redis", "redis": {"url": server.url, "socket_timeout_ms": 500}}

# ----------------------------------------------------------------------------- PostgreSQL

@pytest.fixture(scope="session")
def pg_server():
    """One throwaway PostgreSQL cluster for the session (tests/support/pg_server.py). Missing
    binaries FAIL the tests that need it (CI installs them): PgUnavailable is an error."""
    from tests.support.pg_server import PgServer

    server = PgServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def pg_dsn(pg_server):
    """A fresh, empty database for this test (the ledger migrates it on start); dropped after."""
    if pg_server.proc is None:  # a test stopped it and failed before starting it again
        pg_server.start()
    name, dsn = pg_server.create_database()
    try:
        yield dsn
    finally:
        if pg_server.proc is None:
            pg_server.start()
        pg_server.drop_database(name)


LEDGER_BACKENDS = ("sqlite", "postgres")


def ledger_section(backend: str, request: Any, tmp_path: Path) -> dict[str, Any]:
    """The ledger config section of `backend` for a test (postgres: a fresh database)."""
    if backend == "sqlite":
        return {"backend": "sqlite", "path": str(tmp_path / "ledger.db")}
    return {"backend": "postgres", "dsn": request.getfixturevalue("pg_dsn"),
            "spool_path": str(tmp_path / "ledger-spool.jsonl")}


@pytest.fixture(params=LEDGER_BACKENDS)
async def any_ledger(request, tmp_path):
    """A started ledger of each backend: ONE suite, two backends. A test about one backend
    only narrows it: @pytest.mark.parametrize("any_ledger", ["sqlite"], indirect=True)."""
    from proxy.ledger import open_ledger

    led = open_ledger(ledger_section(request.param, request, tmp_path), base_dir=tmp_path)
    await led.start()
    try:
        yield led
    finally:
        await led.close()
