"""What only the PostgreSQL ledger has, on a real server (tests/support/pg_server.py): migrations
raced by replicas, NOTIFY reaching other replicas' key caches, the database going away
(LedgerUnavailable, 503 + Retry-After through a real proxy, settlements spooled and
replayed exactly once), and the spool file itself. The shared contract (holds, settles,
leases, console) runs on both backends in test_ledger.py and friends."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import orjson
import pytest

from proxy.ledger import KeyLimits, LedgerUnavailable, UsageRecord, open_ledger
from proxy.ledger.postgres.schema import MIGRATIONS, latest_version
from proxy.ledger.spool import Spool, decode, encode, release_record, settle_record, usage_of
from tests.conftest import eventually as wait_for


def usage_for(request_id: str, key_id: str, cost: int) -> UsageRecord:
    return UsageRecord(request_id, key_id, "tiny-model", 100, 20, 50, 10, cost, "completed")


def pg_section(dsn: str, tmp_path, **extra) -> dict:
    return {"backend": "postgres", "dsn": dsn, "spool_path": str(tmp_path / "spool.jsonl"),
            "connect_timeout_s": 1, "unavailable_retry_after_s": 3, **extra}


# ---------------------------------------------------------------- the spool file (no database)


def test_spool_format_round_trips_and_skips_a_torn_line(tmp_path):
    u = usage_for("r1", "key_a", 42)
    u.worker = "w1"
    line = encode(settle_record("r1", u))
    torn = encode(release_record("r2"))[:-7]  # a crash in the middle of a write
    records, bad = decode(line + encode(settle_record("r3", u, lease_id="lease:x")) + torn)
    assert len(bad) == 1 and [r["kind"] for r in records] == ["settle", "lease_usage"]
    again = usage_of(records[0])
    assert (again.request_id, again.cost_micros, again.worker, again.debited_micros) == ("r1", 42, "w1", None)
    assert records[1]["lease_id"] == "lease:x"
    with pytest.raises(ValueError):
        encode({"kind": "nonsense", "request_id": "x"})


async def test_spool_replay_keeps_lines_written_during_the_replay(tmp_path):
    spool = Spool(tmp_path / "s.jsonl")
    for i in range(3):
        spool.append(release_record(f"old-{i}"))
    seen: list[str] = []

    async def apply(records):
        for record in records:
            seen.append(record["request_id"])
            if record["request_id"] == "old-1":  # a settlement spooled while the replay runs
                spool.append(release_record("new-0"))
        return ["applied"] * len(records)

    assert await spool.replay(apply, batch=1) == 3
    assert seen == ["old-0", "old-1", "old-2"]
    assert [r["request_id"] for r in spool.records()] == ["new-0"]  # not lost, not replayed yet

    async def fail(records):
        raise LedgerUnavailable()

    spool.append(release_record("new-1"))
    with pytest.raises(LedgerUnavailable):
        await spool.replay(fail)
    assert [r["request_id"] for r in spool.records()] == ["new-0", "new-1"]  # kept for the next replay
    assert await spool.replay(apply) == 2 and not spool.pending()
    assert await spool.replay(apply) == 0


# ---------------------------------------------------------------- replicas on one database


async def test_migrations_are_applied_once_when_four_replicas_start_at_once(pg_dsn, tmp_path, pg_server):
    ledgers = [open_ledger(pg_section(pg_dsn, tmp_path / str(i))) for i in range(4)]
    try:
        # Every migration is a plain CREATE: applying one twice would fail one of these starts.
        await asyncio.gather(*(led.start() for led in ledgers))
        rows = await ledgers[0]._db(lambda c: c.fetch("SELECT version FROM schema_migrations ORDER BY 1"),
                                    transaction=False)
        assert [r[0] for r in rows] == [v for v, _, _ in MIGRATIONS] and rows[-1][0] == latest_version()
        _, key = await ledgers[1].create_key("shared", 100)
        assert (await ledgers[3].get_key(key.key_id)).balance_micros == 100
    finally:
        for led in ledgers:
            await led.close()
    again = open_ledger(pg_section(pg_dsn, tmp_path / "late"))
    async with again:  # a later start finds everything applied
        assert len(await again.list_keys()) == 1


async def test_concurrent_holds_from_replicas_on_a_small_balance_never_overdraw(pg_dsn, tmp_path):
    ledgers = [open_ledger(pg_section(pg_dsn, tmp_path / str(i), pool_max=4)) for i in range(3)]
    for led in ledgers:
        await led.start()
    try:
        initial = 5_000
        _, key = await ledgers[0].create_key("small", initial)

        async def request(i: int) -> int:
            led = ledgers[i % 3]
            try:
                hold = await led.hold_up_to(f"q-{i}", key.key_id, 300, 700, ttl_s=60)
            except Exception:
                return 0
            cost = hold.amount_micros - i % 50
            assert await led.settle(hold.request_id, usage_for(hold.request_id, key.key_id, cost))
            return cost

        costs = await asyncio.gather(*(request(i) for i in range(120)))
        balance = (await ledgers[2].get_key(key.key_id)).balance_micros
        used = await ledgers[1].list_usage(key.key_id, limit=1000)
        assert initial - balance == sum(costs) == sum(u.debited_micros for u in used)
        assert all(u.debited_micros == u.cost_micros for u in used)  # never clamped: never overdrawn
        assert balance < 300 and await ledgers[0].holds() == []
        assert all(b == expected for _, b, expected in await ledgers[0].audit())
    finally:
        for led in ledgers:
            await led.close()


async def test_key_changes_reach_another_replica_at_once(pg_dsn, tmp_path):
    a = open_ledger(pg_section(pg_dsn, tmp_path / "a"))
    b = open_ledger(pg_section(pg_dsn, tmp_path / "b"))
    async with a, b:
        secret, key = await a.create_key("k", 10)
        for change in (lambda: a.set_limits(key.key_id, KeyLimits(concurrency=2)), lambda: a.rotate_key(key.key_id),
                       lambda: a.revoke(key.key_id)):
            seen = b.key_generation
            t0 = time.monotonic()
            await change()
            assert await wait_for(lambda: b.key_generation > seen, 2.0), "no NOTIFY reached the other replica"
            assert time.monotonic() - t0 < 1.0
        seen = b.key_generation
        await a.top_up(key.key_id, 5)  # a balance is not part of a cached key
        await asyncio.sleep(0.2)  # not a wait: the time a NOTIFY took above; none is to come
        assert b.key_generation == seen


async def test_a_lost_listener_reconnects_and_bumps_the_generation(pg_dsn, tmp_path, pg_server):
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    async with led:
        seen = led.key_generation
        pg_server.stop()
        assert await wait_for(lambda: led.key_generation > seen, 5.0)  # the loss alone flushes caches
        pg_server.start()
        assert await wait_for(lambda: led._listener.connected.is_set(), 10.0)
        reconnected = led.key_generation
        other = open_ledger(pg_section(pg_dsn, tmp_path / "other"))
        async with other:
            _, key = await other.create_key("after", 1)
            await other.revoke(key.key_id)
        assert await wait_for(lambda: led.key_generation > reconnected, 3.0)  # listening again


# ---------------------------------------------------------------- the database goes away


async def test_unreachable_database_is_unavailable_and_settles_are_spooled_then_replayed(pg_dsn, tmp_path,
                                                                                        pg_server):
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    led.replay_interval_s = 0.2
    try:
        secret, key = await led.create_key("outage", 10_000)
        for i in range(3):
            await led.hold(f"h-{i}", key.key_id, 1_000, ttl_s=60)
        pg_server.stop()
        with pytest.raises(LedgerUnavailable) as info:
            await led.lookup_key(secret)
        assert info.value.retry_after_s == 3
        with pytest.raises(LedgerUnavailable):
            await led.hold("new", key.key_id, 1, ttl_s=60)
        # settlements of requests already running are not lost
        assert await led.settle("h-0", usage_for("h-0", key.key_id, 400))
        assert await led.settle("h-1", usage_for("h-1", key.key_id, 5_000))  # clamped at its hold at replay
        assert await led.release("h-2")
        # the refused hold's release first: its reply could have been lost after it committed
        assert [(r["kind"], r["request_id"]) for r in led.spool.records()] == \
            [("release", "new"), ("settle", "h-0"), ("settle", "h-1"), ("release", "h-2")]
        lines = [orjson.dumps(r) for r in led.spool.records()]
        assert led.stats["spooled"] == 4
        pg_server.start()
        assert await wait_for(lambda: not led.spool.pending(), 10.0)  # the background replay
        assert (await led.get_key(key.key_id)).balance_micros == 10_000 - 400 - 1_000
        assert (await led.usage("h-1")).debited_micros == 1_000 and await led.holds() == []
        assert await led.replay_spool() == 0  # a second replay is a no-op
        # the same lines replayed again (a crash between replay and unlink): no double debit
        (tmp_path / "spool.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        assert await led.replay_spool() == 4
        assert (await led.get_key(key.key_id)).balance_micros == 10_000 - 400 - 1_000
        assert len(await led.list_usage(key.key_id)) == 2
        assert all(b == expected for _, b, expected in await led.audit())
    finally:
        pg_server.start()
        await led.close()


async def test_a_frozen_database_is_unavailable_in_bounded_time_not_a_hang(pg_dsn, tmp_path, pg_server):
    """A server that keeps its connections open and answers nothing (SIGSTOP: a partitioned
    network looks the same): every call ends within statement_timeout + 1 s, as
    LedgerUnavailable; settles are spooled; after the thaw they are replayed once."""
    led = open_ledger(pg_section(pg_dsn, tmp_path, statement_timeout_ms=500))
    await led.start()
    led.replay_interval_s = 0.2
    try:
        secret, key = await led.create_key("frozen", 10_000)
        await led.hold("f-0", key.key_id, 1_000, ttl_s=60)
        pg_server.freeze()
        try:
            for call in (lambda: led.lookup_key(secret), lambda: led.hold("f-new", key.key_id, 1, ttl_s=60)):
                t0 = time.monotonic()
                with pytest.raises(LedgerUnavailable):
                    await asyncio.wait_for(call(), 10)  # the wait_for only keeps a failing test from hanging
                assert time.monotonic() - t0 < 3.5
            t0 = time.monotonic()
            assert await asyncio.wait_for(led.settle("f-0", usage_for("f-0", key.key_id, 400)), 10)
            assert time.monotonic() - t0 < 3.5
            assert led.spool.pending()
        finally:
            pg_server.thaw()
        assert await wait_for(lambda: not led.spool.pending(), 15.0)
        assert (await led.get_key(key.key_id)).balance_micros == 10_000 - 400
        assert (await led.usage("f-0")).debited_micros == 400
    finally:
        pg_server.thaw()
        await led.close()


async def test_a_failed_lease_commit_spools_its_rows_and_the_replay_takes_them_off_the_lease(
        pg_dsn, tmp_path, pg_server):
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    led.replay_interval_s = 3600  # replayed by hand below
    try:
        _, key = await led.create_key("leased", 100_000)
        granted, _ = await led.lease_grow("lease:t", key.key_id, 1_000, 10_000, ttl_s=60)
        assert granted == 10_000
        pg_server.stop()
        rows = [("lease:t", usage_for(f"l-{i}", key.key_id, 700)) for i in range(3)]
        results, lapsed = await led.lease_commit(rows, [("lease:t", 0, 60, False)])
        assert results == [700, 700, 700] and lapsed == set()  # spooled: counted as debited
        assert [r["kind"] for r in led.spool.records()] == ["lease_usage"] * 3
        pg_server.start()
        assert await led.replay_spool() == 3
        (row,) = await led.holds(key.key_id)
        assert row.amount_micros == 10_000 - 2_100  # what memory believes the lease still has free
        assert (await led.get_key(key.key_id)).balance_micros == 100_000 - 2_100
        assert await led.available(key.key_id) == 100_000 - 10_000
    finally:
        pg_server.start()
        await led.close()


async def test_start_replays_a_non_empty_spool_before_serving(pg_dsn, tmp_path):
    setup = open_ledger(pg_section(pg_dsn, tmp_path))
    async with setup:
        _, key = await setup.create_key("restart", 1_000)
        await setup.hold("r-1", key.key_id, 500, ttl_s=60)
    spool = Spool(tmp_path / "spool.jsonl")
    spool.append(settle_record("r-1", usage_for("r-1", key.key_id, 300)))  # the previous run's outage
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    try:
        assert not spool.pending()  # replayed inside start(), before anything is served
        assert (await led.get_key(key.key_id)).balance_micros == 700 and await led.holds() == []
    finally:
        await led.close()


async def test_a_start_while_the_database_is_down_serves_503_then_replays_first(pg_dsn, tmp_path, pg_server):
    """A replica restarted during an outage comes up (no crash loop), answers unavailable,
    and once the database is back replays its spool before any other request uses it."""
    setup = open_ledger(pg_section(pg_dsn, tmp_path))
    async with setup:
        secret, key = await setup.create_key("restart-down", 1_000)
        await setup.hold("r-down", key.key_id, 500, ttl_s=60)
    spool = Spool(tmp_path / "spool.jsonl")
    spool.append(settle_record("r-down", usage_for("r-down", key.key_id, 300)))
    pg_server.stop()
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    try:
        await led.start()  # returns: the database is down, the ledger keeps trying
        with pytest.raises(LedgerUnavailable):
            await led.lookup_key(secret)
        with pytest.raises(LedgerUnavailable):
            await led.hold("r-new", key.key_id, 100, ttl_s=60)
        assert spool.pending()
        pg_server.start()
        async def back():
            try:
                return await led.lookup_key(secret)
            except LedgerUnavailable:
                return None

        record = await wait_for(back, 15, what="the ledger back")
        # The first answer after the outage already sees the replayed settlement.
        assert not spool.pending()
        assert record is not None and record.balance_micros == 700
        assert (await led.usage("r-down")).debited_micros == 300
    finally:
        if pg_server.proc is None:
            pg_server.start()
        await led.close()


async def test_the_proxy_answers_503_with_retry_after_while_the_database_is_down(make_proxy, pg_dsn, tmp_path,
                                                                                  pg_server):
    proxy = await make_proxy({"ledger": pg_section(pg_dsn, tmp_path), "balance": {"lease_max_micros": 0},
                              "auth": {"demo_key": True, "key_cache_ttl_s": 60}})
    secret, _ = await proxy.ledger.create_key("cached", 50_000_000)
    body = {"model": "tiny-org/tiny-model", "input": "Hi.", "max_output_tokens": 8}
    async with aiohttp.ClientSession() as s:
        ok = await s.post(proxy.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {secret}"})
        assert ok.status == 200  # the key is in the auth cache now
        pg_server.stop()
        try:
            for who in (secret, proxy.api_key):  # the hold (cached key), the lookup (a key not cached)
                refused = await s.post(proxy.url + "/v1/responses", json=body,
                                       headers={"Authorization": f"Bearer {who}"})
                assert refused.status == 503, await refused.text()
                assert refused.headers["Retry-After"] == "3"
                error = (await refused.json())["error"]
                assert error["code"] == "ledger_unavailable" and error["type"] == "service_unavailable"
        finally:
            pg_server.start()
        again = await s.post(proxy.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {secret}"})
        assert again.status == 200  # the pool reconnects by itself
