"""Proxy replicas as separate processes in front of the simulator, sharing one PostgreSQL
ledger and one Redis, and the ledger audit: the harness of tests/integration/test_scale_out.py and
tests/faults/test_backends.py.

    replicas = [Replica(i, tmp_path, replica_config(sim.url, dsn, redis.url, prefix)) for i in range(3)]
    await asyncio.gather(*(r.start() for r in replicas))      # each `python -m proxy serve`, JSON logs
    cluster = Cluster(admin_dsn, replicas, sim)
    await cluster.audit()                                     # balances == initial - debits, ...
    await cluster.wait_billed(request_ids)                    # every served request has its usage row

Each replica has its own directory (its config, its log, its spool). Nothing here is a mock:
the processes, the database and Redis are real, on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import yaml
from multidict import CIMultiDict

from tests.conftest import eventually
from tests.support.live import free_port
from tests.support.paths import REPO as ROOT

MODEL = "tiny-org/tiny-model"
# One request: a short prompt, 20 output tokens. Its cost is about 40 micros at the
# default prices; its hold (an upper bound) is several times that.
SHORT = {"text": " ".join(["tok"] * 20), "delay": 0.02}


def python() -> str:
    """The repository's venv python, else $PYTHON, else the one running the tests (a git
    worktree has no .venv of its own)."""
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else os.environ.get("PYTHON", sys.executable)


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in, section by section (nested dicts merged too)."""
    out = dict(base)
    for name, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(name), dict):
            out[name] = merged(out[name], value)
        else:
            out[name] = value
    return out


class Replica:
    def __init__(self, index: int, tmp: Path, config: dict[str, Any]) -> None:
        self.index = index
        self.dir = tmp / f"replica{index}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def config_path(self) -> Path:
        return self.dir / "proxy.yaml"

    @property
    def spool_path(self) -> Path:
        return self.dir / "spool.jsonl"

    def _write_config(self) -> None:
        cfg = dict(self.config)
        cfg["ledger"] = dict(cfg["ledger"], spool_path=str(self.spool_path))
        self.config_path.write_text(yaml.safe_dump(cfg))

    def _argv(self) -> list[str]:
        return [python(), "-m", "proxy", "serve", "--config", str(self.config_path), "--port", str(self.port)]

    async def start(self, ready: bool = True) -> None:
        """Start the process; wait for /readyz 200 (ready) or only /livez 200."""
        self._write_config()
        log = open(self.dir / "proxy.log", "ab")
        self.proc = await asyncio.create_subprocess_exec(*self._argv(), cwd=ROOT, stdout=log, stderr=log)
        log.close()
        async with aiohttp.ClientSession() as http:
            async def up() -> bool:
                assert self.proc.returncode is None, self.log()[-3000:]
                try:
                    async with http.get(self.url + ("/readyz" if ready else "/livez")) as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            try:
                await eventually(up, 60, what=f"replica {self.index} up")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {self.log()[-3000:]}") from None

    async def run_to_exit(self, within_s: float) -> tuple[int | None, str]:
        """Start the process expecting it to exit by itself: (its exit code, its stderr).
        Still running after `within_s`: killed, and the code is None."""
        self._write_config()
        proc = await asyncio.create_subprocess_exec(*self._argv(), cwd=ROOT, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            async with asyncio.timeout(within_s):
                _, err = await proc.communicate()
            return proc.returncode, err.decode(errors="replace")
        except TimeoutError:
            proc.kill()
            _, err = await proc.communicate()
            return None, err.decode(errors="replace")

    def log(self) -> str:
        path = self.dir / "proxy.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def plain_tracebacks(self) -> list[str]:
        """Tracebacks printed as plain text in the log, outside the JSON lines (a JSON line may
        hold one in a field): for each, the line before it and its exception's line."""
        lines = self.log().splitlines()
        found = []
        for at, line in enumerate(lines):
            if "Traceback" in line and not is_json_object(line):
                end = next((lines[j] for j in range(at + 1, len(lines)) if lines[j][:1] not in (" ", "")), "?")
                found.append(f"{lines[at - 1][:200] if at else ''} | {end[:300]}")
        return found

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(20):
                    await self.proc.wait()
            except TimeoutError:
                await self.kill()


def is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


class Cluster:
    """The replicas, their shared database (queried with `dsn`, a superuser's) and the keys
    the tests spend."""

    def __init__(self, dsn: str, replicas: list[Replica], sim) -> None:
        self.dsn = dsn
        self.replicas = replicas
        self.sim = sim
        self.keys: dict[str, tuple[str, str, int]] = {}  # name -> (key id, secret, initial balance)

    async def query(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn, timeout=5)
        try:
            return await conn.fetch(sql, *args, timeout=10)
        finally:
            await conn.close()

    async def audit(self) -> None:
        """Every key: balance == initial - sum of debits >= 0; no usage row billed twice;
        no debit above the cost it records."""
        for name, (key_id, _, initial) in self.keys.items():
            # One statement, one snapshot: settlements are applied by the replicas' drainers a
            # moment after each answer, so two reads could fall on either side of one.
            balance, debited = (await self.query(
                "SELECT balance_micros, (SELECT COALESCE(SUM(debited_micros), 0) FROM usage WHERE key_id = $1)"
                " FROM keys WHERE key_id = $1", key_id))[0]
            assert balance >= 0, (name, balance)
            assert initial - balance == debited, (name, initial, balance, debited)
        dupes = await self.query("SELECT request_id FROM usage GROUP BY request_id HAVING COUNT(*) > 1")
        assert dupes == []
        over = await self.query("SELECT request_id FROM usage WHERE debited_micros > cost_micros")
        assert over == []
        negative = await self.query("SELECT request_id FROM usage WHERE debited_micros < 0 OR cost_micros < 0")
        assert negative == []

    async def open_holds(self) -> int:
        return (await self.query("SELECT COUNT(*) FROM holds"))[0][0]

    async def unbilled(self, request_ids: list[str]) -> list[str]:
        """The ids among `request_ids` without a usage row."""
        rows = await self.query("SELECT request_id FROM usage WHERE request_id = ANY($1::text[])", request_ids)
        found = {r[0] for r in rows}
        return [rid for rid in request_ids if rid not in found]

    async def wait_billed(self, request_ids: list[str], within_s: float = 30) -> float:
        """Seconds until every id has its usage row (the spools replay meanwhile)."""
        t0 = time.monotonic()
        missing: list[str] = []

        async def billed() -> bool:
            missing[:] = await self.unbilled(request_ids)
            return not missing

        try:
            await eventually(billed, within_s, what="every served request billed", step=0.25)
        except AssertionError:
            raise AssertionError(f"{len(missing)} of {len(request_ids)} served requests never billed, "
                                 f"e.g. {missing[:5]}") from None
        return time.monotonic() - t0

    async def wait_no_expired_holds(self, within_s: float) -> None:
        """No hold row past its expiry (holds.expires_at is time.time() seconds), within `within_s`."""
        async def none_left() -> bool:
            return not (await self.query("SELECT COUNT(*) FROM holds WHERE expires_at < $1", time.time()))[0][0]

        await eventually(none_left, within_s, what="no hold row left past its expiry", step=0.25)


def replica_config(sim_url: str, dsn: str, redis_url: str, prefix: str, *, patient: bool = False,
                   **limits: Any) -> dict[str, Any]:
    """A replica's config. The fault tests want a frozen server seen within seconds (2 s
    statements, 0.5 s Redis replies); `patient`: bounds no busy machine reaches (a starved
    database or Redis is slow, not down: a test that injects no fault must not see a 503)."""
    statement_ms, connect_s, redis_ms = (30_000, 10, 10_000) if patient else (2000, 1, 500)
    return {
        "server": {"log_format": "json", "log_level": "warning"},
        "workers": [{"name": "sim", "url": sim_url, "models": [MODEL], "capacity": 4096,
                     "timeouts": {"connect": 2 if not patient else 10, "first_byte": 20, "idle": 20, "total": 120}}],
        "ledger": {"backend": "postgres", "dsn": dsn, "expire_interval_s": 0.25,
                   "unavailable_retry_after_s": 2, "statement_timeout_ms": statement_ms, "connect_timeout_s": connect_s},
        "balance": {"hold_ttl_s": 3},
        # Far longer than any wait below: a key change must reach the replicas by NOTIFY.
        "auth": {"key_cache_ttl_s": 300},
        "limits": {"backend": "redis", "global_concurrency": 8, "default_key_concurrency": 4096,
                   "redis": {"url": redis_url, "key_prefix": prefix, "slot_ttl_s": 3, "socket_timeout_ms": redis_ms,
                             "on_error": "closed", "retry_after_s": 1}, **limits},
    }


async def create_keys(dsn: str, tmp: Path, balances: dict[str, int]) -> dict[str, tuple[str, str, int]]:
    """Keys made through the ledger (which migrates the schema first): name -> (key id, secret, balance)."""
    from proxy.ledger import open_ledger

    ledger = open_ledger({"backend": "postgres", "dsn": dsn, "spool_path": str(tmp / "setup-spool.jsonl")},
                         base_dir=tmp)
    await ledger.start()
    keys: dict[str, tuple[str, str, int]] = {}
    try:
        for name, balance in balances.items():
            secret, record = await ledger.create_key(name, balance_micros=balance)
            keys[name] = (record.key_id, secret, balance)
    finally:
        await ledger.close()
    return keys


async def send(http: aiohttp.ClientSession, replica: Replica, secret: str, stream: bool,
               script: dict | None = None) -> tuple[int, CIMultiDict, bytes]:
    body = {"model": MODEL, "stream": stream, "max_output_tokens": 40,
            "input": "hello SIM:" + json.dumps(script or SHORT)}
    async with http.post(replica.url + "/v1/responses", data=orjson.dumps(body),
                         headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


async def hang_up(http: aiohttp.ClientSession, replica: Replica, secret: str,
                  script: dict) -> tuple[int, CIMultiDict, bytes]:
    """A stream the client drops after its first bytes (billed for what was generated)."""
    body = {"model": MODEL, "stream": True, "max_output_tokens": 40, "input": "hello SIM:" + json.dumps(script)}
    async with http.post(replica.url + "/v1/responses", data=orjson.dumps(body),
                         headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}) as r:
        if r.status != 200:
            return r.status, CIMultiDict(r.headers), await r.read()
        first = await r.content.readany()
        r.close()  # the connection is dropped, not returned to the pool
        return r.status, CIMultiDict(r.headers), first


def completed(status: int, raw: bytes, stream: bool) -> bool:
    if status != 200:
        return False
    if stream:
        return b"event: response.completed" in raw
    return orjson.loads(raw).get("status") == "completed"


async def keys_cli(replica: Replica, *args: str, check: bool = True) -> tuple[int, str, str]:
    """The keys CLI, as an operator runs it on another machine: its own process, the
    replica's config (the shared database): (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        python(), "-m", "proxy", "keys", "--config", str(replica.config_path), *args,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
    if check:
        assert proc.returncode == 0, err.decode()
    return proc.returncode, out.decode(), err.decode()
