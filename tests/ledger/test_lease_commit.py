"""SQLiteLedger.lease_commit: exactly-once usage rows, debits clamped at the balance, and the
lease rows, against a model of its contract (one row at a time, in order). The writer
inserts a batch with one executemany when no balance runs out and row by row when one
does: both paths, and the rows already recorded / twice in a batch, must agree with it."""

from __future__ import annotations

import random
import time

import pytest

from proxy.ledger import UnknownKey, UsageRecord
from tests.ledger.test_ledger import ledger  # noqa: F401  (the same temp-file ledger fixture)


def usage(request_id: str, key_id: str, cost, **changes) -> UsageRecord:
    record = UsageRecord(request_id, key_id, "tiny-org/tiny-model", 100, 20, 50, 10, cost, "completed", 1234.5)
    for name, value in changes.items():
        setattr(record, name, value)
    return record


class Model:
    """lease_commit's contract, one usage at a time."""

    def __init__(self, balances: dict[str, int], leases: dict[str, int]) -> None:
        self.balances = dict(balances)
        self.leases = dict(leases)
        self.recorded: dict[str, int] = {}  # request id -> debited

    def commit(self, usages: list[tuple[str, UsageRecord]]) -> list:
        results: list = []
        taken: dict[str, int] = {}
        for lease_id, u in usages:
            if not u.request_id:
                results.append(ValueError)
            elif not (isinstance(u.cost_micros, int) and u.cost_micros >= 0):
                results.append(ValueError)
            elif u.key_id not in self.balances:
                results.append(UnknownKey)
            elif u.request_id in self.recorded:
                results.append(None)
            else:
                debit = min(u.cost_micros, self.balances[u.key_id])
                self.balances[u.key_id] -= debit
                self.recorded[u.request_id] = debit
                taken[lease_id] = taken.get(lease_id, 0) + debit
                results.append(debit)
        for lease_id, total in taken.items():
            self.leases[lease_id] = max(0, self.leases[lease_id] - total)
        return results


async def check_against_model(ledger, model: Model, usages) -> None:
    results, lapsed = await ledger.lease_commit(usages, [])
    expected = model.commit(usages)
    assert lapsed == set()
    assert len(results) == len(expected)
    for (_, u), got, want in zip(usages, results, expected):
        if isinstance(want, type):
            assert isinstance(got, want), (u, got)
        else:
            assert got == want, (u, got, want)
            if isinstance(want, int):
                assert u.debited_micros == want
    for key_id, balance in model.balances.items():
        assert (await ledger.get_key(key_id)).balance_micros == balance
    rows = {h.request_id: h.amount_micros for h in await ledger.holds()}
    assert rows == model.leases
    for request_id, debited in model.recorded.items():
        assert (await ledger.usage(request_id)).debited_micros == debited
    assert all(balance == expected for _, balance, expected in await ledger.audit())


async def setup(ledger, balances: list[int]) -> tuple[list[str], Model]:
    keys = []
    leases = {}
    for n, balance in enumerate(balances):
        _, record = await ledger.create_key(f"k{n}", balance)
        keys.append(record.key_id)
        lease_id = f"lease:test:{record.key_id}:1"
        granted, _ = await ledger.lease_grow(lease_id, record.key_id, 0, balance // 2, 600, share=1)
        leases[lease_id] = granted
    return keys, Model(dict(zip(keys, balances)), leases)


async def test_a_batch_with_rows_recorded_before_and_twice(ledger):
    (key,), model = await setup(ledger, [10_000])
    lease = f"lease:test:{key}:1"
    await check_against_model(ledger, model, [(lease, usage("a", key, 10)), (lease, usage("b", key, 20))])
    # "b" again (a retried commit), "c" twice in one batch, then new ones.
    await check_against_model(ledger, model, [
        (lease, usage("c", key, 5)), (lease, usage("b", key, 99)), (lease, usage("c", key, 7)),
        (lease, usage("d", key, 1)), (lease, usage("a", key, 3)),
    ])
    assert (await ledger.usage("c")).cost_micros == 5  # the first of the two
    # Nothing new at all: every row recorded already.
    await check_against_model(ledger, model, [(lease, usage("a", key, 1)), (lease, usage("d", key, 1))])


async def test_a_balance_running_out_clamps_in_order(ledger):
    (key,), model = await setup(ledger, [100])
    lease = f"lease:test:{key}:1"
    await check_against_model(ledger, model, [(lease, usage("x", key, 30))])
    await check_against_model(ledger, model, [
        (lease, usage("y", key, 40)), (lease, usage("x", key, 50)),  # recorded: takes nothing
        (lease, usage("z", key, 50)), (lease, usage("w", key, 10)),
    ])
    assert [(await ledger.usage(r)).debited_micros for r in "xyzw"] == [30, 40, 30, 0]


async def test_invalid_rows_and_unknown_keys_fail_alone(ledger):
    (key,), model = await setup(ledger, [1_000])
    lease = f"lease:test:{key}:1"
    usages = [
        (lease, usage("ok1", key, 10)),
        (lease, usage("", key, 10)),
        (lease, usage("neg", key, -1)),
        (lease, usage("ghost", "key_nope", 10)),
        (lease, usage("ok2", key, 20)),
    ]
    results, _ = await ledger.lease_commit(usages, [])
    assert str(results[1]) == "request_id is required"
    assert str(results[2]) == "cost_micros must be >= 0"
    await ledger.lease_commit([], [])
    model.commit(usages)
    for key_id, balance in model.balances.items():
        assert (await ledger.get_key(key_id)).balance_micros == balance
    assert await ledger.usage("ghost") is None
    assert (await ledger.usage("ok2")).debited_micros == 20


async def test_validation_messages_name_the_first_bad_field(ledger):
    (key,), _ = await setup(ledger, [1_000])
    lease = f"lease:test:{key}:1"
    cases = [
        (usage("r1", key, 1, status="weird"), "usage.status must be one of"),
        (usage("r2", key, 1, input_tokens=True), "input_tokens must be an integer"),
        (usage("r3", key, 1, cached_tokens=1.5), "cached_tokens must be an integer"),
        (usage("r4", key, 1, output_tokens=-2, reasoning_tokens="x"), "output_tokens must be >= 0"),
        (usage("r5", key, "3"), "cost_micros must be an integer"),
    ]
    results, _ = await ledger.lease_commit([(lease, u) for u, _ in cases], [])
    for result, (_, message) in zip(results, cases):
        assert isinstance(result, ValueError) and str(result).startswith(message), result


async def test_the_row_as_recorded(ledger):
    (key,), _ = await setup(ledger, [1_000])
    u = UsageRecord("full", key, "some/model", 11, 3, 7, 2, 123, "incomplete", 1700000000.25)
    results, _ = await ledger.lease_commit([(f"lease:test:{key}:1", u)], [])
    assert results == [123]
    got = await ledger.usage("full")
    assert (got.request_id, got.key_id, got.model, got.input_tokens, got.cached_tokens, got.output_tokens,
            got.reasoning_tokens, got.cost_micros, got.status, got.created_at, got.debited_micros) == (
        "full", key, "some/model", 11, 3, 7, 2, 123, "incomplete", 1700000000.25, 123)


async def test_lease_changes_renew_give_back_drop_and_lapse(ledger):
    (key,), _ = await setup(ledger, [10_000])
    lease = f"lease:test:{key}:1"
    before = {h.request_id: h for h in await ledger.holds()}[lease]
    # A debit alone leaves the expiry as it was; a renewal moves it.
    await ledger.lease_commit([(lease, usage("u1", key, 100))], [])
    after = {h.request_id: h for h in await ledger.holds()}[lease]
    assert (after.amount_micros, after.expires_at) == (before.amount_micros - 100, before.expires_at)
    t0 = time.time()
    await ledger.lease_commit([(lease, usage("u2", key, 50))], [(lease, 1_000, 30.0, False)])
    after = {h.request_id: h for h in await ledger.holds()}[lease]
    assert after.amount_micros == before.amount_micros - 1_150
    assert t0 + 30 <= after.expires_at <= time.time() + 30
    # A lease whose row expired is reported lapsed; a dropped one is gone.
    _, lapsed = await ledger.lease_commit([], [("lease:gone", 0, None, False)])
    assert lapsed == {"lease:gone"}
    await ledger.lease_commit([], [(lease, 0, None, True)])
    assert await ledger.holds() == []


@pytest.mark.parametrize("seed", range(6))
async def test_random_batches_match_the_model(ledger, seed):
    rng = random.Random(seed)
    keys, model = await setup(ledger, [rng.choice([50, 500, 10**6]) for _ in range(3)])
    seen: list[str] = []
    for batch in range(12):
        usages = []
        for _ in range(rng.randint(0, 20)):
            key = rng.choice(keys + ["key_unknown"] * (rng.random() < 0.05))
            lease = f"lease:test:{keys[0] if key == 'key_unknown' else key}:1"
            if seen and rng.random() < 0.15:
                request_id = rng.choice(seen)  # recorded before, or earlier in this batch
            else:
                request_id = f"req_{seed}_{batch}_{rng.getrandbits(32):08x}"
                seen.append(request_id)
            cost = rng.choice([0, 1, 7, 30, 200]) if rng.random() > 0.03 else -5
            usages.append((lease, usage(request_id, key, cost)))
        await check_against_model(ledger, model, usages)
