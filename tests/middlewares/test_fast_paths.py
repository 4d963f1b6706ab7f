"""The middleware chain's per-request shortcuts give the answers of the long ways: the price
table against price_for, the cost checks' fast path against the full checks, the lease
target against its max/min formula, only the enabled policies made into phases."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.ledger.lease import _Key
from proxy.ledger.pricing import Price, PriceTable, cost_micros, max_output_tokens_for, price_for
from tests.conftest import only

PRICES = {
    "default": {"input": 500_000, "cached_input": 100_000, "output": 1_500_000},
    "Qwen/Qwen3-8B": {"input": 200_000, "output": 600_000},
    "tiny-model": {"input": 1, "cached_input": 0, "output": 3},
    "acme/other": {"input": 7.0, "output": 11},
}
NAMES = ["Qwen/Qwen3-8B", "Qwen3-8B", "someone/Qwen3-8B", "tiny-model", "x/tiny-model", "other", "acme/other",
         "unknown", "default", "a/b/c", ""]


@pytest.mark.parametrize("prices", [PRICES, {}, None, {"default": {"input": 1, "output": 2}}, {"m": {"input": 3, "output": 4}}])
def test_price_table_answers_as_price_for(prices):
    table = PriceTable(prices)
    for _ in range(2):  # the first call fills the memo, the second reads it
        for name in NAMES:
            assert table(name) == price_for(prices, name), name


def test_price_table_checks_the_section_at_once():
    with pytest.raises(ValueError, match="needs input and output"):
        PriceTable({"big-model": {"input": 1}})
    with pytest.raises(ValueError):
        PriceTable({"default": {"input": 0.5, "output": 1}})


def test_price_table_memo_is_bounded():
    table = PriceTable(PRICES, max_models=8)
    for i in range(100):  # made-up names, as a client may send
        assert table(f"made-up-{i}") == price_for(PRICES, "unknown")
        assert len(table._memo) <= 8
    assert table("tiny-model") == price_for(PRICES, "tiny-model")


class Sub(int):
    pass


@pytest.mark.parametrize("bad", [-1, 1.5, True, None, "3"])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_cost_checks_refuse_what_they_refused(bad, where):
    counts = [5, 2, 3]
    counts[where] = bad
    with pytest.raises(ValueError, match=("input_tokens", "cached_tokens", "output_tokens")[where]):
        cost_micros(price_for(PRICES, "x"), *counts)
    if where < 2:
        with pytest.raises(ValueError):
            max_output_tokens_for(price_for(PRICES, "x"), 100, *counts[:2])


def test_cost_accepts_int_subclasses_as_before():
    price = price_for(PRICES, "x")
    assert cost_micros(price, Sub(10), Sub(4), Sub(3)) == cost_micros(price, 10, 4, 3)
    assert max_output_tokens_for(price, 1000, Sub(10), Sub(4)) == max_output_tokens_for(price, 1000, 10, 4)


@given(st.integers(0, 10**7), st.integers(0, 10**7), st.integers(0, 10**7), st.integers(0, 10**6),
       st.integers(0, 10**6), st.integers(0, 10**6))
def test_cost_is_the_exact_ceiling(inp, cached, out, p_in, p_cached, p_out):
    price = Price(p_in, p_cached, p_out)
    c = min(cached, inp)
    numerator = (inp - c) * p_in + c * p_cached + out * p_out
    expected = numerator // 1_000_000 + (1 if numerator % 1_000_000 else 0)
    assert cost_micros(price, inp, cached, out) == expected


@given(st.integers(0, 10**9), st.integers(0, 10**9), st.integers(0, 10**9), st.integers(0, 10**9),
       st.integers(0, 10**9), st.integers(0, 10**7), st.integers(1, 10**6))
def test_lease_target_is_its_formula(peak, peak_prev, typical, spend, spend_prev, max_micros, seconds_ms):
    k = _Key("k", 0.0)
    k.peak, k.peak_prev, k.typical, k.spend, k.spend_prev = peak, peak_prev, typical, spend, spend_prev
    seconds = seconds_ms / 1000
    expected = min(max_micros, 2 * max(peak, peak_prev, typical) + int(max(spend, spend_prev) * seconds))
    assert k.target(max_micros, seconds) == expected


def test_only_enabled_policies_become_phases():
    from aiohttp import web

    from middlewares import build_phases
    from proxy import state
    from proxy.config.load import Config

    config = Config.from_dict(only("stateless", "notices", "limits"))
    app = web.Application()
    app[state.CONFIG] = config
    phases = build_phases(config, app)
    # limits and prepare (stateless is a body check of prepare; notices is no phase)
    from proxy.units import INPUT_TOKENS, KEYED, RESPONSES

    assert phases.names(RESPONSES) == ["limits", "prepare"]
    assert phases.names(INPUT_TOKENS) == ["limits", "prepare"]
    assert phases.names(KEYED) == []  # a keyed read's chain: auth only, and auth is off
    assert len(app.on_response_prepare) == 1  # the notices header is still set, at prepare


@pytest.mark.parametrize("items, expected", [
    ([], None),
    ([{"type": "message"}, {"role": "user"}], None),
    ([{"type": "message"}, {"type": "item_reference", "id": "x"}, {"type": "item_reference"}], 1),
    (["text", {"type": "item_reference"}], 1),  # not an object: the walk finds it all the same
    ([{"type": "item_reference"}, 3], 0),
    ([None, [1], {"type": ["item_reference"]}], None),
    ([{"type": "message"}] * 500 + [{"type": "item_reference"}], 500),
])
def test_item_reference_is_found_where_the_walk_finds_it(items, expected):
    from proxy.policy.rules import item_reference_at as _item_reference_at

    walk = next((i for i, item in enumerate(items)
                 if isinstance(item, dict) and item.get("type") == "item_reference"), None)
    assert _item_reference_at(items) == walk == expected
