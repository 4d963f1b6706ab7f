"""Settlement off the client's tail on PostgreSQL (proxy/ledger/postgres/spool.py): settle_behind
writes the settlement to the local spool (fsync'd, group-committed) and the drainer applies
it in batches (postgres.usage.settle_batch). Shown on a real server: the batch path gives exactly
what settle() one by one gives (a differential test: the fast path against the general one),
the answer does not wait on the database, appends racing the drainer's rotation are never
lost, and a crash's replay debits nothing twice."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from proxy.ledger import InsufficientBalance, UsageRecord, open_ledger
from tests.conftest import fill, tiny_tmpfs
from tests.ledger.test_postgres import pg_section, usage_for, wait_for


def _usage(request_id: str, key_id: str, cost: int) -> UsageRecord:
    return UsageRecord(request_id, key_id, "tiny-model", 10, 0, 5, 0, cost, "completed")


async def _scenario(led, keys: list[str], seed: int, settle) -> None:
    """Holds then settlements: costs above their hold, below it, without a hold, balances that
    run out, the same request twice, a request of a key that does not exist."""
    rng = random.Random(seed)
    plan = []
    for n in range(60):
        key = rng.choice(keys)
        request_id = f"r{seed}-{n}"
        hold = rng.choice([None, 50, 200, 400])
        if hold is not None:
            try:
                await led.hold_up_to(request_id, key, 1, hold, ttl_s=60)
            except InsufficientBalance:
                pass
        plan.append((request_id, key, rng.choice([0, 30, 150, 300, 900])))
    plan += [plan[3], plan[7]]  # settled twice: once only
    plan.append((f"r{seed}-ghost", "key_that_does_not_exist", 10))
    for request_id, key, cost in plan:
        await settle(request_id, key, cost)


async def test_the_batched_drain_records_exactly_what_settle_one_by_one_records(pg_server, tmp_path):
    names = [pg_server.create_database() for _ in range(2)]
    one, batched = (open_ledger(pg_section(dsn, tmp_path / name)) for name, dsn in names)
    await one.start()
    await batched.start()
    try:
        for seed in range(3):
            keys = []
            for i, balance in enumerate((400, 1_500, 100_000)):  # two run out, one does not
                name = f"k{seed}-{i}"
                _, a = await one.create_key(name, balance)
                _, b = await batched.create_key(name, balance)
                keys.append((a.key_id, b.key_id))

            async def by_one(request_id, key, cost):
                await one.settle(request_id, _usage(request_id, key, cost))  # the unknown key: spooled

            async def behind(request_id, key, cost):
                await batched.settle_behind(request_id, _usage(request_id, key, cost))

            await _scenario(one, [a for a, _ in keys], seed, by_one)
            await _scenario(batched, [b for _, b in keys], seed, behind)
            await batched.settled(10)
            assert await wait_for(lambda: len(batched.spool.records()) <= seed + 1, 10)  # the ghosts wait
            for a, b in keys:
                got_one = {(u.request_id, u.cost_micros, u.debited_micros) for u in await one.list_usage(a, 500)}
                got_batch = {(u.request_id, u.cost_micros, u.debited_micros)
                             for u in await batched.list_usage(b, 500)}
                assert got_batch == got_one
                assert (await batched.get_key(b)).balance_micros == (await one.get_key(a)).balance_micros
            assert await batched.holds() == [] or all(h.request_id.startswith("lease") for h in await batched.holds())
        assert [r["request_id"] for r in batched.spool.records()] == [f"r{s}-ghost" for s in range(3)]
        assert all(balance == expected for _, balance, expected in await batched.audit())
    finally:
        await one.close()
        await batched.close()
        for name, _ in names:
            pg_server.drop_database(name)


async def test_settle_behind_does_not_wait_on_the_database(pg_dsn, tmp_path, pg_server):
    led = open_ledger(pg_section(pg_dsn, tmp_path, statement_timeout_ms=500))
    await led.start()
    led.replay_interval_s = 0.2
    try:
        _, key = await led.create_key("tail", 10_000)
        await led.hold("t-0", key.key_id, 1_000, ttl_s=60)
        pg_server.freeze()
        try:
            t0 = time.monotonic()
            await asyncio.wait_for(led.settle_behind("t-0", usage_for("t-0", key.key_id, 400)), 10)
            assert time.monotonic() - t0 < 0.3  # a local fsync, not a round trip to a frozen server
            assert [r["request_id"] for r in led.spool.records()] == ["t-0"]
        finally:
            pg_server.thaw()
        assert await wait_for(lambda: not led.spool.pending(), 15.0)
        assert (await led.usage("t-0")).debited_micros == 400
        assert await led.holds() == []
    finally:
        pg_server.thaw()
        await led.close()


async def test_settlements_written_while_the_drainer_rotates_are_applied_once_each(pg_dsn, tmp_path):
    """Many writers and the drainer at once: every settlement lands in the database exactly
    once (the spool's flock keeps an append from landing in a file already replayed), and
    concurrent writers share fsyncs."""
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    try:
        _, key = await led.create_key("race", 10_000_000)
        n = 600

        async def one(i: int) -> None:
            await led.hold(f"c-{i}", key.key_id, 100, ttl_s=60)
            await led.settle_behind(f"c-{i}", usage_for(f"c-{i}", key.key_id, 7))

        await asyncio.gather(*(one(i) for i in range(n)))
        await led.settled(10)
        assert await wait_for(lambda: not led.spool.pending(), 10)
        rows = await led.list_usage(key.key_id, 10_000)
        assert len(rows) == n and len({r.request_id for r in rows}) == n
        assert (await led.get_key(key.key_id)).balance_micros == 10_000_000 - 7 * n
        assert led.spool.stats["fsyncs"] < n  # group commit: fewer fsyncs than settlements
        assert await led.holds() == []
    finally:
        await led.close()


@pytest.mark.parametrize("crash_after_commit", [True, False])
async def test_a_crash_around_the_drain_replays_without_a_second_debit(pg_dsn, tmp_path, crash_after_commit):
    """The spool file is the truth until the drain's commit and its unlink are both done; a
    process killed between them replays the lines at its next start: nothing twice."""
    section = pg_section(pg_dsn, tmp_path)
    led = open_ledger(section)
    await led.start()
    _, key = await led.create_key("crash", 10_000)
    await led.hold("x-0", key.key_id, 1_000, ttl_s=60)
    led._replayer.cancel()  # no drainer: the line stays as a crash would leave it
    await led.settle_behind("x-0", usage_for("x-0", key.key_id, 300))
    saved = led.spool.path.read_bytes()
    if crash_after_commit:
        await led.replay_spool()  # applied (and unlinked: as if killed before that, the line comes back)
    led.spool.path.write_bytes(b"")  # close() would replay it: the crash does not
    await led.close()
    led.spool.path.write_bytes(saved)
    again = open_ledger(section)
    await again.start()  # replays what it finds before serving
    try:
        assert not again.spool.pending()
        assert (await again.usage("x-0")).debited_micros == 300
        assert (await again.get_key(key.key_id)).balance_micros == 10_000 - 300
        assert all(balance == expected for _, balance, expected in await again.audit())
    finally:
        await again.close()


async def test_a_settlement_the_database_refuses_for_its_data_is_set_aside_alone(pg_dsn, tmp_path):
    """A NUL in a text column (22021) fails its batch: that record goes to <spool>.rejected, the
    others of the batch and after it are applied, and the ledger is in no fault (other keys and
    the CLI's reads go on)."""
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    led.replay_interval_s = 0.2
    try:
        _, key = await led.create_key("data", 10_000)
        for rid in ("d-0", "d-bad", "d-2"):
            await led.hold(rid, key.key_id, 1_000, ttl_s=60)
        bad = UsageRecord("d-bad", key.key_id, "\u0000/tiny-model", 10, 0, 5, 0, 300, "completed")
        await asyncio.gather(led.settle_behind("d-0", usage_for("d-0", key.key_id, 100)),
                             led.settle_behind("d-bad", bad),
                             led.settle_behind("d-2", usage_for("d-2", key.key_id, 200)))
        assert await wait_for(lambda: not led.spool.pending(), 15.0)
        assert (await led.usage("d-0")).debited_micros == 100 and (await led.usage("d-2")).debited_micros == 200
        assert await led.usage("d-bad") is None
        assert any(b'"d-bad"' in line for line in led.spool.rejected())
        assert led.fault is None
        assert (await led.get_key(key.key_id)).balance_micros == 10_000 - 300
        _, other = await led.create_key("other", 5_000)  # the ledger serves on
        await led.hold("o-1", other.key_id, 100, ttl_s=60)
        await led.release("o-1")
        assert [k.name for k in await led.list_keys()] == ["data", "other"]
    finally:
        await led.close()


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs, filled: what a spool on a full file system meets (ENOSPC). Root only."""
    with tiny_tmpfs(tmp_path / "full") as folder:
        fill(folder)
        yield folder


async def test_a_spool_on_a_full_disk_settles_with_the_database_and_says_so(pg_dsn, tmp_path, full_disk):
    from proxy.upstream.health import Readiness

    section = {**pg_section(pg_dsn, tmp_path), "spool_path": str(full_disk / "spool.jsonl")}
    led = open_ledger(section)
    try:
        await led.start()
    except OSError:
        pytest.skip("the spool's folder must be writable at start")
    try:
        _, key = await led.create_key("full", 10_000)
        for i in range(5):
            await led.hold(f"f-{i}", key.key_id, 1_000, ttl_s=60)
            await led.settle_behind(f"f-{i}", usage_for(f"f-{i}", key.key_id, 100))
        for i in range(5):  # billed, each once, straight into the database
            assert (await led.usage(f"f-{i}")).debited_micros == 100
        assert await led.holds() == [] and (await led.get_key(key.key_id)).balance_micros == 9_500
        assert led.spool_fault == "spool_full"

        class App(dict):
            pass

        class Pool:
            workers = [type("W", (), {"available": True})()]

        app = App(ledger=led)
        verdict = await Readiness(Pool(), "ledger").verdict(app)
        assert verdict == (False, "ledger", "spool_full")
    finally:
        await led.close()


async def test_a_hold_whose_reply_was_lost_is_released_when_the_database_answers(pg_dsn, tmp_path):
    """The hold committed, its reply never came (the connection died): the request was answered
    503 and will never settle, so the hold is given back, not left 900 s refusing the key."""
    from proxy.ledger import LedgerUnavailable

    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    led.replay_interval_s = 0.2
    real = led._db
    try:
        _, key = await led.create_key("lost", 10_000)

        async def reply_lost(fn, **kw):
            await real(fn, **kw)  # it ran and committed...
            raise LedgerUnavailable("connection lost", 1.0)  # ...and its answer is gone

        led._db = reply_lost
        with pytest.raises(LedgerUnavailable):
            await led.hold("lost-1", key.key_id, 4_000, ttl_s=900)
        led._db = real
        assert await wait_for(lambda: not led.spool.pending(), 15.0)
        assert await led.holds(key.key_id) == []
        assert await led.available(key.key_id) == 10_000
    finally:
        led._db = real
        await led.close()


async def test_a_release_with_its_key_is_never_overtaken_by_its_hold(pg_dsn, tmp_path):
    """A client that leaves while its hold is in flight: the release may reach the database first.
    It leaves a zero tombstone under the key's row lock, so the late hold is refused, never made."""
    from proxy.ledger import DuplicateRequest

    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    try:
        _, key = await led.create_key("race", 10_000)
        assert await led.release("race-1", key_id=key.key_id) is False  # nothing held yet
        with pytest.raises(DuplicateRequest):
            await led.hold("race-1", key.key_id, 4_000, ttl_s=900)
        assert await led.holds(key.key_id) == [] and await led.available(key.key_id) == 10_000
        await led.hold("race-2", key.key_id, 3_000, ttl_s=900)  # a hold made first is simply dropped
        assert await led.release("race-2", key_id=key.key_id) is True
        assert await led.holds(key.key_id) == [] and await led.available(key.key_id) == 10_000
        # in parallel, many times: whichever lands first, nothing is left held
        for i in range(30):
            rid = f"par-{i}"
            results = await asyncio.gather(led.hold(rid, key.key_id, 100, ttl_s=900),
                                           led.release(rid, key_id=key.key_id), return_exceptions=True)
            assert isinstance(results[0], (DuplicateRequest, type(None))) or results[0].amount_micros == 100
        assert await led.holds(key.key_id) == [] and await led.available(key.key_id) == 10_000
    finally:
        await led.close()


async def test_settlements_of_a_teams_keys_spooled_behind_debit_the_team_once_each(pg_dsn, tmp_path):
    """The spool's drain (settle_batch) on keys under a team: every level debited once per
    settlement, clamped at the team's purse, the money adding up at every level."""
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    try:
        org = await led.create_level("org", {"name": "o", "balance_micros": 100_000})
        team = await led.create_level("team", {"name": "t", "parent_id": org.level_id, "balance_micros": 1_000})
        place = {**await led.placement(team.level_id, None), "own_balance": False}
        keys = [(await led.create_key(f"k{i}", 0, placement=place))[1] for i in range(2)]
        for i in range(6):
            await led.hold(f"s-{i}", keys[i % 2].key_id, 150, ttl_s=60)
        for i in range(6):
            await led.settle_behind(f"s-{i}", usage_for(f"s-{i}", keys[i % 2].key_id, 150 + i * 10))
        await led.settled(10)
        assert await wait_for(lambda: not led.spool.pending(), 15.0)
        debits = [(await led.usage(f"s-{i}")).debited_micros for i in range(6)]
        assert debits == [150] * 6  # each clamped at its own hold
        levels = {lv.level_id: lv.balance_micros for lv in await led.list_levels()}
        assert levels == {org.level_id: 100_000 - 900, team.level_id: 100}
        assert {a[0]: (a[1], a[2]) for a in await led.level_audit()} == {org.level_id: (99_100, 99_100),
                                                                         team.level_id: (100, 100)}
    finally:
        await led.close()
