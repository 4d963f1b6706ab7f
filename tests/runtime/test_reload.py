"""Reload (proxy/runtime/reload.py) as an operator does it: a real `responses-proxy serve` (and
`serve --workers 2`) with its embedded simulator and a SQLite ledger, config.yaml rewritten,
SIGHUP sent (what `systemctl reload` sends) or POST /admin/api/reload called.

  * 50 streams in flight when the HUP lands all finish whole; the reload adds a worker and
    changes a price: requests after it bill the new price, the ones before the old;
  * a bad file changes nothing (the price billed stays), one log line names the key;
  * a change that needs a restart (the listen port) is refused naming it (409), the admin API
    reloads for an admin and not for a viewer (403);
  * under --workers 2 both processes reload (each says its hash).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.conftest import eventually, free_port
from tests.support.paths import REPO

pytestmark = [pytest.mark.timeout(180)]

ADMIN = "adm-reload-test-0123456789abcdef"
VIEWER = "adm-reload-viewer-0123456789abcdef"
MODEL = "tiny-org/tiny-model"
SLOW = {"text": " ".join(["tok"] * 20), "delay": 0.1}  # 20 deltas, 2 s


def _config(tmp: Path, price_input: int, *, workers: int = 1, extra: dict | None = None) -> dict:
    return {
        "server": {"log_format": "json", "log_level": "info"},
        "workers": [{"name": f"sim{i}", "url": "embedded", "models": [MODEL]} for i in range(workers)],
        "ledger": {"path": str(tmp / "ledger.db")},
        "prices": {"default": {"input": price_input, "output": 1_500_000}},
        "admin": {"keys": [{"name": "ops", "key": ADMIN}, {"name": "finance", "key": VIEWER, "role": "viewer"}],
                  "session_secret": "s" * 32},
        "balance": {"lease_max_micros": 0},  # every request its own hold and settle: the bill is read at once
        **(extra or {}),
    }


class Served:
    """A `responses-proxy serve` process on a config file it can be told to read again."""

    def __init__(self, tmp: Path, config: dict, workers: int = 1) -> None:
        self.tmp, self.config, self.workers = tmp, config, workers
        self.path = tmp / "config.yaml"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "serve.log"
        self.proc: subprocess.Popen | None = None
        self.secret = ""

    def write(self, config: dict | str) -> None:
        self.path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))

    async def start(self) -> None:
        self.write(self.config)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        made = subprocess.run([sys.executable, "-m", "proxy", "keys", "--config", str(self.path), "create", "client",
                               "--balance-usd", "1000", "--json"], capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=60)
        assert made.returncode == 0, made.stderr
        self.secret = json.loads(made.stdout)["secret"]
        argv = [sys.executable, "-m", "proxy", "serve", "--config", str(self.path), "--port", str(self.port)]
        if self.workers > 1:
            argv += ["--workers", str(self.workers)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log)

        async def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                async with aiohttp.ClientSession() as http, http.get(self.url + "/readyz") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        await eventually(up, 60, what="serve answering")
        # every process accepts once "listening" is said (the supervisor waits for each)
        await eventually(lambda: "listening on" in self.log.read_text(errors="replace"), 60, what="listening")

    def hup(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def log_lines(self, event: str) -> list[dict]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"{event}"' in line:
                out.append(json.loads(line))
        return out

    async def served(self, http: aiohttp.ClientSession, key: str = ADMIN) -> dict:
        # a new connection each time: under --workers N the kernel spreads them over the processes
        async with http.get(self.url + "/admin/api/config", headers={"Authorization": f"Bearer {key}",
                                                                      "Connection": "close"}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


async def _ask(http: aiohttp.ClientSession, served: Served, stream: bool) -> tuple[str, bytes]:
    body = {"model": MODEL, "stream": stream, "max_output_tokens": 40, "input": "SIM:" + json.dumps(SLOW if stream
                                                                                                 else {"text": "hi"})}
    async with http.post(served.url + "/v1/responses", json=body,
                         headers={"Authorization": f"Bearer {served.secret}"}) as r:
        raw = await r.read()
        assert r.status == 200, raw[:500]
        return r.headers["x-request-id"], raw


async def _cost(http: aiohttp.ClientSession, served: Served, request_id: str) -> int:
    async with http.get(served.url + "/admin/api/usage?limit=1000", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        rows = (await r.json())["data"]
    (row,) = [row for row in rows if row["request_id"] == request_id]
    return row["cost_micros"]


@pytest.fixture
async def served(tmp_path):
    s = Served(tmp_path, _config(tmp_path, 500_000))
    await s.start()
    try:
        yield s
    finally:
        s.stop()


async def test_a_hup_under_50_streams_adds_a_worker_and_a_price_and_every_stream_finishes(served):
    async with aiohttp.ClientSession() as http:
        before_id, _ = await _ask(http, served, stream=False)
        first = (await served.served(http))["hash"]
        streams = [asyncio.create_task(_ask(http, served, stream=True)) for _ in range(50)]
        await asyncio.sleep(0.5)  # not a wait for an event: the streams are under way when the HUP lands
        served.write(_config(served.tmp, 5_000_000, workers=2))  # a second worker, ten times the input price
        served.hup()

        async def reloaded() -> bool:
            return (await served.served(http))["hash"] != first

        await eventually(reloaded, 30, what="the reload")
        assert not all(task.done() for task in streams)  # the HUP landed while streams were in flight
        finished = await asyncio.gather(*streams)
        for _, raw in finished:  # every stream whole: its last event the completion
            events = [line for line in raw.decode().splitlines() if line.startswith("event: ")]
            assert events[-1] == "event: response.completed", events[-3:]
        after_id, _ = await _ask(http, served, stream=False)
        old, new = await _cost(http, served, before_id), await _cost(http, served, after_id)
        assert new > 5 * old > 0, (old, new)  # the same request, billed at the new input price
        async with http.get(served.url + "/admin/api/overview", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            workers = [w["name"] for w in (await r.json())["workers"]]
        assert workers == ["sim0", "sim1"]
        view = await served.served(http)
        assert view["reloads"] == {"ok": 1, "refused": 0} and "prices" in view["live_sections"]

        # A bad file: nothing changes, one line says which key.
        served.path.write_text(served.path.read_text().replace("output: 1500000", "outptu: 1500000"))
        served.hup()

        async def refused() -> bool:
            return (await served.served(http))["reloads"]["refused"] == 1

        await eventually(refused, 30, what="the bad file refused")
        lines = served.log_lines("configuration reload refused")
        assert len(lines) == 1 and "outptu" in lines[0]["reason"]
        assert (await served.served(http))["hash"] == view["hash"]
        again_id, _ = await _ask(http, served, stream=False)
        assert await _cost(http, served, again_id) == new  # still the reloaded price


async def test_the_admin_api_reloads_for_an_admin_and_names_what_needs_a_restart(served):
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with http.post(served.url + "/admin/api/reload", headers={"Authorization": f"Bearer {VIEWER}"}) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "insufficient_role"
        served.write(_config(served.tmp, 700_000, extra={"limits": {"global_concurrency": 7}}))
        async with http.post(served.url + "/admin/api/reload", headers=headers) as r:
            view = await r.json()
            assert r.status == 200 and view["reloads"]["ok"] == 1, view
        async with http.get(served.url + "/readyz") as r:
            assert r.headers["X-Config-Hash"] == view["hash"]
        served.write(_config(served.tmp, 700_000, extra={"server": {"log_format": "json", "log_level": "info",
                                                                    "port": 9}}))
        async with http.post(served.url + "/admin/api/reload", headers=headers) as r:
            body = await r.json()
            assert r.status == 409 and body["error"]["code"] == "restart_required", body
            assert body["error"]["param"] == "server.port" and "restart" in body["error"]["message"]
        served.write("prices: {default: {input: -1}}\n")
        async with http.post(served.url + "/admin/api/reload", headers=headers) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["code"] == "invalid_config", body
        assert (await served.served(http))["hash"] == view["hash"]


async def test_every_process_of_serve_workers_2_reloads_on_a_hup(tmp_path):
    s = Served(tmp_path, _config(tmp_path, 500_000), workers=2)
    await s.start()
    try:
        async with aiohttp.ClientSession() as http:
            first = (await s.served(http))["hash"]
            s.write(_config(tmp_path, 900_000))
            s.hup()  # the supervisor's pid: it forwards the HUP to each process
            seen: dict[int, str] = {}

            async def both() -> bool:
                view = await s.served(http)
                seen[view["pid"]] = view["hash"]
                return len(seen) == 2 and first not in seen.values()

            await eventually(both, 60, what="both processes serving the new configuration")
            assert s.proc is not None and s.proc.poll() is None  # a HUP stops nothing
    finally:
        s.stop()
