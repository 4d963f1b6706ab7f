"""Crash safety under load: the proxy (a real process, the full chain, SQLite ledger) is
SIGKILLed while dozens of streams and JSON requests are in flight, then restarted on the
same database. Afterwards: every JSON answer a client received before the settle window
(settles are group-committed every few ms, after the answer: README "Keys and balances")
has its usage row, no request is billed twice, the ledger audits (balance == top-ups - debits for every
key), and the holds the crash left behind are released once their ttl passes."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import time

import aiohttp
import orjson
import pytest

from tests.conftest import eventually
from tests.integration.test_hostile import start_proxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

CONCURRENCY = 40
LOAD_SECONDS = 2.0
SETTLE_WINDOW_S = 0.5  # generous: settles commit every settle_linger_ms (5 ms), leased ones every lease_commit_ms (20 ms)


def query(db, sql: str):
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


async def test_sigkill_under_load_then_restart(sim, tmp_path):
    extra = {"ledger": {"path": str(tmp_path / "ledger.db"), "expire_interval_s": 0.25},
             "balance": {"hold_ttl_s": 2, "demo_balance_micros": 50_000_000}}
    db = tmp_path / "ledger.db"
    proc, port, key, log = await start_proxy(tmp_path, sim.url, extra)
    url = f"http://127.0.0.1:{port}"
    answered: list[tuple[str, float]] = []  # (request id, when) of JSON answers the clients received
    errors: list[str] = []
    stop = asyncio.Event()

    async def client(i: int, http: aiohttp.ClientSession) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            stream = (i + n) % 2 == 0
            script = {"text": " ".join(["tok"] * 40), "delay": 0.01} if stream else {"text": "short answer"}
            payload = {"model": "tiny-org/tiny-model", "stream": stream, "max_output_tokens": 100,
                       "input": f"client {i} turn {n} SIM:{json.dumps(script)}"}
            try:
                async with http.post(url + "/v1/responses", data=orjson.dumps(payload),
                                     headers={"Authorization": f"Bearer {key}",
                                              "Content-Type": "application/json"}) as r:
                    raw = await r.read()
                    if r.status != 200:
                        errors.append(f"{r.status} {raw[:200]!r}")
                    elif not stream and orjson.loads(raw)["status"] == "completed":
                        answered.append((r.headers["x-request-id"], time.monotonic()))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return  # the proxy died under us

    try:
        async with aiohttp.ClientSession() as http:
            tasks = [asyncio.create_task(client(i, http)) for i in range(CONCURRENCY)]
            await asyncio.sleep(LOAD_SECONDS)  # not a wait: the load runs this long before the kill
            in_flight_holds = query(db, "SELECT COUNT(*) FROM holds")[0][0]
            killed_at = time.monotonic()
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            stop.set()
            await asyncio.gather(*tasks)
        log.close()
        assert errors == [], errors[:5]
        assert len(answered) > 20
        crashed_holds = query(db, "SELECT COUNT(*) FROM holds")[0][0]
        assert crashed_holds > 0 or in_flight_holds > 0  # the kill really hit requests in flight

        proc, port, key, log = await start_proxy(tmp_path, sim.url, extra)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/responses", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "tiny-org/tiny-model", "input": "after the crash"}) as r:
                assert r.status == 200
        await eventually(lambda: not query(db, "SELECT COUNT(*) FROM holds")[0][0], 15,
                         what="the crashed requests' holds released")

        rows = query(db, "SELECT request_id FROM usage")
        ids = [r[0] for r in rows]
        assert len(ids) == len(set(ids))  # no request billed twice
        # The documented crash window: settles queued in the last ~20 ms (linger + one commit)
        # may be lost, unbilled and never double-billed; anything answered before it is durable.
        settled_before_kill = {rid for rid, at in answered if at < killed_at - SETTLE_WINDOW_S}
        assert len(settled_before_kill) > 20
        missing = settled_before_kill - set(ids)
        assert not missing, f"{len(missing)} answered requests have no usage row"
        audit = query(db, "SELECT k.key_id, k.balance_micros,"
                          " (SELECT COALESCE(SUM(micros),0) FROM topups t WHERE t.key_id=k.key_id)"
                          " - (SELECT COALESCE(SUM(debited_micros),0) FROM usage u WHERE u.key_id=k.key_id)"
                          " FROM keys k")
        for key_id, balance, expected in audit:
            assert balance == expected, (key_id, balance, expected)
        first = query(db, "SELECT key_id, balance_micros FROM keys ORDER BY created_at LIMIT 1")[0]
        spent = query(db, f"SELECT COALESCE(SUM(debited_micros),0) FROM usage WHERE key_id = '{first[0]}'")[0][0]
        assert 50_000_000 - first[1] == spent  # the balance fell by exactly the recorded costs
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
