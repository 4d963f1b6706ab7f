"""Scale-out: 4 proxy replicas (separate processes on separate ports, as separate hosts would
be) share one PostgreSQL ledger and one Redis for limits, in front of one simulator.

What is shown, each against real servers started by the fixtures (tests/support/pg_server.py,
tests/support/redis_server.py), never mocks:
  * 200 concurrent mixed requests over the replicas: no overdraft on a key whose balance
    covers about 10 of them (balance decrease == sum of debits, no debit above its hold),
    and a global concurrency limit of 8 is never exceeded at the upstream;
  * a replica SIGKILLed under load: its holds expire, nothing is billed twice, the other
    replicas keep serving, and its Redis slots expire (the limit frees up);
  * PostgreSQL stopped for 10 s under load: only 503s (with Retry-After) for new requests,
    every settlement of the requests that were running reaches the ledger afterwards (the
    spool replayed), the audit balances;
  * Redis stopped: the documented fail mode (closed: 503 + Retry-After) holds, and the
    replicas recover when it is back, without a restart.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict

from tests.conftest import eventually
from tests.support.cluster import Cluster, Replica, completed, create_keys, hang_up, keys_cli, replica_config, send

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPLICAS = 4
GLOBAL_LIMIT = 8


@pytest.fixture
async def cluster(pg_dsn, redis_db, sim, tmp_path):
    dsn = pg_dsn
    keys = await create_keys(dsn, tmp_path, {"poor": 450, "rich": 50_000_000})
    config = replica_config(sim.url, dsn, redis_db.url, f"rp-{secrets.token_hex(3)}:", patient=True)
    replicas = [Replica(i, tmp_path, config) for i in range(REPLICAS)]
    await asyncio.gather(*(r.start() for r in replicas))
    c = Cluster(dsn, replicas, sim)
    c.keys = keys
    try:
        yield c
    finally:
        await asyncio.gather(*(r.stop() for r in replicas))


async def test_200_mixed_requests_on_4_replicas_never_overdraw_nor_pass_the_global_limit(cluster):
    poor = cluster.keys["poor"][1]
    rich = cluster.keys["rich"][1]
    slow = {"text": " ".join(["tok"] * 20), "delay": 0.01}
    refused = [0]  # 429s: each client backs off and tries again until it gets an answer

    async def client(http: aiohttp.ClientSession, i: int) -> tuple[int, CIMultiDict, bytes]:
        replica = cluster.replicas[i % REPLICAS]
        secret = poor if i % 2 else rich
        deadline = time.monotonic() + 60
        while True:
            if i % 10 in (4, 7):  # one client in five hangs up mid-stream (both keys)
                status, headers, raw = await hang_up(http, replica, secret, slow)
            else:
                status, headers, raw = await send(http, replica, secret, stream=bool(i % 3), script=slow)
            if status != 429 or time.monotonic() > deadline:
                return status, headers, raw
            assert "Retry-After" in headers
            refused[0] += 1
            await asyncio.sleep(0.02 + (i % 7) * 0.01)  # not a wait: a refused client backs off

    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(client(http, i) for i in range(200)))
    statuses = [s for s, _, _ in results]
    by_status = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"200 requests over {REPLICAS} replicas: {by_status}, upstream peak in flight {cluster.sim.peak_in_flight}")
    print(f"  ({refused[0]} answers were 429 first and tried again)")
    assert set(statuses) <= {200, 402}, by_status
    assert refused[0] > 0  # the limit bound: 200 clients over 4 replicas against 8 slots
    rich_ok = sum(1 for (st, _, _), i in zip(results, range(200)) if i % 2 == 0 and st == 200)
    assert rich_ok == 100
    # The limit holds across the replicas at the upstream: never 9 chats at once.
    assert cluster.sim.peak_in_flight <= GLOBAL_LIMIT
    assert cluster.sim.peak_in_flight == GLOBAL_LIMIT
    await cluster.wait_billed([h["x-request-id"] for s, h, _ in results if s == 200])  # the last answers' too
    await cluster.audit()
    key_id, _, initial = cluster.keys["poor"]
    spent = initial - (await cluster.query("SELECT balance_micros FROM keys WHERE key_id=$1", key_id))[0][0]
    print(f"poor key: {initial} -> {initial - spent} micros")
    assert 0 < spent <= initial
    poor_ok = sum(1 for (st, _, _), i in zip(results, range(200)) if i % 2 and st == 200)
    print(f"poor key: {poor_ok} answered, {statuses.count(402)} refused with 402")
    assert 5 <= poor_ok <= 15  # its balance covers about 10
    assert statuses.count(402) == 100 - poor_ok


async def test_a_sigkilled_replica_leaves_nothing_charged_twice_and_the_others_keep_serving(cluster):
    rich = cluster.keys["rich"][1]
    victim, others = cluster.replicas[0], cluster.replicas[1:]
    stop = asyncio.Event()
    after_kill: list[int] = []
    killed = asyncio.Event()

    async def load(replica: Replica, http: aiohttp.ClientSession, n: int) -> None:
        while not stop.is_set():
            try:
                status, _, raw = await send(http, replica, rich, stream=bool(n % 2))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                if replica is victim:
                    return
                raise
            if killed.is_set() and replica is not victim:
                after_kill.append(status)
            n += 1

    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(load(cluster.replicas[i % REPLICAS], http, i)) for i in range(12)]
        await asyncio.sleep(1.5)  # not a wait: the load runs before the kill...
        await victim.kill()
        killed.set()
        await asyncio.sleep(2.0)  # ...and after it, on the other replicas
        stop.set()
        await asyncio.gather(*tasks)
    # The others kept serving (429s are fine: the killed replica's slots count until they expire).
    assert after_kill.count(200) >= 10, after_kill[:20]
    assert set(after_kill) <= {200, 429}
    # Its holds expire (hold_ttl_s 3, swept by the live replicas) and its Redis slots too:
    # 8 requests at once are admitted again.
    async def no_hold() -> bool:
        return not await cluster.open_holds()

    await eventually(no_hold, 20, what="the killed replica's holds expired", step=0.25)
    await asyncio.sleep(3.5)  # not a wait: slot_ttl_s passes, and the killed replica's slots expire
    slow = {"text": "x", "delay": 1.0}
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(send(http, others[i % 3], rich, False, slow) for i in range(GLOBAL_LIMIT)))
    assert [s for s, _, _ in results] == [200] * GLOBAL_LIMIT
    await cluster.audit()


async def test_postgres_down_for_10s_gives_503s_and_loses_no_settlement(cluster, pg_server):
    rich = cluster.keys["rich"][1]
    long = {"text": " ".join(["tok"] * 30), "delay": 0.1}  # ~3 s streams, running when the database stops
    done: list[str] = []  # request ids of answers the clients received complete
    during: list[tuple[int, dict]] = []
    down = asyncio.Event()

    async def running(http: aiohttp.ClientSession, i: int) -> None:
        replica = cluster.replicas[i % REPLICAS]
        status, headers, raw = await send(http, replica, rich, stream=bool(i % 2), script=long)
        if completed(status, raw, bool(i % 2)):
            done.append(headers["x-request-id"])

    async def newcomers(http: aiohttp.ClientSession) -> None:
        await down.wait()
        t_end = time.monotonic() + 8
        i = 0
        while time.monotonic() < t_end:
            status, headers, raw = await send(http, cluster.replicas[i % REPLICAS], rich, stream=False)
            during.append((status, headers))
            i += 1
            await asyncio.sleep(0.1)  # not a wait: newcomers paced through the outage

    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(running(http, i)) for i in range(GLOBAL_LIMIT)]
        await asyncio.sleep(0.8)  # not a wait: they hold and stream when the database stops
        await asyncio.to_thread(pg_server.stop)
        down.set()
        t_stop = time.monotonic()
        comers = asyncio.create_task(newcomers(http))
        # A replica (re)started during the outage comes up and refuses with 503 too.
        late = Replica(REPLICAS, cluster.replicas[0].dir.parent, cluster.replicas[0].config)
        await late.start(ready=False)
        status, headers, _ = await send(http, late, rich, stream=False)
        assert status == 503 and "Retry-After" in headers
        await asyncio.gather(*tasks)
        await comers
        # Their settlements wait in the replicas' spools (written before each answer ended).
        waiting = {r["request_id"] for replica in cluster.replicas for r in spool_records(replica)}
        await asyncio.sleep(max(0.0, 10 - (time.monotonic() - t_stop)))  # not a wait: the outage lasts 10 s
        await asyncio.to_thread(pg_server.start)
    # Every request that was running finished for its client.
    assert len(done) == GLOBAL_LIMIT
    # New requests while the database was down: 503 with Retry-After, nothing else (no 500).
    assert during, "no request was tried while the database was down"
    assert {s for s, _ in during} == {503}, sorted({s for s, _ in during})
    assert all("Retry-After" in h for _, h in during)
    # The spool is replayed: every answered request has its usage row, once.
    await cluster.wait_billed(done, within_s=30)
    await cluster.audit()
    print(f"{len(done)} requests ran through the outage; {len(waiting)} settlements waited in the spools")
    assert set(done) <= waiting  # their settlements really went through the spool
    for replica in cluster.replicas:
        spool = replica.dir / "spool.jsonl"
        assert not spool.exists() or spool.stat().st_size == 0
    # And the replicas serve again without a restart; the late one too.
    try:
        async with aiohttp.ClientSession() as http:
            for replica in cluster.replicas + [late]:
                async def serves() -> bool:
                    status = (await send(http, replica, rich, stream=False))[0]
                    assert status in (200, 503), status
                    return status == 200

                await eventually(serves, 10, what=f"replica {replica.index} serving again", step=0.2)
    finally:
        await late.stop()


async def test_redis_down_fails_closed_then_recovers_without_a_restart(cluster, redis_server):
    rich = cluster.keys["rich"][1]
    async with aiohttp.ClientSession() as http:
        assert (await send(http, cluster.replicas[0], rich, False))[0] == 200
        await asyncio.to_thread(redis_server.stop)
        try:
            results = await asyncio.gather(*(send(http, r, rich, False) for r in cluster.replicas))
            for status, headers, raw in results:
                assert status == 503, raw[:300]
                assert "Retry-After" in headers
                error = orjson.loads(raw)["error"]
                assert set(error) >= {"message", "type", "param", "code"}
        finally:
            await asyncio.to_thread(redis_server.start)
        for replica in cluster.replicas:
            async def serves() -> bool:
                return (await send(http, replica, rich, False))[0] == 200

            await eventually(serves, 15, what=f"replica {replica.index} serving again", step=0.2)
    await cluster.audit()


async def until_every_replica(cluster: Cluster, secret: str, want: int, within_s: float) -> float:
    """Seconds until every replica answers `want` to the key (all asked in each round)."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        async def answered() -> list[int] | None:
            statuses = [s for s, _, _ in await asyncio.gather(
                *(send(http, r, secret, False, {"text": "x"}) for r in cluster.replicas))]
            return None if statuses != [want] * len(cluster.replicas) else statuses

        await eventually(answered, within_s, what=f"every replica answering {want}", step=0.05)
        return time.monotonic() - t0


async def test_a_limit_change_and_a_revocation_reach_every_replica_at_once(cluster):
    key_id, secret, _ = cluster.keys["rich"]
    # Every replica has the key cached (key_cache_ttl_s: 300).
    assert await until_every_replica(cluster, secret, 200, 5) < 5
    await keys_cli(cluster.replicas[0], "limits", key_id, "--models", "someone/else")
    took = await until_every_replica(cluster, secret, 403, 2)
    print(f"allowed models changed: every replica refuses after {took * 1000:.0f} ms")
    await keys_cli(cluster.replicas[0], "limits", key_id, "--models", "*")
    await until_every_replica(cluster, secret, 200, 2)
    await keys_cli(cluster.replicas[0], "revoke", key_id)
    took = await until_every_replica(cluster, secret, 401, 2)
    print(f"revoked: every replica refuses after {took * 1000:.0f} ms")


def spool_records(replica: Replica) -> list[dict]:
    """The settlements waiting in a replica's spool (its file and any replay leftovers)."""
    from proxy.ledger.spool import Spool

    return Spool(replica.dir / "spool.jsonl").records()
