"""The durable ledger: keys, holds, exactly-once settles, crash durability, pricing, CLI."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from proxy.ledger import (
    UNSET,
    ConsoleReads,
    DuplicateRequest,
    Hold,
    InsufficientBalance,
    KeyRecord,
    KeyStore,
    Ledger,
    LedgerError,
    RequestLedger,
    UnknownKey,
    UsageRecord,
    open_ledger,
)
from proxy.ledger import KeyLimits, key_rules, service
from proxy.ledger.sqlite import ledger as ledger_sqlite
from proxy.ledger.sqlite.writer import Durability
from proxy.ledger.pricing import (
    UNLIMITED,
    Price,
    cost_micros,
    max_output_tokens_for,
    price_for,
)

from tests.conftest import LEDGER_BACKENDS, eventually, ledger_section
from tests.support.paths import REPO

SECRET_RE = re.compile(r"sk-rp-[A-Za-z0-9_-]{32}")


def usage_for(request_id: str, key_id: str, cost: int, status: str = "completed") -> UsageRecord:
    return UsageRecord(request_id, key_id, "tiny-model", 100, 20, 50, 10, cost, status)


@pytest.fixture(params=LEDGER_BACKENDS)
async def ledger(request, tmp_path):
    """A started ledger of each backend (tests/conftest.py): ONE suite, two backends. Tests
    about SQLite itself (its files, the writer thread, group commit) are @sqlite_only."""
    if request.param == "sqlite":
        led = open_ledger({"backend": "sqlite", "path": "ledger.db"}, base_dir=tmp_path)
    else:
        led = open_ledger(ledger_section(request.param, request, tmp_path), base_dir=tmp_path)
    await led.start()
    try:
        yield led
    finally:
        await led.close()


# SQLite only: the test is about SQLite's files, its writer thread or its group commit.
sqlite_only = pytest.mark.parametrize("ledger", ["sqlite"], indirect=True)


def is_sqlite(ledger) -> bool:
    return isinstance(ledger, ledger_sqlite.SQLiteLedger)


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ---------------------------------------------------------------- keys


async def test_create_lookup_revoke(ledger, tmp_path):
    secret, record = await ledger.create_key("alice", 5_000,
                                             limits=KeyLimits(allowed_models=["a", "vendor/b"], concurrency=3,
                                                              rate_per_min=60))
    assert SECRET_RE.fullmatch(secret), secret
    assert isinstance(record, KeyRecord)
    assert record.prefix == secret[:12]
    assert record.balance_micros == 5_000
    assert record.allowed_models == ("a", "vendor/b")
    assert (record.concurrency, record.rate_per_min, record.revoked) == (3, 60, False)
    assert record.allows_model("b") and record.allows_model("x/a") and not record.allows_model("c")

    found = await ledger.lookup_key(secret)
    assert found == record
    if is_sqlite(ledger):
        assert (tmp_path / "ledger.db").exists()  # relative path resolved against base_dir

    other_secret, other = await ledger.create_key("bob")
    assert other.key_id != record.key_id and other_secret != secret
    assert other.allowed_models is None and other.balance_micros == 0

    await ledger.revoke(record.key_id)
    assert (await ledger.lookup_key(secret)).revoked is True  # found, to be refused (auth says why)
    assert (await ledger.get_key(record.key_id)).revoked is True
    assert (await ledger.lookup_key(other_secret)).key_id == other.key_id
    assert [k.key_id for k in await ledger.list_keys()] == [record.key_id, other.key_id]
    with pytest.raises(UnknownKey):
        await ledger.revoke("key_missing")


async def test_secret_is_stored_hashed_only(ledger, tmp_path):
    secret, record = await ledger.create_key("carol", 1)
    if is_sqlite(ledger):
        await ledger.close()
        blob = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("ledger.db"))
    else:  # every column of every key row, the hash as bytes
        rows = await ledger._db(lambda conn: conn.fetch("SELECT row_to_json(k)::text, secret_sha256 FROM keys k"),
                                transaction=False)
        blob = b"".join(r[0].encode() + bytes(r[1]) for r in rows)
    assert secret.encode() not in blob
    assert secret[8:].encode() not in blob  # not even the random part
    assert ledger_sqlite.hash_secret(secret) in blob
    assert secret not in repr(record)


async def test_unknown_secret_takes_the_constant_time_path(ledger, monkeypatch):
    secret, record = await ledger.create_key("dave", 1)
    calls: list[tuple[bytes, bytes]] = []
    real = key_rules.hmac.compare_digest  # both backends decide by key_rules.presented_key

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(key_rules.hmac, "compare_digest", spy)
    assert await ledger.lookup_key("sk-rp-" + "A" * 32) is None
    assert len(calls) == 1  # compared (against a dummy) even though no row matched
    assert await ledger.lookup_key(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert len(calls) == 2
    assert (await ledger.lookup_key(secret)).key_id == record.key_id
    assert len(calls) == 3
    assert calls[-1][0] == calls[-1][1] == ledger_sqlite.hash_secret(secret)
    for bad in ("", None, 123, "\udcff"):
        assert await ledger.lookup_key(bad) is None


async def test_set_limits_and_top_up(ledger):
    _, record = await ledger.create_key("erin", 10,
                                        limits=KeyLimits(allowed_models=["m1"], concurrency=2, rate_per_min=30))
    updated = await ledger.set_limits(record.key_id, KeyLimits(concurrency=None))
    assert (updated.allowed_models, updated.concurrency, updated.rate_per_min) == (("m1",), None, 30)
    updated = await ledger.set_limits(record.key_id, KeyLimits(allowed_models=None, rate_per_min=7))
    assert (updated.allowed_models, updated.concurrency, updated.rate_per_min) == (None, None, 7)
    assert (await ledger.set_limits(record.key_id, KeyLimits())) == updated  # nothing given: nothing changes
    assert await ledger.top_up(record.key_id, 90) == 100
    assert await ledger.top_up(record.key_id, -40) == 60
    with pytest.raises(ValueError):
        await ledger.top_up(record.key_id, -61)
    assert (await ledger.get_key(record.key_id)).balance_micros == 60
    with pytest.raises(UnknownKey):
        await ledger.top_up("key_missing", 1)
    with pytest.raises(UnknownKey):
        await ledger.set_limits("key_missing", KeyLimits(concurrency=1))
    assert UNSET is not None and not UNSET


def test_key_limits_is_one_frozen_value_whose_unset_fields_are_not_given():
    assert KeyLimits().given() == {}
    limits = KeyLimits(concurrency=None, rate_per_min=3, expires_at=UNSET)
    assert limits.given() == {"concurrency": None, "rate_per_min": 3}  # None is given: it clears
    assert limits == KeyLimits(rate_per_min=3, concurrency=None) and hash(limits) == hash(KeyLimits(concurrency=None,
                                                                                                  rate_per_min=3))
    with pytest.raises(AttributeError):  # frozen (dataclasses.FrozenInstanceError is an AttributeError)
        limits.concurrency = 1  # type: ignore[misc]
    assert service.parse_limits({"tokens_per_min": 5}) == KeyLimits(tokens_per_min=5)
    assert service.LIMIT_FIELDS == tuple(KeyLimits.__dataclass_fields__)


async def test_lease_support_is_declared_and_a_ledger_without_it_refuses_lease_calls():
    class Exact(RequestLedger):  # the request path only, no leases: the interface's defaults
        async def lookup_key(self, secret):
            return None

        async def available(self, key_id):
            return 10

        async def hold(self, request_id, key_id, amount_micros, ttl_s):
            return Hold(request_id, key_id, amount_micros, time.time() + ttl_s)

        async def settle(self, request_id, usage, *, linger=True):
            return True

        async def release(self, request_id, *, linger=True):
            return False

        async def expire_holds(self, now=None):
            return 0

        async def spend_since(self, key_id, since):
            return 0

    exact = Exact()
    assert ledger_sqlite.SQLiteLedger.supports_leases and not exact.supports_leases
    assert all(issubclass(Ledger, part) for part in (RequestLedger, KeyStore, ConsoleReads))
    assert (await exact.hold_up_to("r1", "k", 1, 50, 60)).amount_micros == 10
    with pytest.raises(LedgerError):
        await exact.hold_up_to("r2", "k", 1, 50, 60, lease_return=("lease:x", 5))
    with pytest.raises(LedgerError):
        await exact.lease_grow("lease:x", "k", 1, 5, 60)
    with pytest.raises(LedgerError):
        await exact.lease_commit([], [])
    assert not Leases(exact, hold_ttl_s=60).enabled  # so Leases keeps to the exact path


# ---------------------------------------------------------------- holds and settles


async def test_hold_settle_release(ledger):
    _, key = await ledger.create_key("frank", 1_000)
    hold = await ledger.hold("r1", key.key_id, 600, ttl_s=60)
    assert (hold.request_id, hold.key_id, hold.amount_micros) == ("r1", key.key_id, 600)
    assert hold.expires_at > time.time() + 50
    assert await ledger.available(key.key_id) == 400

    with pytest.raises(InsufficientBalance) as info:
        await ledger.hold("r2", key.key_id, 401, ttl_s=60)
    assert info.value.available_micros == 400
    assert key.key_id not in str(info.value)
    await ledger.hold("r2", key.key_id, 400, ttl_s=60)
    assert await ledger.available(key.key_id) == 0

    assert await ledger.release("r2") is True
    assert await ledger.release("r2") is False
    assert await ledger.available(key.key_id) == 400

    record = usage_for("r1", key.key_id, 250)
    assert await ledger.settle("r1", record) is True
    assert record.debited_micros == 250
    assert (await ledger.get_key(key.key_id)).balance_micros == 750
    assert await ledger.available(key.key_id) == 750  # the hold went with the settle
    stored = await ledger.usage("r1")
    assert stored is not None
    counts = (stored.input_tokens, stored.cached_tokens, stored.output_tokens, stored.reasoning_tokens)
    assert counts == (100, 20, 50, 10)
    assert (stored.cost_micros, stored.debited_micros, stored.status) == (250, 250, "completed")
    assert await ledger.usage("nope") is None
    assert await ledger.holds() == []

    with pytest.raises(DuplicateRequest):
        await ledger.hold("r1", key.key_id, 1, ttl_s=60)  # settled ids cannot be held again
    await ledger.hold("r3", key.key_id, 1, ttl_s=60)
    with pytest.raises(DuplicateRequest):
        await ledger.hold("r3", key.key_id, 1, ttl_s=60)
    with pytest.raises(UnknownKey):
        await ledger.hold("r4", "key_missing", 1, ttl_s=60)
    with pytest.raises(ValueError):
        await ledger.settle("r5", usage_for("r5", key.key_id, 1, status="weird"))


async def test_settle_is_exactly_once(ledger):
    _, key = await ledger.create_key("gina", 1_000)
    await ledger.hold("r1", key.key_id, 500, ttl_s=60)
    assert await ledger.settle("r1", usage_for("r1", key.key_id, 300)) is True
    assert await ledger.settle("r1", usage_for("r1", key.key_id, 300)) is False
    assert await ledger.settle("r1", usage_for("r1", key.key_id, 999)) is False
    assert (await ledger.get_key(key.key_id)).balance_micros == 700

    results = await asyncio.gather(*(ledger.settle("r2", usage_for("r2", key.key_id, 100)) for _ in range(20)))
    assert results.count(True) == 1 and results.count(False) == 19
    assert (await ledger.get_key(key.key_id)).balance_micros == 600
    assert len(await ledger.list_usage(key.key_id)) == 2
    assert all(balance == expected for _, balance, expected in await ledger.audit())


async def test_settle_clamps_the_debit_at_the_balance(ledger):
    _, key = await ledger.create_key("hank", 100)
    record = usage_for("r1", key.key_id, 250, status="incomplete")
    assert await ledger.settle("r1", record) is True  # no hold at all: still billed
    assert record.debited_micros == 100
    stored = await ledger.usage("r1")
    assert (stored.cost_micros, stored.debited_micros, stored.status) == (250, 100, "incomplete")
    assert (await ledger.get_key(key.key_id)).balance_micros == 0
    assert await ledger.settle("r2", usage_for("r2", key.key_id, 5)) is True
    assert (await ledger.usage("r2")).debited_micros == 0
    assert (await ledger.get_key(key.key_id)).balance_micros == 0


async def test_200_concurrent_holds_never_overdraw(ledger):
    amount = 1_000
    _, key = await ledger.create_key("ivy", 10 * amount + amount // 2)  # covers exactly 10
    results = await asyncio.gather(
        *(ledger.hold(f"req-{i}", key.key_id, amount, ttl_s=60) for i in range(200)), return_exceptions=True
    )
    held = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(held) == 10
    assert len(refused) == 190 and all(isinstance(r, InsufficientBalance) for r in refused)
    assert all(r.available_micros < amount for r in refused)
    assert await ledger.available(key.key_id) == amount // 2

    before = (await ledger.get_key(key.key_id)).balance_micros
    costs = [97 * (i + 1) for i in range(len(held))]  # uneven, each within its hold
    settled = await asyncio.gather(
        *(ledger.settle(h.request_id, usage_for(h.request_id, key.key_id, c)) for h, c in zip(held, costs))
    )
    assert all(settled)
    after = (await ledger.get_key(key.key_id)).balance_micros
    recorded = sum(u.cost_micros for u in await ledger.list_usage(key.key_id, limit=1000))
    assert before - after == recorded == sum(costs)
    assert await ledger.available(key.key_id) == after
    assert await ledger.holds() == []
    assert all(balance == expected for _, balance, expected in await ledger.audit())


async def test_hold_up_to_holds_what_is_there(ledger):
    _, key = await ledger.create_key("uma", 1_000)
    first = await ledger.hold_up_to("u-1", key.key_id, 100, 600, ttl_s=60)
    assert first.amount_micros == 600  # all of max: it fits
    second = await ledger.hold_up_to("u-2", key.key_id, 100, 600, ttl_s=60)
    assert second.amount_micros == 400  # only what is left, still >= min
    assert await ledger.available(key.key_id) == 0
    with pytest.raises(InsufficientBalance) as info:
        await ledger.hold_up_to("u-3", key.key_id, 1, 10, ttl_s=60)
    assert (info.value.available_micros, info.value.requested_micros) == (0, 1)
    assert await ledger.release("u-2")
    with pytest.raises(InsufficientBalance) as info:  # 400 available, 401 needed
        await ledger.hold_up_to("u-3", key.key_id, 401, 500, ttl_s=60)
    assert info.value.available_micros == 400
    assert {h.request_id for h in await ledger.holds()} == {"u-1"}  # a refusal holds nothing
    with pytest.raises(DuplicateRequest):
        await ledger.hold_up_to("u-1", key.key_id, 1, 1, ttl_s=60)
    assert await ledger.settle("u-1", usage_for("u-1", key.key_id, 250))
    with pytest.raises(DuplicateRequest):  # settled: never held again
        await ledger.hold_up_to("u-1", key.key_id, 1, 1, ttl_s=60)
    with pytest.raises(UnknownKey):
        await ledger.hold_up_to("u-4", "key_missing", 1, 1, ttl_s=60)
    with pytest.raises(ValueError):
        await ledger.hold_up_to("u-5", key.key_id, 10, 9, ttl_s=60)
    zero = await ledger.hold_up_to("u-6", key.key_id, 0, 0, ttl_s=60)
    assert zero.amount_micros == 0
    assert await ledger.available(key.key_id) == 750


@pytest.mark.parametrize("backend", LEDGER_BACKENDS)
@pytest.mark.parametrize("connections", [1, 2, 4])
async def test_hold_up_to_200_concurrent_never_overdraw(tmp_path, connections, backend, request):
    """200 concurrent hold_up_to on one key (also split over several ledger objects on the
    same file, as `serve --workers 2` has, or on one PostgreSQL database, as replicas have):
    the holds never exceed the balance, each is within [min, max], a refusal only when less
    than min was left; settling every hold at its amount takes exactly the sum of the costs
    off the balance."""
    section = ledger_section(backend, request, tmp_path)
    ledgers = [open_ledger(section) for _ in range(connections)]
    for led in ledgers:
        await led.start()
    try:
        initial = 12_345
        _, key = await ledgers[0].create_key("vic", initial)
        low, high = 37, 150

        async def one(i: int):
            led = ledgers[i % connections]
            try:
                return await led.hold_up_to(f"c-{i}", key.key_id, low, high, ttl_s=60)
            except InsufficientBalance as exc:
                assert exc.available_micros < low
                return None

        holds = await asyncio.gather(*(one(i) for i in range(200)))
        held = [h for h in holds if h is not None]
        assert all(low <= h.amount_micros <= high for h in held)
        assert sum(h.amount_micros for h in held) <= initial
        assert initial - sum(h.amount_micros for h in held) < low  # refused only when it was gone
        assert len(held) < 200
        assert await ledgers[0].available(key.key_id) == initial - sum(h.amount_micros for h in held)

        # settle every one (cost = what was held, some a little less), concurrently
        costs = {h.request_id: h.amount_micros - (i % 3) for i, h in enumerate(held)}
        settled = await asyncio.gather(*(
            ledgers[i % connections].settle(rid, usage_for(rid, key.key_id, cost))
            for i, (rid, cost) in enumerate(costs.items())))
        assert all(settled)
        balance = (await ledgers[0].get_key(key.key_id)).balance_micros
        assert balance == initial - sum(costs.values()) >= 0
        usages = await ledgers[0].list_usage(key.key_id, limit=1000)
        assert all(u.debited_micros == u.cost_micros for u in usages)  # nothing clamped: no overdraft
        assert await ledgers[0].holds() == []
        assert all(b == expected for _, b, expected in await ledgers[0].audit())
    finally:
        for led in ledgers:
            await led.close()


@sqlite_only
async def test_holds_commit_at_hold_synchronous_and_the_rest_at_synchronous(ledger):
    """The writer splits a batch: reads and holds in a group committed at hold_synchronous
    (NORMAL: no fsync), everything else at synchronous (FULL), holds first."""
    _, key = await ledger.create_key("wes", 10_000)
    level = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
    gate = threading.Event()
    order: list[str] = []

    def probe(name):
        def fn(conn):
            order.append(name)
            return level[conn.execute("PRAGMA synchronous").fetchone()[0]]
        return fn

    parked = threading.Event()
    blocker = asyncio.ensure_future(ledger._run(lambda conn: parked.set() or gate.wait(10)))
    await eventually(parked.is_set, what="the writer thread parked inside the blocker")
    tasks = [asyncio.ensure_future(c) for c in (
        ledger._run(probe("slow-write")),
        ledger._run(probe("hold-like"), Durability.HOLD),
        ledger.hold_up_to("h-1", key.key_id, 1, 100, ttl_s=60),
        ledger.settle("s-1", usage_for("s-1", key.key_id, 10)),
        ledger._run(probe("read"), Durability.READ),
    )]
    await eventually(lambda: ledger._writer._queue.qsize() >= len(tasks), what="all queued behind the blocker: one batch")
    gate.set()
    slow, fast, hold, settled, read = await asyncio.gather(*tasks)
    await blocker
    assert (fast, read, slow) == ("NORMAL", "NORMAL", "FULL")
    assert order == ["hold-like", "read", "slow-write"]  # the fast group ran first
    assert hold.amount_micros == 100 and settled is True

    strict = open_ledger({"path": ledger.path, "hold_synchronous": "FULL"})
    await strict.start()
    try:
        assert await strict._run(probe("x"), Durability.HOLD) == "FULL"
    finally:
        await strict.close()
    relaxed = open_ledger({"path": ledger.path, "synchronous": "NORMAL", "hold_synchronous": "EXTRA"})
    assert relaxed.hold_synchronous == "NORMAL"  # never stronger than synchronous
    with pytest.raises(LedgerError):
        open_ledger({"path": ledger.path, "hold_synchronous": "SOMETIMES"})


async def test_settles_linger_for_company_but_never_hold_anything_up(tmp_path):
    db = str(tmp_path / "linger.db")
    led = open_ledger({"path": db, "settle_linger_ms": 60_000})
    await led.start()
    try:
        _, key = await led.create_key("liv", 10_000)
        for i in range(3):
            await led.hold(f"l-{i}", key.key_id, 100, ttl_s=60)
        groups = led.stats["groups"]
        settles = [asyncio.ensure_future(led.settle(f"l-{i}", usage_for(f"l-{i}", key.key_id, 10)))
                   for i in range(2)]
        await asyncio.sleep(0.2)  # not a wait: time passes, and the settles linger (nothing is to happen)
        assert not any(t.done() for t in settles)  # lingering: nothing committed yet
        t0 = time.monotonic()
        hold = await led.hold_up_to("other", key.key_id, 1, 50, ttl_s=60)  # not held up by them
        assert hold.amount_micros == 50 and time.monotonic() - t0 < 1
        assert await led.available(key.key_id) == 10_000 - 350  # reads neither
        assert not any(t.done() for t in settles)
        assert await led.top_up(key.key_id, 1) == 10_000 - 20 + 1  # needs an fsync: takes them along
        assert all(t.done() and t.result() for t in settles)
        assert led.stats["groups"] - groups == 3  # the hold's, the read's, ONE for both settles + top-up
        late = asyncio.ensure_future(led.settle("l-2", usage_for("l-2", key.key_id, 10)))
        await asyncio.sleep(0.05)  # not a wait: time passes, and the late settle lingers
        assert not late.done()
    finally:
        await led.close()  # flushes the lingering settle
    assert late.result() is True
    async with open_ledger({"path": db}) as again:
        assert (await again.usage("l-2")).cost_micros == 10
        assert (await again.get_key(key.key_id)).balance_micros == 10_000 - 30 + 1

    quick = open_ledger({"path": db, "settle_linger_ms": 20})
    await quick.start()
    try:
        await quick.hold("q-1", key.key_id, 100, ttl_s=60)
        t0 = time.monotonic()
        assert await quick.settle("q-1", usage_for("q-1", key.key_id, 10))
        assert 0.015 <= time.monotonic() - t0 < 2  # alone: committed once its linger ran out
    finally:
        await quick.close()


async def test_key_generation_moves_on_key_changes(ledger):
    _, key = await ledger.create_key("xan", 10)
    g0 = ledger.key_generation
    await ledger.top_up(key.key_id, 5)
    assert ledger.key_generation == g0  # balances are not part of the cached record's contract
    await ledger.set_limits(key.key_id, KeyLimits(concurrency=3))
    g1 = ledger.key_generation
    assert g1 == g0 + 1 if is_sqlite(ledger) else g1 > g0  # postgres: its own NOTIFY comes back too
    await ledger.revoke(key.key_id)
    assert ledger.key_generation == g1 + 1 if is_sqlite(ledger) else ledger.key_generation > g1


async def test_hold_expiry(ledger):
    _, key = await ledger.create_key("jack", 1_000)
    await ledger.hold("short", key.key_id, 700, ttl_s=1.0)
    await ledger.hold("long", key.key_id, 200, ttl_s=600)
    assert await ledger.available(key.key_id) == 100
    with pytest.raises(InsufficientBalance):
        await ledger.hold("x", key.key_id, 500, ttl_s=60)
    await asyncio.sleep(1.1)  # not a wait: the short hold's ttl passes
    assert await ledger.available(key.key_id) == 800  # an expired hold no longer counts...
    assert {h.request_id for h in await ledger.holds()} == {"short", "long"}  # ...though still a row
    assert await ledger.expire_holds() == 1
    assert {h.request_id for h in await ledger.holds()} == {"long"}
    assert await ledger.expire_holds(now=time.time() + 601) == 1
    assert await ledger.holds() == []
    assert await ledger.available(key.key_id) == 1_000
    assert (await ledger.get_key(key.key_id)).balance_micros == 1_000  # expiry never charges


@sqlite_only
async def test_one_failing_operation_does_not_fail_its_group(ledger):
    _, key = await ledger.create_key("kate", 1_000)
    gate = threading.Event()

    def half_done(conn):  # writes, then fails: its write must be rolled back, alone
        conn.execute("UPDATE keys SET balance_micros = 0 WHERE key_id = ?", (key.key_id,))
        conn.execute("INSERT INTO holds VALUES ('partial', ?, 1, 9e18)", (key.key_id,))
        raise RuntimeError("boom")

    parked = threading.Event()
    blocker = asyncio.ensure_future(ledger._run(lambda conn: parked.set() or gate.wait(10)))
    await eventually(parked.is_set, what="the writer thread parked inside the blocker")
    ops = [
        ledger.hold("ok-1", key.key_id, 100, ttl_s=60),
        ledger.hold("bad-1", "key_missing", 100, ttl_s=60),
        ledger.hold("bad-2", key.key_id, 10_000, ttl_s=60),
        ledger.settle("ok-2", usage_for("ok-2", key.key_id, 50)),
        ledger._run(lambda conn: conn.execute("INSERT INTO holds VALUES ('bad-3', 'key_missing', 1, 0)")),
        ledger.top_up(key.key_id, 5),
        ledger._run(half_done),
    ]
    tasks = [asyncio.ensure_future(op) for op in ops]
    await eventually(lambda: ledger._writer._queue.qsize() >= len(ops), what="every op queued behind the blocker")
    groups_before = ledger.stats["groups"]
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await blocker
    # One batch, committed as two groups: the three holds (no fsync), then the other four.
    assert ledger.stats["max_group"] >= 4
    assert ledger.stats["groups"] - groups_before <= 3  # the blocker's, the holds', the rest
    assert results[0].request_id == "ok-1"
    assert isinstance(results[1], UnknownKey)
    assert isinstance(results[2], InsufficientBalance)
    assert results[3] is True
    assert isinstance(results[4], sqlite3.IntegrityError)  # foreign key refused, rolled back alone
    assert results[5] == 955
    assert isinstance(results[6], RuntimeError)
    assert {h.request_id for h in await ledger.holds()} == {"ok-1"}
    assert (await ledger.get_key(key.key_id)).balance_micros == 955


@sqlite_only
async def test_a_failing_operation_alone_in_its_group_is_rolled_back(ledger):
    """A group of one op runs without a savepoint: its failure must roll back the whole
    transaction instead of committing what it wrote before failing."""
    _, key = await ledger.create_key("lou", 1_000)

    def half_done(conn):
        conn.execute("UPDATE keys SET balance_micros = 0 WHERE key_id = ?", (key.key_id,))
        conn.execute("INSERT INTO holds VALUES ('partial', ?, 1, 9e18)", (key.key_id,))
        raise RuntimeError("boom")

    groups = ledger.stats["groups"]
    with pytest.raises(RuntimeError):
        await ledger._run(half_done)
    assert ledger.stats["groups"] == groups + 1  # it did run alone
    assert (await ledger.get_key(key.key_id)).balance_micros == 1_000
    assert await ledger.holds() == []
    # an atomic op (a hold) failing alone leaves nothing behind either
    with pytest.raises(InsufficientBalance):
        await ledger.hold_up_to("too-much", key.key_id, 1_001, 2_000, ttl_s=60)
    assert await ledger.holds() == [] and await ledger.available(key.key_id) == 1_000


async def test_close_finishes_queued_operations_then_refuses(tmp_path):
    led = open_ledger({"path": str(tmp_path / "l.db")})
    with pytest.raises(LedgerError):
        await led.available("x")  # not started
    await led.start()
    _, key = await led.create_key("liam", 10_000)
    tasks = [asyncio.ensure_future(led.hold(f"h{i}", key.key_id, 1, ttl_s=60)) for i in range(100)]
    await asyncio.sleep(0)
    await led.close()
    assert all(t.done() and not t.exception() for t in tasks)
    await led.close()  # idempotent
    with pytest.raises(LedgerError):
        await led.available(key.key_id)
    led2 = open_ledger({"path": str(tmp_path / "l.db")})
    async with led2:
        assert await led2.available(key.key_id) == 10_000 - 100
    with pytest.raises(LedgerError):
        open_ledger({"backend": "carrier-pigeon"})


async def test_start_fails_cleanly_on_an_unusable_path(tmp_path):
    (tmp_path / "file").write_text("x")
    led = open_ledger({"path": str(tmp_path / "file" / "sub" / "l.db")})
    with pytest.raises(LedgerError):
        await led.start()


# ---------------------------------------------------------------- durability across SIGKILL

CRASH_CHILD = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys
    from proxy.ledger import open_ledger, UsageRecord

    async def main(section, key_id):
        led = open_ledger(json.loads(section))
        await led.start()
        for i in range(5):
            rid = f"done-{i}"
            await led.hold(rid, key_id, 1_000, ttl_s=60)
            assert await led.settle(rid, UsageRecord(rid, key_id, "m", 10, 0, 5, 0, 100 + i, "completed"))
        for i in range(5):  # committed without fsync (hold_synchronous): still survive a SIGKILL
            if i % 2:
                await led.hold_up_to(f"open-{i}", key_id, 1, 2_000, ttl_s=60)
            else:
                await led.hold(f"open-{i}", key_id, 2_000, ttl_s=60)
        # In flight when the process dies: each must end up all there or not there at all.
        for i in range(50):
            asyncio.ensure_future(led.settle(f"inflight-{i}",
                                             UsageRecord(f"inflight-{i}", key_id, "m", 1, 0, 1, 0, 7, "completed")))
        await asyncio.sleep(0)
        print("READY", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(30)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def _killed_child(tmp_path, source: str, section: dict | None = None):
    """A key with 1,000,000 micros, then a child process that runs `source` on the same
    database and SIGKILLs itself after printing READY; -> (the reopened ledger, the key)."""
    section = section or {"path": str(tmp_path / "crash.db")}
    led = open_ledger(section)
    await led.start()
    _, key = await led.create_key("mia", 1_000_000)
    await led.close()
    script = tmp_path / "child.py"
    script.write_text(source)
    proc = subprocess.run([sys.executable, str(script), json.dumps(section), key.key_id], capture_output=True,
                          text=True, timeout=60, env=subprocess_env())
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "READY" in proc.stdout
    led = open_ledger(section)
    await led.start()  # start() expires only holds whose ttl has passed
    return led, key


@pytest.mark.parametrize("backend", LEDGER_BACKENDS)
async def test_durability_across_a_process_kill(tmp_path, backend, request):
    section = None if backend == "sqlite" else ledger_section(backend, request, tmp_path)
    led, key = await _killed_child(tmp_path, CRASH_CHILD, section)  # the child's holds have not expired yet
    try:
        done = [await led.usage(f"done-{i}") for i in range(5)]
        assert all(u is not None and u.status == "completed" for u in done)
        assert [u.cost_micros for u in done] == [100, 101, 102, 103, 104]
        inflight = [u for u in await led.list_usage(key.key_id, limit=1000) if u.request_id.startswith("inflight-")]
        balance = (await led.get_key(key.key_id)).balance_micros
        assert balance == 1_000_000 - sum(range(100, 105)) - 7 * len(inflight)
        assert all(b == expected for _, b, expected in await led.audit())  # nothing half-applied
        open_holds = await led.holds(key.key_id)
        assert sorted(h.request_id for h in open_holds) == [f"open-{i}" for i in range(5)]
        assert await led.available(key.key_id) == balance - 5 * 2_000

        assert await led.expire_holds(now=time.time() + 61) == 5
        assert await led.holds() == []
        assert await led.available(key.key_id) == balance

        again = UsageRecord("done-0", key.key_id, "m", 10, 0, 5, 0, 100, "completed")
        assert await led.settle("done-0", again) is False
        with pytest.raises(DuplicateRequest):
            await led.hold("done-1", key.key_id, 1, ttl_s=60)
        assert (await led.get_key(key.key_id)).balance_micros == balance  # no double charge
    finally:
        await led.close()


# ---------------------------------------------------------------- group commit throughput


@sqlite_only
async def test_group_commit_throughput(ledger):
    n = 5_000
    _, key = await ledger.create_key("nora", 10**12)
    start_groups = ledger.stats["groups"]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(ledger.settle(f"t-{i}", usage_for(f"t-{i}", key.key_id, 3)) for i in range(n)))
    elapsed = time.perf_counter() - t0
    groups = ledger.stats["groups"] - start_groups
    assert all(results)
    assert (await ledger.get_key(key.key_id)).balance_micros == 10**12 - 3 * n
    assert groups < n / 10  # many operations per commit, or there is no group commit

    m = 200
    t1 = time.perf_counter()
    for i in range(m):
        await ledger.settle(f"s-{i}", usage_for(f"s-{i}", key.key_id, 3))
    serial = time.perf_counter() - t1
    print(
        f"\nledger group commit: {n} concurrent settles in {elapsed:.3f}s = {n / elapsed:,.0f} ops/s"
        f" ({groups} commits, {n / groups:.0f} ops/commit, synchronous=FULL);"
        f" one-at-a-time: {m / serial:,.0f} ops/s"
    )


# ---------------------------------------------------------------- pricing

PRICES = {
    "default": {"input": 500_000, "cached_input": 100_000, "output": 1_500_000},
    "Qwen/Qwen3-8B": {"input": 200_000, "output": 600_000},
    "tiny-model": {"input": 1, "cached_input": 0, "output": 3},
}


def test_price_for_matching():
    assert price_for(PRICES, "Qwen/Qwen3-8B") == Price(200_000, 200_000, 600_000)  # cached defaults to input
    assert price_for(PRICES, "Qwen3-8B") == Price(200_000, 200_000, 600_000)  # key has the vendor prefix
    assert price_for(PRICES, "someone/tiny-model") == Price(1, 0, 3)  # model has the vendor prefix
    assert price_for(PRICES, "unknown") == Price(500_000, 100_000, 1_500_000)
    assert price_for({}, "x") == Price(500_000, 100_000, 1_500_000)
    assert price_for({"default": {"input": 1.0, "output": 2}}, "x") == Price(1, 1, 2)
    with pytest.raises(ValueError):
        price_for({"default": {"input": 0.5, "output": 1}}, "x")
    with pytest.raises(ValueError):
        price_for({"m": {"input": -1, "output": 1}}, "m")


def test_cost_is_integer_and_rounds_up():
    p = Price(input=500_000, cached_input=100_000, output=1_500_000)
    assert cost_micros(p, 0, 0, 0) == 0
    assert cost_micros(p, 1, 0, 0) == 1  # 0.5 micro rounds up
    assert cost_micros(p, 2, 0, 0) == 1  # exactly 1
    assert cost_micros(p, 3, 0, 0) == 2  # 1.5 -> 2
    assert cost_micros(p, 1_000_000, 0, 0) == 500_000
    assert cost_micros(p, 1_000, 400, 100) == (600 * 500_000 + 400 * 100_000 + 100 * 1_500_000 + 999_999) // 1_000_000
    assert cost_micros(p, 10, 50, 0) == 1  # cached is clamped to input: 10 * 0.1 micro -> 1
    big = 10**15
    assert cost_micros(p, big, 0, big) == big * 2  # exact at any size (no floats)
    assert isinstance(cost_micros(p, 7, 3, 5), int)
    with pytest.raises(ValueError):
        cost_micros(p, -1, 0, 0)
    with pytest.raises(ValueError):
        cost_micros(p, 1.5, 0, 0)


def test_max_output_tokens_is_the_exact_inverse():
    p = Price(input=500_000, cached_input=100_000, output=1_500_000)
    for budget in (0, 1, 2, 3, 10, 999, 12_345):
        for inp, cached in ((0, 0), (1, 0), (7, 3), (100, 100), (20_000, 5_000)):
            n = max_output_tokens_for(p, budget, inp, cached)
            if cost_micros(p, inp, cached, 0) > budget:
                assert n == 0
                continue
            assert cost_micros(p, inp, cached, n) <= budget
            assert cost_micros(p, inp, cached, n + 1) > budget
    assert max_output_tokens_for(p, 1_500_000, 0, 0) == 1_000_000
    assert max_output_tokens_for(Price(1, 1, 0), 10, 5, 0) == UNLIMITED
    assert max_output_tokens_for(Price(1, 1, 0), 0, 5_000_000, 0) == 0


# ---------------------------------------------------------------- CLI end to end


def run_cli(db: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "proxy.ledger.cli", "--db", str(db), "keys", *args],
        capture_output=True, text=True, timeout=60, env=subprocess_env(), cwd=str(db.parent),
    )


async def test_cli_end_to_end(tmp_path):
    db = tmp_path / "cli.db"
    created = run_cli(db, "create", "ops-team", "--balance-usd", "1.50", "--models", "a,b", "--concurrency", "4",
                      "--rate", "90")
    assert created.returncode == 0, created.stderr
    secrets_found = SECRET_RE.findall(created.stdout)
    assert len(secrets_found) == 1
    secret = secrets_found[0]
    key_id = re.search(r"key_id:\s+(key_[0-9a-f]+)", created.stdout).group(1)

    led = open_ledger({"path": str(db)})
    async with led:
        record = await led.lookup_key(secret)
        assert record is not None and record.key_id == key_id
        assert record.balance_micros == 1_500_000
        assert (record.allowed_models, record.concurrency, record.rate_per_min) == (("a", "b"), 4, 90)

    listed = run_cli(db, "list")
    assert listed.returncode == 0 and key_id in listed.stdout and "ops-team" in listed.stdout
    assert secret not in listed.stdout and secret[8:] not in listed.stdout
    assert "sk-rp-" in listed.stdout  # the prefix is shown
    listed_json = run_cli(db, "list", "--json")
    assert secret[8:] not in listed_json.stdout
    assert json.loads(listed_json.stdout)[0]["key_id"] == key_id

    topped = run_cli(db, "topup", key_id, "500000")
    assert topped.returncode == 0 and "2000000" in topped.stdout
    limited = run_cli(db, "limits", key_id, "--models", "*", "--concurrency", "none", "--rate", "10", "--json")
    assert limited.returncode == 0, limited.stderr
    data = json.loads(limited.stdout)
    assert (data["allowed_models"], data["concurrency"], data["rate_per_min"]) == (None, None, 10)

    led = open_ledger({"path": str(db)})
    async with led:
        await led.settle("cli-req", usage_for("cli-req", key_id, 1234))
    usage = run_cli(db, "usage", "--key", key_id, "--json")
    assert usage.returncode == 0
    rows = json.loads(usage.stdout)
    assert [(r["request_id"], r["cost_micros"], r["debited_micros"]) for r in rows] == [("cli-req", 1234, 1234)]
    assert "cli-req" in run_cli(db, "usage").stdout

    missing = run_cli(db, "topup", "key_nope", "1")
    assert missing.returncode == 1 and "key_nope" in missing.stderr

    revoked = run_cli(db, "revoke", key_id)
    assert revoked.returncode == 0
    led = open_ledger({"path": str(db)})
    async with led:
        assert (await led.lookup_key(secret)).revoked is True
    every_output = "".join(p.stdout + p.stderr for p in (listed, listed_json, topped, limited, usage, missing, revoked))
    assert secret[8:] not in every_output


async def test_cli_reads_and_takes_dollars(tmp_path):
    """Every amount the CLI prints for a person is in dollars ($, exact), its JSON keeps micros;
    `topup --usd` takes dollars as `create --balance-usd` does."""
    db = tmp_path / "usd.db"
    created = run_cli(db, "create", "team", "--balance-usd", "1.50", "--daily-budget", "2000000")
    assert created.returncode == 0, created.stderr
    assert "balance: $1.50 (1500000 micros)" in created.stdout
    key_id = re.search(r"key_id:\s+(key_[0-9a-f]+)", created.stdout).group(1)
    topped = run_cli(db, "topup", key_id, "--usd", "2.25")
    assert topped.returncode == 0, topped.stderr
    assert f"{key_id}: +$2.25, balance $3.75 (3750000 micros)" in topped.stdout
    corrected = run_cli(db, "topup", key_id, "--usd", "-0.000001", "--json")
    assert json.loads(corrected.stdout) == {"key_id": key_id, "balance_micros": 3_749_999}
    assert "+$0.000001, balance $3.75 (3750000 micros)" in run_cli(db, "topup", key_id, "1").stdout  # micros
    for bad in (["--usd", "0.0000001"], ["--usd", "lots"], ["5", "--usd", "1"], []):
        refused = run_cli(db, "topup", key_id, *bad)
        assert refused.returncode != 0 and refused.stdout == "", bad
    listed = run_cli(db, "list")
    assert "BALANCE_USD" in listed.stdout and "$3.75 " in listed.stdout and "$2.00/-" in listed.stdout
    shown = run_cli(db, "show", key_id)
    assert "balance: $3.75 (3750000 micros)" in shown.stdout
    led = open_ledger({"path": str(db)})
    async with led:
        await led.settle("usd-req", usage_for("usd-req", key_id, 1234))
    usage = run_cli(db, "usage").stdout
    assert "COST_USD" in usage and "$0.001234" in usage
    totals = run_cli(db, "usage", "--group-by", "key").stdout
    assert "COST_USD" in totals and "$0.001234" in totals
    assert json.loads(run_cli(db, "usage", "--json").stdout)[0]["cost_micros"] == 1234


def test_cli_resolves_a_relative_path_like_the_app(tmp_path):
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    (conf_dir / "config.yaml").write_text("ledger:\n  path: state/keys.db\n")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.ledger.cli", "--config", str(conf_dir / "config.yaml"), "keys", "create", "x"],
        capture_output=True, text=True, timeout=60, env=subprocess_env(), cwd=str(elsewhere),
    )
    assert proc.returncode == 0, proc.stderr
    assert (conf_dir / "state" / "keys.db").exists()  # beside the config, where the app looks
    assert not (elsewhere / "state").exists()


# ---------------------------------------------------------------- balance leases (proxy/ledger/lease.py)

from proxy.ledger.lease import LeaseHold, Leases  # noqa: E402


async def _lease_traffic(leases: Leases, key_id: str, n: int, concurrency: int, prefix: str,
                         low: int = 100, high: int = 1_000, cost=None, on_hold=None) -> list:
    """n hold -> settle cycles, `concurrency` at a time; returns the holds (None for a 402)."""
    todo = iter(range(n))
    got: list = []

    async def worker() -> None:
        for i in todo:
            request_id = f"{prefix}-{i}"
            try:
                hold = await leases.hold_up_to(request_id, key_id, low, high)
            except InsufficientBalance:
                got.append(None)
                continue
            if on_hold is not None:
                on_hold(hold)
            got.append(hold)
            await asyncio.sleep(0)
            amount = hold.amount_micros if cost is None else min(hold.amount_micros, cost(i))
            if on_hold is not None:
                on_hold(hold, amount)
            leases.finish(hold, usage_for(request_id, key_id, amount))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return got


async def test_lease_burst_balance_decrease_equals_costs(ledger):
    """A concurrent burst served from a lease: balance decrease == sum of recorded costs,
    every request recorded exactly once, nothing clamped, no hold left once quiet."""
    _, key = await ledger.create_key("burst", 100_000_000)
    leases = Leases(ledger, hold_ttl_s=60, min_rate=4)
    holds = await _lease_traffic(leases, key.key_id, 3000, 64, "b", cost=lambda i: 100 + i % 900)
    await leases.flush()
    assert leases.stats["lease_holds"] > 2000, leases.stats  # the lease really served most of them
    assert any(isinstance(h, LeaseHold) for h in holds)
    # Without the lease each request is two writer trips (6,000); leased usage rows are batched
    # every lease_commit_ms, so the count grows with wall time: a loaded machine needs more batches.
    if is_sqlite(ledger):
        assert ledger.stats["ops"] < 1500
    used = await ledger.list_usage(key.key_id, limit=10_000)
    assert len(used) == 3000 and len({u.request_id for u in used}) == 3000
    assert all(u.debited_micros == u.cost_micros for u in used)
    balance = (await ledger.get_key(key.key_id)).balance_micros
    assert 100_000_000 - balance == sum(u.cost_micros for u in used) == sum(100 + i % 900 for i in range(3000))
    lease_rows = [h for h in await ledger.holds(key.key_id) if h.request_id.startswith("lease:")]
    assert len(lease_rows) == 1 and lease_rows[0].amount_micros > 0  # a lease is a real hold row
    state = leases._keys[key.key_id]
    assert state.held == state.queued == 0
    assert lease_rows[0].amount_micros == state.free  # the row reserves exactly the lease's free part
    assert await ledger.available(key.key_id) == balance - lease_rows[0].amount_micros
    await leases.quiesce()  # idle: the lease is given back
    assert await ledger.holds() == []
    assert await ledger.available(key.key_id) == balance
    assert all(b == expected for _, b, expected in await ledger.audit())
    await leases.close()


async def test_leased_rows_commit_by_count_as_well_as_by_time(ledger):
    """balance.lease_commit_rows: with a commit interval far longer than the test, a commit
    still comes as soon as that many leased rows wait, and exactly one per that many (the
    count of commits follows the requests, not the clock: what bench.instructions relies on)."""
    _, key = await ledger.create_key("rows", 100_000_000)
    # Never idle within the test (a lease given back commits its queue): a busy PostgreSQL may
    # take longer than lease_idle_s to finish the commits the count started.
    leases = Leases(ledger, hold_ttl_s=60, min_rate=1, idle_s=3600, linger_s=3600, commit_rows=10)
    await _lease_traffic(leases, key.key_id, 400, 1, "r", cost=lambda i: 100)
    leased = leases.stats["lease_holds"]
    assert leased > 300, leases.stats
    assert leases.stats["commits"] == leased // 10  # started as the tenth row came
    assert len(leases._queue) == leased % 10  # the rest waits for the next ten (or the hour)
    want = 400 - leased % 10  # the exact path's rows and the committed leased ones
    async def committed():  # the commits the count started, to their end (a busy PostgreSQL is slower)
        return len(await ledger.list_usage(key.key_id, limit=10_000)) >= want

    await eventually(committed, what=f"{want} usage rows committed")
    assert len(await ledger.list_usage(key.key_id, limit=10_000)) == want
    await leases.flush()
    assert len(await ledger.list_usage(key.key_id, limit=10_000)) == 400
    await leases.close()


@pytest.mark.parametrize("backend", LEDGER_BACKENDS)
async def test_leases_on_two_connections_never_overdraw(tmp_path, backend, request):
    """Two ledgers (two connections, two writer threads, two event loops: what two worker
    processes are) on one file, each with its own leases, hammer one key whose balance
    covers a fraction of the requests. At no moment do the holds granted by both exceed
    what the balance still has; every cost is debited in full; the sums add up."""
    section = ledger_section(backend, request, tmp_path)
    setup = open_ledger(section)
    await setup.start()
    initial = 400_000
    _, key = await setup.create_key("shared", initial)
    await setup.close()
    lock = threading.Lock()
    book = {"out": 0, "spent": 0, "worst": 0, "granted": 0}

    def on_hold(hold, cost=None):
        with lock:
            if cost is None:
                book["out"] += hold.amount_micros
                book["granted"] += 1
            else:
                book["out"] -= hold.amount_micros
                book["spent"] += cost
            book["worst"] = max(book["worst"], book["out"] + book["spent"] - initial)

    errors: list[BaseException] = []

    def side(name: str) -> None:
        async def run() -> None:
            led = open_ledger({**section, "settle_linger_ms": 2})
            await led.start()
            try:
                leases = Leases(led, hold_ttl_s=60, min_rate=2, max_micros=200_000)
                # first plenty (leases grow), then the key runs dry (exact path, 402s)
                await _lease_traffic(leases, key.key_id, 1500, 32, name, low=500, high=1_000,
                                     on_hold=on_hold)
                await leases.close()
            finally:
                await led.close()

        try:
            asyncio.run(run())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=side, args=(name,)) for name in ("p1", "p2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert book["worst"] <= 0, f"holds exceeded the balance by {book['worst']}"
    led = open_ledger(section)
    await led.start()
    try:
        used = await led.list_usage(key.key_id, limit=10_000)
        assert len(used) == book["granted"] >= initial // 1_000
        assert all(u.debited_micros == u.cost_micros for u in used)  # never clamped: no overdraft
        balance = (await led.get_key(key.key_id)).balance_micros
        assert initial - balance == sum(u.cost_micros for u in used) == book["spent"]
        assert balance < 1_000  # the key was really drained to the end
        assert await led.holds() == []
        assert all(b == expected for _, b, expected in await led.audit())
    finally:
        await led.close()


async def test_a_balance_smaller_than_a_lease_gets_exact_holds(ledger):
    """A key whose balance covers less than two requests never has it locked in a lease (a
    grow takes at most available // 2, and only when that covers one request like the
    current one): every hold is an exact per-request hold row, the last one a partial hold.
    Below two requests, so that no timing of the grow can make a lease allowed."""
    _, key = await ledger.create_key("small", 1_500)
    leases = Leases(ledger, hold_ttl_s=60, min_rate=1)
    seen: list = []
    for round_ in range(3):  # plenty of requests per second: a lease would be wanted
        holds = await _lease_traffic(leases, key.key_id, 20, 8, f"s{round_}", low=100, high=1_000, cost=lambda i: 0)
        seen += holds
    assert leases.stats["lease_holds"] == 0
    assert not any(isinstance(h, LeaseHold) for h in seen)
    assert all(not h.request_id.startswith("lease:") for h in await ledger.holds())
    got = [h for h in seen if h is not None]
    assert {h.amount_micros for h in got} == {1_000, 500}  # 1000 + a partial 500, each round
    await leases.flush()
    # and with a real spend, to the last micro: nothing overdrawn, the sums add up
    holds = await _lease_traffic(leases, key.key_id, 50, 8, "spend", low=100, high=1_000)
    await leases.flush()
    used = [u for u in await ledger.list_usage(key.key_id, limit=1000) if u.request_id.startswith("spend")]
    assert sum(u.cost_micros for u in used) == 1_500 - (await ledger.get_key(key.key_id)).balance_micros
    assert sum(h.amount_micros for h in holds if h) == sum(u.cost_micros for u in used)
    assert all(u.debited_micros == u.cost_micros for u in used)
    await leases.close()


LEASE_CRASH_CHILD = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys
    from proxy.ledger import open_ledger, UsageRecord
    from proxy.ledger.lease import Leases, LeaseHold

    async def main(section, key_id):
        led = open_ledger(json.loads(section))
        await led.start()
        leases = Leases(led, hold_ttl_s=1, min_rate=2)
        for i in range(200):  # steady traffic: a lease is granted and used
            h = await leases.hold_up_to(f"done-{i}", key_id, 100, 1000)
            leases.finish(h, UsageRecord(f"done-{i}", key_id, "m", 1, 0, 1, 0, 100, "completed"))
            await asyncio.sleep(0)
        await leases.flush()  # these 200 are committed
        inflight = [await leases.hold_up_to(f"open-{i}", key_id, 100, 1000) for i in range(5)]
        assert all(isinstance(h, LeaseHold) for h in inflight), inflight
        print("READY", leases.stats["lease_holds"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.parametrize("backend", LEDGER_BACKENDS)
async def test_lease_expiry_after_sigkill_releases_the_reservation(tmp_path, backend, request):
    section = None if backend == "sqlite" else ledger_section(backend, request, tmp_path)
    led, key = await _killed_child(tmp_path, LEASE_CRASH_CHILD, section)
    try:
        balance = (await led.get_key(key.key_id)).balance_micros
        assert balance == 1_000_000 - 200 * 100  # every committed settle, once
        rows = await led.holds(key.key_id)
        assert len(rows) == 1 and rows[0].request_id.startswith("lease:")  # the dead process's lease
        assert rows[0].amount_micros >= 5 * 1000  # it still covers the requests that were in flight
        assert await led.available(key.key_id) == balance - rows[0].amount_micros
        await asyncio.sleep(max(0.0, rows[0].expires_at - time.time()) + 0.05)  # not a wait: the lease's expiry passes
        assert await led.available(key.key_id) == balance  # expired: it reserves nothing any more
        assert await led.expire_holds() == 1
        assert await led.holds() == []
        assert all(b == expected for _, b, expected in await led.audit())
        assert [u for u in await led.list_usage(key.key_id) if u.request_id.startswith("open-")] == []
    finally:
        await led.close()
