"""`serve --workers 2`: every scrape of /metrics, whichever process answers it, shows the
figures of all the processes (prometheus_client's multiprocess mode)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import aiohttp
import orjson
import pytest

from tests.conftest import eventually, eventually_sync, free_port
from tests.support.paths import REPO

REQUESTS = 24
SCRAPES = 8


def _series(text: str, name: str, **labels: str) -> list[float]:
    values = []
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            values.append(float(line.rsplit(" ", 1)[1]))
    return values


async def _fresh(method: str, url: str, **kwargs):
    """One request on a connection of its own: the kernel picks a process for each."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        async with http.request(method, url, **kwargs) as r:
            return r.status, await r.read()


def _listening_children(parent: int, port: int) -> int:
    """How many child processes of `parent` hold a socket listening on `port` (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    inodes.add(f"socket:[{fields[9]}]")
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        children = f.read().split()
    count = 0
    for child in children:
        try:
            fds = [os.readlink(f"/proc/{child}/fd/{fd}") for fd in os.listdir(f"/proc/{child}/fd")]
        except OSError:
            continue
        count += any(fd in inodes for fd in fds)
    return count


@pytest.fixture
def two_processes(tmp_path):
    port = free_port()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RESPONSES_PROXY_CONFIG", "PROMETHEUS_MULTIPROC_DIR")}
    env.update(PYTHONPATH=str(REPO), TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "2", "--demo-key"], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    key = None
    try:
        for line in proc.stdout:
            if line.startswith("demo key: "):
                key = line.split(": ", 1)[1].strip()
            if "listening on" in line:
                break
        assert key, "no demo key printed"
        # both children listening, so the kernel spreads connections over both
        eventually_sync(lambda: _listening_children(proc.pid, port) == 2, 60, what="both serving processes listening")
        yield f"http://127.0.0.1:{port}", key, tmp
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # pragma: no cover - never leave a server behind
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert list(tmp.iterdir()) == []  # the supervisor's metrics directory is gone


@pytest.mark.slow
async def test_every_scrape_counts_every_process_requests(two_processes):
    url, key, tmp = two_processes
    auth = {"Authorization": f"Bearer {key}"}
    async def models():  # the children bind their sockets after the supervisor's "listening on"
        try:
            status, body = await _fresh("GET", url + "/v1/models", headers=auth)
        except aiohttp.ClientConnectionError:
            return None
        return body if status == 200 else None

    model = orjson.loads(await eventually(models, 60, what="GET /v1/models answered"))["data"][0]["id"]

    body = orjson.dumps({"model": model, "input": "hello", "max_output_tokens": 8})
    results = await asyncio.gather(*(_fresh("POST", url + "/v1/responses", data=body,
                                            headers={**auth, "Content-Type": "application/json"})
                                     for _ in range(REQUESTS)))
    assert [status for status, _ in results] == [200] * REQUESTS

    for _ in range(SCRAPES):
        status, raw = await _fresh("GET", url + "/metrics")
        assert status == 200
        text = raw.decode()
        assert sum(_series(text, "responses_proxy_requests_total", endpoint="responses")) == REQUESTS, text
        assert sum(_series(text, "responses_proxy_request_duration_seconds_count", endpoint="responses")) == REQUESTS
        assert sum(_series(text, "responses_proxy_request_duration_seconds_bucket", endpoint="responses",
                           le="+Inf")) == REQUESTS
        assert sum(_series(text, "responses_proxy_output_tokens_total")) > 0
        # One series per worker (merged over the processes, no pid label), from every process.
        capacity = [ln for ln in text.splitlines() if ln.startswith("responses_proxy_worker_capacity{")]
        assert capacity and not any("pid=" in ln for ln in capacity), text
        assert len(re.findall(r"(?m)^# TYPE responses_proxy_requests_total counter$", text)) == 1
    assert len(list(tmp.iterdir())) == 1  # the shared metrics directory, under TMPDIR


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_the_merged_view_of_one_process_has_the_figures_of_the_plain_one(tmp_path, monkeypatch):
    """The same requests, counted in memory and through the multiprocess files: the same
    series and values (without the _created series multiprocess mode does not keep)."""

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request
    from prometheus_client import generate_latest

    from proxy.config.load import Config
    from proxy.runtime import metrics as proxy_metrics
    from proxy.upstream.workers import WorkerPool, parse_workers
    from tests.runtime.test_metrics import SEQUENCE, observed_context

    def observed(shared_dir):
        app = web.Application()
        app[proxy_metrics.METRICS] = found = proxy_metrics.Metrics(WorkerPool(parse_workers(Config.from_dict({"workers": [
            {"name": "a", "url": "http://a", "models": ["tiny-model", "big"]},
            {"name": "b", "url": "http://b", "models": ["tiny-model"], "capacity": 8}]}).workers)), shared_dir)
        for path, model, status, seconds, outcome in SEQUENCE:
            request = make_mocked_request("POST", path, app=app)
            ctx = observed_context(path, model, outcome)
            proxy_metrics.observe(request, ctx, status, seconds, ctx.report.status if ctx.report is not None else None)
        found.holds.set(3)
        found.publish_pool()
        return _samples(generate_latest(found.registry).decode())

    plain = observed(None)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    merged = observed(proxy_metrics.multiprocess_dir())
    assert [p.name for p in tmp_path.iterdir()]  # the files were written
    assert merged == plain
