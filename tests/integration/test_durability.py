"""Crash safety of billing: the proxy as a real process, SIGKILLed mid-stream, restarted on
the same SQLite database. Settled requests stay recorded, the crashed requests' holds
expire (available == balance again), and nothing is charged twice."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sqlite3
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml
from tests.conftest import eventually
from tests.support.paths import REPO as ROOT

PYTHON = ROOT / ".venv" / "bin" / "python"
if not PYTHON.exists():
    PYTHON = Path(sys.executable)

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProxyProcess:
    def __init__(self, config: Path, log: Path) -> None:
        self.config, self.log = config, log
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | None = None
        self.demo_key = ""

    async def start(self) -> "ProxyProcess":
        self._log_file = open(self.log, "ab")
        self.proc = await asyncio.create_subprocess_exec(
            str(PYTHON), "-m", "proxy", "--config", str(self.config), "serve", "--demo-key", "--port", str(self.port),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=self._log_file,
        )
        async with asyncio.timeout(60):
            while not self.demo_key:
                line = await self.proc.stdout.readline()
                if not line:
                    raise AssertionError(f"the proxy exited: {self.log.read_text()[-2000:]}")
                if line.startswith(b"demo key: "):
                    self.demo_key = line.decode().split(": ", 1)[1].strip()
            async with aiohttp.ClientSession() as http:
                async def healthy() -> bool:
                    try:
                        async with http.get(self.url + "/healthz") as r:
                            return r.status == 200
                    except aiohttp.ClientError:
                        return False

                await eventually(healthy, 60, what="the proxy healthy")
        return self

    async def stop(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)
            async with asyncio.timeout(30):
                await self.proc.wait()
        self._log_file.close()


def _db(path: Path, sql: str, *args):
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


async def test_sigkill_mid_stream_then_restart(tmp_path):
    db = tmp_path / "ledger.db"
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"log_format": "json"},
        "workers": [{"name": "local", "url": "embedded", "dialect": "vllm", "models": ["tiny-org/tiny-model"]}],
        "ledger": {"path": str(db), "expire_interval_s": 0.25},
        # Per-request holds: this test counts their rows (a lease's crash is tested in test_ledger).
        "balance": {"hold_ttl_s": 2, "demo_balance_micros": 1_000_000, "lease_min_rate": 16},
        "prices": {"default": {"input": 1_000_000, "cached_input": 100_000, "output": 1_000_000}},
    }))
    log = tmp_path / "proxy.log"
    first = await ProxyProcess(config, log).start()
    processes = [first]
    try:
        headers = {"Authorization": f"Bearer {first.demo_key}", "Content-Type": "application/json"}
        settled: list[str] = []
        async with aiohttp.ClientSession() as http:
            for i in range(3):
                stream = i == 1
                async with http.post(first.url + "/v1/responses", headers=headers,
                                     data=orjson.dumps({"model": "tiny-org/tiny-model", "input": f"question {i}",
                                                        "stream": stream})) as r:
                    assert r.status == 200
                    await r.read()
                    settled.append(r.headers["x-request-id"])
            # settle runs right after the last byte: wait until all three are in the file
            await eventually(lambda: len(_db(db, "SELECT request_id FROM usage")) >= 3, what="three usage rows")

            slow_body = {"model": "tiny-org/tiny-model", "stream": True, "max_output_tokens": 500,
                         "input": "SIM:" + json.dumps({"text": " ".join(["word"] * 300), "delay": 0.1})}
            streams = []
            for _ in range(4):
                r = await http.post(first.url + "/v1/responses", headers=headers, data=orjson.dumps(slow_body))
                assert r.status == 200
                streams.append(r)
            for r in streams:  # every stream is producing
                seen = 0
                while seen < 2:
                    seen += (await r.content.readline()).startswith(b"event: response.output_text.delta")
            killed = [r.headers["x-request-id"] for r in streams]
            assert len(_db(db, "SELECT request_id FROM holds")) == 4

            await first.stop(signal.SIGKILL)
            for r in streams:
                r.close()

        key_id, balance_before_restart = _db(db, "SELECT key_id, balance_micros FROM keys WHERE name = 'demo'")[0]
        assert len(_db(db, "SELECT request_id FROM holds")) == 4  # the crash left the holds behind

        second = await ProxyProcess(config, log).start()
        processes.append(second)
        async with aiohttp.ClientSession() as http:
            async with http.post(second.url + "/v1/responses",
                                 headers={"Authorization": f"Bearer {second.demo_key}",
                                          "Content-Type": "application/json"},
                                 data=orjson.dumps({"model": "tiny-org/tiny-model", "input": "after the crash"})) as r:
                assert r.status == 200
                after = r.headers["x-request-id"]
            async with http.post(second.url + "/v1/responses", headers=headers,
                                 data=orjson.dumps({"model": "tiny-org/tiny-model", "input": "x"})) as r:
                assert r.status == 401  # the restart replaced the demo key

        # the holds expire (ttl 2 s) and the restarted proxy's sweeper drops them
        await eventually(lambda: not _db(db, "SELECT request_id FROM holds"), what="the holds released after their ttl")
        await second.stop(signal.SIGTERM)

        usage = {row[0]: row for row in _db(db, "SELECT request_id, key_id, cost_micros, debited_micros, status"
                                                " FROM usage")}
        for request_id in settled + [after]:
            assert request_id in usage
        for request_id in killed:
            assert request_id not in usage  # never settled: no charge for a crashed request
        first_key = [row for row in usage.values() if row[1] == key_id]
        assert len(first_key) == 3 and {row[4] for row in first_key} == {"completed"}
        (balance,), = _db(db, "SELECT balance_micros FROM keys WHERE key_id = ?", key_id)
        assert balance == balance_before_restart
        assert sum(row[3] for row in first_key) == 1_000_000 - balance  # no double charge
        assert all(row[2] == row[3] > 0 for row in first_key)

        from proxy.ledger import open_ledger

        async with open_ledger({"path": str(db)}) as ledger:
            assert await ledger.available(key_id) == balance
    finally:
        for proc in processes:
            if proc.proc is not None and proc.proc.returncode is None:
                proc.proc.kill()
                await proc.proc.wait()



async def test_a_leased_answer_is_on_disk_before_its_end_and_survives_a_sigkill(tmp_path):
    """A busy key's requests are held from a lease and their usage rows committed in batches,
    here a whole second apart: the moment a client has its whole answer, its row is on disk
    (the lease journal, fsync'd, or the ledger), so a SIGKILL right after loses no answer
    anyone received: the restart commits them, each exactly once. (Before: the batch lingered
    in memory up to lease_commit_ms after the answers it held had ended; a SIGKILL left them
    unbilled.)"""
    db = tmp_path / "ledger.db"
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"log_format": "json"},
        "workers": [{"name": "local", "url": "embedded", "dialect": "vllm", "models": ["tiny-org/tiny-model"]}],
        "ledger": {"path": str(db)},
        # leased from the first request; a batch lingers a whole second (and 1000 rows) for company
        "balance": {"demo_balance_micros": 100_000_000, "lease_min_rate": 1, "lease_commit_ms": 1000,
                    "lease_commit_rows": 1000},
        "prices": {"default": {"input": 1_000_000, "output": 1_000_000}},
    }))
    proxy = await ProxyProcess(config, tmp_path / "proxy.log").start()
    try:
        headers = {"Authorization": f"Bearer {proxy.demo_key}", "Content-Type": "application/json"}
        answered: list[str] = []
        async with aiohttp.ClientSession() as http:
            for i in range(12):
                async with http.post(proxy.url + "/v1/responses", headers=headers,
                                     data=orjson.dumps({"model": "tiny-org/tiny-model", "input": f"q {i}",
                                                        "stream": i % 2 == 0})) as r:
                    assert r.status == 200
                    await r.read()
                    answered.append(r.headers["x-request-id"])
        leased = _db(db, "SELECT count(*) FROM holds WHERE request_id LIKE 'lease:%'")[0][0]
        assert leased >= 1  # the key was leased: these rows go through the lease's batches
        in_db = {row[0] for row in _db(db, "SELECT request_id FROM usage")}
        assert not set(answered) <= in_db  # some only in the journal when the kill comes (else no test)
        key_id = _db(db, "SELECT key_id FROM holds WHERE request_id LIKE 'lease:%'")[0][0]
        await proxy.stop(signal.SIGKILL)
        before = _db(db, "SELECT balance_micros FROM keys WHERE key_id = ?", key_id)[0][0]
        proxy = await ProxyProcess(config, tmp_path / "proxy.log").start()  # recovers the journal first
        rows = _db(db, "SELECT request_id, debited_micros FROM usage")
        assert set(answered) <= {row[0] for row in rows}
        assert len(rows) == len({row[0] for row in rows})  # each once
        recovered = sum(d for r, d in rows if r in set(answered) - in_db)
        after = _db(db, "SELECT balance_micros FROM keys WHERE key_id = ?", key_id)[0][0]
        assert recovered > 0 and before - after == recovered  # debited once, by the recovery
        assert not list((tmp_path / "ledger.db.leased").glob("*.jsonl"))  # the dead one's journal, done
    finally:
        await proxy.stop(signal.SIGKILL)
