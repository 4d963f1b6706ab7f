"""Organisations, teams and users above keys (proxy/ledger/levels.py), on both backends: a hold
fits every level above its key, a settle debits every level the same, the money adds up at each
level (balance drop == its keys' debits), leases draw on the levels too, and the pure rules
(periods, rooms, debits) hold at their edges."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings, strategies as st

from proxy.ledger import InsufficientBalance, UsageRecord
from proxy.ledger.levels import Purse, chain_balance, chain_room, debit_changes, level_room, period_bounds
from proxy.ledger.usage import MAX_AMOUNT

_ids = itertools.count()


def usage(key_id: str, cost: int, request_id: str | None = None) -> UsageRecord:
    return UsageRecord(request_id or f"r{next(_ids)}", key_id, "m", 1, 0, 1, 0, cost, "completed")


async def org_team_user(ledger, *, org_balance=None, team_balance=None, team_budget=None, user_balance=None):
    org = await ledger.create_level("org", {"name": "acme", "balance_micros": org_balance})
    team = await ledger.create_level("team", {"name": "ml", "parent_id": org.level_id, "balance_micros": team_balance,
                                              "budget_micros": team_budget,
                                              "budget_period": "daily" if team_budget else None})
    user = await ledger.create_level("user", {"name": "ann", "parent_id": team.level_id,
                                              "balance_micros": user_balance})
    return org, team, user


async def shared_key(ledger, name: str, *, team=None, user=None, balance: int | None = None):
    place = await ledger.placement(team.level_id if team else None, user.level_id if user else None)
    place["own_balance"] = balance is not None
    return await ledger.create_key(name, balance or 0, placement=place)


async def level(ledger, level_id):
    return await ledger.get_level(level_id)


async def test_a_team_balance_is_one_purse_for_all_its_keys(any_ledger):
    org, team, user = await org_team_user(any_ledger, org_balance=10_000, team_balance=1_000)
    _, a = await shared_key(any_ledger, "a", team=team)
    _, b = await shared_key(any_ledger, "b", user=user)
    assert (a.org_id, a.team_id, a.user_id, a.own_balance) == (org.level_id, team.level_id, None, False)
    assert (b.org_id, b.team_id, b.user_id) == (org.level_id, team.level_id, user.level_id)
    assert await any_ledger.available(a.key_id) == 1_000
    held = await any_ledger.hold_up_to("r-a", a.key_id, 100, 700, 60)
    assert held.amount_micros == 700
    assert await any_ledger.available(b.key_id) == 300  # the other key sees the team's purse minus a's hold
    with pytest.raises(InsufficientBalance) as refused:
        await any_ledger.hold_up_to("r-b", b.key_id, 400, 500, 60)
    assert refused.value.available_micros == 300
    assert (await any_ledger.hold_up_to("r-b2", b.key_id, 100, 500, 60)).amount_micros == 300
    assert await any_ledger.settle("r-a", usage(a.key_id, 650, "r-a"))
    assert await any_ledger.settle("r-b2", usage(b.key_id, 300, "r-b2"))
    assert (await level(any_ledger, team.level_id)).balance_micros == 50
    assert (await level(any_ledger, org.level_id)).balance_micros == 10_000 - 950
    assert (await any_ledger.get_key(a.key_id)).balance_micros == 0  # no purse of its own: untouched
    audit = {level_id: (balance, derived) for level_id, balance, derived in await any_ledger.level_audit()}
    assert audit == {org.level_id: (9_050, 9_050), team.level_id: (50, 50)}
    assert all(balance == derived for _, balance, derived in await any_ledger.audit())


async def test_a_settle_is_clamped_at_the_smallest_balance_on_the_way_never_at_a_budget(any_ledger):
    org, team, _ = await org_team_user(any_ledger, org_balance=500, team_budget=10_000)
    _, key = await shared_key(any_ledger, "k", team=team, balance=2_000)  # a purse of its own, under the team
    assert await any_ledger.available(key.key_id) == 500  # the org's balance is the smallest room
    await any_ledger.hold_up_to("r1", key.key_id, 10, 400, 60)
    await any_ledger.release("r1")
    # Settled without a hold (it expired): the debit is clamped at the org's 500, not the cost.
    assert await any_ledger.settle("r2", usage(key.key_id, 900, "r2"))
    assert (await any_ledger.usage("r2")).debited_micros == 500
    assert (await level(any_ledger, org.level_id)).balance_micros == 0
    assert (await any_ledger.get_key(key.key_id)).balance_micros == 1_500
    assert (await level(any_ledger, team.level_id)).spent() == 500
    with pytest.raises(InsufficientBalance):
        await any_ledger.hold_up_to("r3", key.key_id, 1, 10, 60)


async def test_a_team_budget_bounds_holds_by_what_is_spent_and_held_this_period(any_ledger):
    _, team, user = await org_team_user(any_ledger, team_budget=1_000)
    _, k1 = await shared_key(any_ledger, "k1", user=user)
    _, k2 = await shared_key(any_ledger, "k2", team=team)
    assert await any_ledger.available(k1.key_id) == 1_000
    await any_ledger.hold_up_to("h1", k1.key_id, 10, 600, 60)
    await any_ledger.settle("h1", usage(k1.key_id, 600, "h1"))
    assert await any_ledger.available(k2.key_id) == 400
    await any_ledger.hold_up_to("h2", k2.key_id, 10, 300, 60)
    with pytest.raises(InsufficientBalance) as refused:
        await any_ledger.hold_up_to("h3", k1.key_id, 200, 300, 60)
    assert refused.value.available_micros == 100
    team_now = await level(any_ledger, team.level_id)
    assert team_now.spent() == 600 and team_now.period_end is not None


async def test_saving_a_levels_fields_again_keeps_its_spend_and_a_new_clock_restarts_it(any_ledger):
    _, team, _ = await org_team_user(any_ledger, team_budget=1_000)
    _, key = await shared_key(any_ledger, "k", team=team)
    await any_ledger.settle("s1", usage(key.key_id, 700, "s1"))
    same = await any_ledger.update_level(team.level_id, {"budget_micros": 1_000, "budget_period": "daily",
                                                         "budget_reset": "+00:00", "rate_per_min": 5})
    assert same.spent() == 700  # an edit that keeps the clock is no way round the budget
    with pytest.raises(InsufficientBalance):
        await any_ledger.hold_up_to("h", key.key_id, 400, 500, 60)
    moved = await any_ledger.update_level(team.level_id, {"budget_period": "weekly"})
    assert moved.spent() == 0 and moved.budget_period == "weekly"


async def test_leases_draw_on_the_levels_and_their_commits_debit_them(any_ledger):
    org, team, _ = await org_team_user(any_ledger, org_balance=5_000, team_balance=1_000)
    _, key = await shared_key(any_ledger, "busy", team=team)
    _, other = await shared_key(any_ledger, "other", team=team)
    granted, _ = await any_ledger.lease_grow("lease:1", key.key_id, 10, 5_000, 30, share=1)
    assert granted == 1_000  # the team's purse, all of it
    assert await any_ledger.available(other.key_id) == 0
    results, lapsed = await any_ledger.lease_commit(
        [("lease:1", usage(key.key_id, 300)), ("lease:1", usage(key.key_id, 200))], [("lease:1", 0, None, True)])
    assert results == [300, 200] and lapsed == set()
    assert (await level(any_ledger, team.level_id)).balance_micros == 500
    assert (await level(any_ledger, org.level_id)).balance_micros == 4_500
    assert await any_ledger.available(other.key_id) == 500
    # A batch over a shared purse that runs out: each debit clamped at what the team has left.
    results, _ = await any_ledger.lease_commit(
        [("lease:2", usage(key.key_id, 400)), ("lease:2", usage(other.key_id, 400))], [])
    assert results == [400, 100]
    audit = {level_id: (balance, derived) for level_id, balance, derived in await any_ledger.level_audit()}
    assert audit[team.level_id] == (0, 0) and audit[org.level_id] == (4_000, 4_000)


async def test_concurrent_holds_of_a_teams_keys_never_overdraw_its_purse(any_ledger):
    _, team, user = await org_team_user(any_ledger, team_balance=1_000, team_budget=800)
    keys = [(await shared_key(any_ledger, f"k{i}", **({"user": user} if i % 2 else {"team": team})))[1]
            for i in range(4)]

    async def one(i: int) -> int:
        try:
            hold = await any_ledger.hold_up_to(f"c{i}", keys[i % 4].key_id, 30, 50, 60)
        except InsufficientBalance:
            return 0
        await any_ledger.settle(f"c{i}", usage(keys[i % 4].key_id, 45 + i % 10, f"c{i}"))
        return hold.amount_micros

    held = await asyncio.gather(*(one(i) for i in range(60)))
    team_now = await level(any_ledger, team.level_id)
    debited = sum([(await any_ledger.usage(f"c{i}")).debited_micros for i in range(60) if held[i]])
    assert team_now.spent() == debited <= 800  # the budget, never passed
    assert team_now.balance_micros == 1_000 - debited
    assert 15 <= sum(1 for h in held if h) <= 800 // 30


async def test_a_rotated_secret_is_found_as_the_previous_one_only_with_a_grace(any_ledger):
    old, key = await any_ledger.create_key("rotating", 100)
    new, _ = await any_ledger.rotate_key(key.key_id, grace_s=60)
    previous = await any_ledger.lookup_key(old)
    assert previous.presented_previous and previous.grace_until is not None
    assert not (await any_ledger.lookup_key(new)).presented_previous
    newest, _ = await any_ledger.rotate_key(key.key_id)  # no grace: the last secret dies at once
    assert await any_ledger.lookup_key(new) is None
    assert await any_ledger.lookup_key(old) is None
    assert await any_ledger.lookup_key(newest) is not None


async def test_placement_refuses_a_user_outside_the_team_and_a_wrong_kind(any_ledger):
    _, team, user = await org_team_user(any_ledger)
    other = await any_ledger.create_level("team", {"name": "other"})
    with pytest.raises(ValueError, match="not in team"):
        await any_ledger.placement(other.level_id, user.level_id)
    with pytest.raises(ValueError, match="is a team, not a user"):
        await any_ledger.placement(None, team.level_id)
    with pytest.raises(ValueError, match="parent must be a team"):
        await any_ledger.create_level("user", {"name": "x", "parent_id": user.level_id})
    with pytest.raises(ValueError, match="must sit under a team or a user"):
        await any_ledger.create_key("lonely", 0, placement={"own_balance": False})


async def test_a_deleted_key_leaves_the_list_and_its_secret_stops(any_ledger):
    secret, key = await any_ledger.create_key("gone", 10)
    await any_ledger.delete_key(key.key_id)
    assert key.key_id not in {k.key_id for k in await any_ledger.list_keys()}
    assert (await any_ledger.lookup_key(secret)).revoked
    assert (await any_ledger.get_key(key.key_id)) is not None  # its rows stay


# ---------------------------------------------------------------- the pure rules


def test_periods_on_the_operators_clock():
    noon = datetime(2026, 12, 5, 12, 0, tzinfo=UTC).timestamp()
    assert period_bounds("daily", "+00:00", noon) == (datetime(2026, 12, 5, tzinfo=UTC).timestamp(),
                                                      datetime(2026, 12, 6, tzinfo=UTC).timestamp())
    # 04:00 UTC is still the day before in New York (-05:00): its day started at 05:00 UTC on the 4th.
    early = datetime(2026, 12, 5, 4, 0, tzinfo=UTC).timestamp()
    start, end = period_bounds("daily", "-05:00", early)
    assert (start, end) == (datetime(2026, 12, 4, 5, tzinfo=UTC).timestamp(),
                            datetime(2026, 12, 5, 5, tzinfo=UTC).timestamp())
    start, end = period_bounds("weekly", "+00:00", noon)  # Saturday: the week began on Monday the 30th
    assert datetime.fromtimestamp(start, UTC) == datetime(2026, 11, 30, tzinfo=UTC)
    start, end = period_bounds("monthly", "+09:00", datetime(2026, 11, 30, 16, tzinfo=UTC).timestamp())
    assert datetime.fromtimestamp(start, UTC) == datetime(2026, 11, 30, 15, tzinfo=UTC)  # Dec 1st, Tokyo
    start, end = period_bounds("14d", "+00:00", noon)
    assert end - start == 14 * 86400 and start <= noon < end


@given(period=st.sampled_from(["daily", "weekly", "monthly", "6h", "3d"]),
       reset=st.sampled_from(["+00:00", "-08:00", "+05:30", "+14:00"]),
       now=st.floats(min_value=1e9, max_value=4e9))
@settings(max_examples=300, deadline=None)
def test_a_period_contains_now_and_the_next_starts_where_it_ends(period, reset, now):
    start, end = period_bounds(period, reset, now)
    assert start <= now < end
    assert period_bounds(period, reset, end)[0] == end


def test_a_debit_after_the_period_starts_a_new_one():
    row = ("team_x", 1_000, 500, "daily", "+00:00", 400, 100.0)
    assert debit_changes(row, 50, 99.0) == (950, 450, 100.0)
    balance, spent, end = debit_changes(row, 50, 200.0)
    assert (balance, spent) == (950, 50) and end > 200.0
    assert debit_changes(("team_x", None, None, None, "+00:00", 0, None), 50, 1.0) == (None, 0, None)


@given(own=st.one_of(st.none(), st.integers(-100, 10_000)),
       purses=st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 10_000)), st.one_of(st.none(), st.integers(1, 10_000)),
                                 st.integers(0, 10_000), st.integers(0, 10_000)), max_size=3))
def test_the_room_of_a_chain_is_its_smallest_part(own, purses):
    parts = [Purse(f"team_{i}", b, g, s, h) for i, (b, g, s, h) in enumerate(purses)]
    room, binding = chain_room(own, parts)
    rooms = [r for r in (level_room(p) for p in parts) if r is not None]
    assert room == min([MAX_AMOUNT if own is None else own, *rooms])
    assert binding is None or level_room(next(p for p in parts if p.level_id == binding)) == room
    assert chain_balance(own, parts) == min([MAX_AMOUNT if own is None else own,
                                             *(p.balance for p in parts if p.balance is not None)])
