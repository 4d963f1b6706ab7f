"""`limits.backend: redis`: separate proxy processes on one Redis share the global and per-key
limits. Real processes (`python -m proxy serve`), a real redis-server (tests/support/redis_server.py),
the real simulator as the upstream, whose peak in-flight count is what the limits must bound.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from proxy.config.load import Config
from proxy.ledger import KeyLimits
from proxy.runtime.supervisor import _child_config
from tests.conftest import free_port, sim_input
from tests.conftest import eventually as until
from tests.support.paths import REPO

MODEL = "tiny-org/tiny-model"
TTL = 1.5  # slot_ttl_s of the processes here


class ProxyProcess:
    def __init__(self, tmp: Path, name: str, config: dict[str, Any], workers: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {k: v for k, v in os.environ.items() if k not in ("RESPONSES_PROXY_CONFIG", "PROMETHEUS_MULTIPROC_DIR")}
        env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.log = open(tmp / f"{name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--config", str(path),
                                      "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(workers)],
                                     cwd=str(tmp), env=env, stdout=self.log, stderr=subprocess.STDOUT)

    async def ready(self, http: aiohttp.ClientSession) -> None:
        async def up() -> bool:
            assert self.proc.poll() is None, f"proxy exited: {Path(self.log.name).read_text()[-2000:]}"
            try:
                async with http.get(self.url + "/livez") as r:
                    return r.status < 500
            except aiohttp.ClientError:
                return False

        await until(up, 30, what="the proxy started")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _config(tmp: Path, sim_url: str, redis_url: str, limits: dict | None = None, **redis: Any) -> dict[str, Any]:
    return {
        "workers": [{"name": "sim", "url": sim_url, "dialect": "vllm", "models": [MODEL],
                     "timeouts": {"connect": 2, "first_byte": 10, "idle": 10, "total": 60}}],
        "ledger": {"path": str(tmp / "ledger.db")},
        "health": {"enabled": False},
        "server": {"log_format": "json", "log_level": "warning"},
        "limits": {"backend": "redis", "global_concurrency": 4,
                   "redis": {"url": redis_url, "slot_ttl_s": TTL, "socket_timeout_ms": 200, **redis},
                   **(limits or {})},
    }


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session


@pytest.fixture
async def stack(tmp_path, redis_db, http):
    """A simulator, a ledger and a launcher of proxy processes on the one Redis."""
    from proxy.ledger import open_ledger
    from proxy.simulator.server import Simulator

    started: list[ProxyProcess] = []
    async with Simulator() as sim, open_ledger({"path": str(tmp_path / "ledger.db")}) as ledger:
        async def launch(name: str, workers: int = 1, limits: dict | None = None, **redis: Any) -> ProxyProcess:
            proc = ProxyProcess(tmp_path, name, _config(tmp_path, sim.url, redis_db.url, limits, **redis), workers)
            started.append(proc)
            await proc.ready(http)
            return proc

        yield sim, ledger, launch
        for proc in started:
            proc.stop()


async def post(http, proxy: ProxyProcess, key: str, body: dict | None = None):
    """-> (status, headers, JSON body or raw stream bytes)"""
    body = body or {"model": MODEL, "input": "hello", "max_output_tokens": 16}
    async with http.post(proxy.url + "/v1/responses", data=orjson.dumps(body),
                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as r:
        raw = await r.read()
        return r.status, r.headers, (raw if r.content_type == "text/event-stream" else orjson.loads(raw))


def slow(seconds: float = 1.5, words: int = 30) -> dict:
    return {"model": MODEL, "stream": True, "max_output_tokens": 1000,
            "input": sim_input(text=" ".join(["word"] * words), delay=seconds / words)}


async def open_stream(http, proxy: ProxyProcess, key: str, body: dict) -> aiohttp.ClientResponse:
    resp = await http.post(proxy.url + "/v1/responses", data=orjson.dumps(body),
                           headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()
    await resp.content.readline()
    return resp


def codes(results) -> list:
    return sorted(((status, None) if status == 200 else (status, body["error"]["code"]) for status, _, body in results),
                  key=lambda pair: (pair[0], pair[1] or ""))


async def test_global_concurrency_is_never_exceeded_across_two_processes(stack, http):
    sim, ledger, launch = stack
    a, b = await launch("a"), await launch("b")
    key, _ = await ledger.create_key("busy", balance_micros=100_000_000)
    sim.reset_peak()
    results = await asyncio.gather(*(post(http, a if i % 2 else b, key, slow()) for i in range(12)))
    assert codes(results) == [(200, None)] * 4 + [(429, "concurrency_limit")] * 8
    assert sim.peak_in_flight == 4  # global_concurrency: 4 over both processes (memory would let 8 through)
    assert all(r[1]["Retry-After"] == "1" for r in results if r[0] == 429)
    assert (await post(http, a, key))[0] == 200  # every slot was given back


async def test_per_key_concurrency_and_rate_are_shared(stack, http):
    sim, ledger, launch = stack
    a, b = await launch("a"), await launch("b")
    two, _ = await ledger.create_key("two", balance_micros=100_000_000, limits=KeyLimits(concurrency=2))
    sim.reset_peak()
    results = await asyncio.gather(*(post(http, a if i % 2 else b, two, slow()) for i in range(6)))
    assert codes(results) == [(200, None)] * 2 + [(429, "concurrency_limit")] * 4
    assert sim.peak_in_flight == 2

    three, _ = await ledger.create_key("three-a-minute", balance_micros=100_000_000, limits=KeyLimits(rate_per_min=3))
    statuses = [(await post(http, proxy, three))[:2] for proxy in (a, b, a, b, a)]
    assert [s for s, _ in statuses] == [200, 200, 200, 429, 429]
    assert 1 <= int(statuses[3][1]["Retry-After"]) <= 20  # about 60 s / 3 for the next token


async def test_tokens_per_minute_are_shared(stack, http):
    sim, ledger, launch = stack
    a, b = await launch("a"), await launch("b")
    key, _ = await ledger.create_key("tpm", balance_micros=100_000_000, limits=KeyLimits(tokens_per_min=12))
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 40}
    status, _, first = await post(http, a, key, body)
    assert status == 200 and first["usage"]["input_tokens"] + first["usage"]["output_tokens"] >= 24
    status, headers, second = await post(http, b, key, body)  # the other process sees the debit
    assert status == 429 and second["error"]["code"] == "tokens_per_min_exceeded"
    assert int(headers["Retry-After"]) >= 1


async def test_slots_are_renewed_while_a_request_runs_and_expire_when_its_process_dies(stack, http):
    sim, ledger, launch = stack
    a, c = await launch("a"), await launch("c")
    key, _ = await ledger.create_key("one", balance_micros=100_000_000, limits=KeyLimits(concurrency=1))
    long = await open_stream(http, a, key, slow(seconds=TTL * 2.5, words=40))
    await asyncio.sleep(TTL * 1.5)  # not a wait: past the slot's first expiry, only the heartbeat keeps it
    assert (await post(http, c, key))[0] == 429
    await long.read()
    long.release()
    await until(lambda: _status_is(http, c, key, 200), timeout=5)

    await open_stream(http, c, key, slow(seconds=30, words=60))
    c.proc.send_signal(signal.SIGKILL)  # no release, no more renewals
    killed = time.monotonic()
    c.proc.wait(10)
    status, _, body = await post(http, a, key)
    assert status == 429 and body["error"]["code"] == "concurrency_limit"
    await until(lambda: _status_is(http, a, key, 200), timeout=TTL + 5)
    assert time.monotonic() - killed <= TTL + 2  # freed by the slot's TTL (plus the last renewal's head start)


async def _status_is(http, proxy, key, wanted: int) -> bool:
    return (await post(http, proxy, key))[0] == wanted


async def test_redis_down_closed_refuses_open_admits_and_both_recover(stack, http, redis_db):
    sim, ledger, launch = stack
    closed, opened = await launch("closed", on_error="closed", retry_after_s=2), await launch("open")
    key, _ = await ledger.create_key("k", balance_micros=100_000_000, limits=KeyLimits(concurrency=1))
    assert (await post(http, closed, key))[0] == 200
    redis_db.stop()
    for _ in range(3):
        status, headers, body = await post(http, closed, key)
        assert status == 503 and headers["Retry-After"] == "2"
        assert body["error"]["code"] == "limits_unavailable" and body["error"]["type"] == "service_unavailable"
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert (await post(http, opened, key))[0] == 200
    async with http.get(closed.url + "/metrics") as r:
        assert 'responses_proxy_limits_redis_events_total{event="error"}' in await r.text()
    held = await open_stream(http, opened, key, slow(seconds=1, words=10))
    assert (await post(http, opened, key))[0] == 429  # open: this process still counts on its own
    await held.read()
    held.release()

    redis_db.start()  # the same port; no proxy restarts
    await until(lambda: _status_is(http, closed, key, 200), timeout=5)
    await until(lambda: _status_is(http, opened, key, 200), timeout=5)
    stream = await open_stream(http, closed, key, slow(seconds=2, words=20))
    status, _, body = await post(http, opened, key)  # the slot the other process took, in Redis again
    assert status == 429 and body["error"]["code"] == "concurrency_limit"
    await stream.read()
    stream.release()


async def test_a_frozen_redis_is_a_bounded_wait_not_a_hang(stack, http, redis_db):
    """A Redis that holds the connection open and answers nothing (SIGSTOP; a partitioned
    network looks the same): socket_timeout_ms bounds every admission (503 when closed,
    admitted when open), and once it answers again the limits are shared again."""
    sim, ledger, launch = stack
    closed, opened = await launch("closed", on_error="closed"), await launch("open")
    key, _ = await ledger.create_key("k", balance_micros=100_000_000, limits=KeyLimits(concurrency=1))
    assert (await post(http, closed, key))[0] == 200
    os.kill(redis_db.proc.pid, signal.SIGSTOP)
    try:
        for proxy, want in ((closed, 503), (opened, 200), (closed, 503)):
            t0 = time.monotonic()
            status, _, _ = await asyncio.wait_for(post(http, proxy, key), 10)
            assert status == want
            assert time.monotonic() - t0 < 2.0  # socket_timeout_ms (200), not the client's patience
    finally:
        os.kill(redis_db.proc.pid, signal.SIGCONT)
    await until(lambda: _status_is(http, closed, key, 200), timeout=5)


async def test_a_frozen_redis_leaves_no_phantom_slots_once_it_resumes(stack, http, redis_db):
    """Requests admitted on the process's own counts while Redis is frozen (their ADMITs still
    run when it resumes) and streams that end meanwhile (their releases cannot be sent): within
    2 s of SIGCONT the global ZSET holds no slot (nothing is in flight) and the whole global
    limit admits again, though slot_ttl_s is 30 (the phantoms would have held it that long)."""
    sim, ledger, launch = stack
    proxy = await launch("p", slot_ttl_s=30)
    key, _ = await ledger.create_key("k", balance_micros=100_000_000)
    streams = [await open_stream(http, proxy, key, slow(seconds=1, words=10)) for _ in range(2)]
    os.kill(redis_db.proc.pid, signal.SIGSTOP)
    try:
        results = await asyncio.gather(*(post(http, proxy, key) for _ in range(3)))
        assert [status for status, _, _ in results] == [200] * 3  # on_error: open
        for stream in streams:  # they end while Redis is frozen
            await stream.read()
            stream.release()
    finally:
        os.kill(redis_db.proc.pid, signal.SIGCONT)

    async def no_slot() -> bool:
        return redis_db.command("ZCARD", "responses-proxy:limits:conc:global") == b":0\r\n"

    await until(no_slot, timeout=2)
    sim.reset_peak()
    results = await asyncio.gather(*(post(http, proxy, key, slow()) for _ in range(5)))
    assert codes(results) == [(200, None)] * 4 + [(429, "concurrency_limit")]
    assert sim.peak_in_flight == 4


async def test_two_workers_with_redis_do_not_divide_the_global_limit(stack, http):
    sim, ledger, launch = stack
    both = await launch("both", workers=2, limits={"global_concurrency": 3})
    key, _ = await ledger.create_key("w", balance_micros=100_000_000)
    sim.reset_peak()

    async def fresh(body):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as own:
            return await post(own, both, key, body)

    await until(lambda: _status_is(http, both, key, 200))
    results = await asyncio.gather(*(fresh(slow()) for _ in range(10)))
    # 3 over both children; divided, each would admit ceil(3 / 2) = 2 (4 when both get requests)
    assert codes(results) == [(200, None)] * 3 + [(429, "concurrency_limit")] * 7
    assert sim.peak_in_flight == 3


def test_supervisor_divides_memory_limits_only():
    for backend, expected in (("memory", 2), ("redis", 3)):
        config = Config.from_dict({"limits": {"backend": backend, "global_concurrency": 3,
                                              "default_key_concurrency": 3}})
        _child_config(config, 2)
        limits = config.get("limits")
        assert (limits["global_concurrency"], limits["default_key_concurrency"]) == (expected, expected)


def test_the_redis_settings_are_checked_at_start():
    from proxy.config.load import ConfigError

    for bad in ({"backend": "memcached"}, {"redis": {"on_error": "maybe"}}, {"redis": {"urll": "redis://x"}},
                {"redis": {"slot_ttl_s": 0}}):
        with pytest.raises(ConfigError):
            Config.from_dict({"limits": bad})
