"""Cost maths, in integers only.

Prices (config "prices") are per million tokens, in micro-units of the account currency:
    prices:
      default:        {input: 500000, cached_input: 100000, output: 1500000}
      Qwen/Qwen3-8B:  {input: 200000, output: 600000}      # cached_input defaults to input

Costs round UP to a whole micro-unit, so a request is never billed below its price, and
`max_output_tokens_for` is the exact inverse: the largest output that a budget covers.
`PriceTable` is the section checked once, for the request path (a model's Price resolved once).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.config.schema import SCHEMA
from proxy.protocol.models import resolve_model, strip_vendor

PER = 1_000_000  # prices are per million tokens
UNLIMITED = sys.maxsize  # max_output_tokens_for() when output is free
_BUILTIN_DEFAULT = SCHEMA.keys["prices"].default["default"]  # config.yaml's prices.default, when a table has none


@dataclass(frozen=True)
class Price:
    input: int  # micros per million uncached input tokens
    cached_input: int  # micros per million cached input tokens
    output: int  # micros per million output tokens (reasoning tokens are output tokens)


def _micro(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"price {what} must be an integer number of micro-units")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"price {what} must be an integer number of micro-units, got {value}")
        value = int(value)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"price {what} must be a non-negative integer number of micro-units")
    return value


def _price(entry: Any, model: str) -> Price:
    if isinstance(entry, Price):
        return entry
    if hasattr(entry, "__dataclass_fields__"):  # an entry of config.prices (typed; cached_input None: input)
        entry = {"input": entry.input, "cached_input": entry.cached_input, "output": entry.output}
    if not isinstance(entry, Mapping) or "input" not in entry or "output" not in entry:
        raise ValueError(f"prices[{model!r}] needs input and output")
    input_ = _micro(entry["input"], f"{model}.input")
    cached = entry.get("cached_input")
    return Price(
        input=input_,
        cached_input=input_ if cached is None else _micro(cached, f"{model}.cached_input"),
        output=_micro(entry["output"], f"{model}.output"),
    )


def _bare(model: str) -> str:
    """The model with a leading "vendor/" segment removed."""
    return strip_vendor(model) or model


def price_for(prices: Mapping[str, Any] | None, model: str) -> Price:
    """The price of `model`: the entry proxy.protocol.models.resolve_model picks (the exact name, else
    the name with its vendor prefix stripped), else an entry matching with vendor prefixes
    stripped on both sides, else prices["default"], else the built-in default."""
    prices = prices or {}
    name = resolve_model(model, lambda m: m in prices and m != "default")
    if name is not None:
        return _price(prices[name], name)
    bare = _bare(model)
    for name in sorted(prices):  # sorted: the same answer whatever the mapping order
        if name != "default" and _bare(name) == bare:
            return _price(prices[name], name)
    if prices.get("default") is not None:
        return _price(prices["default"], "default")
    return _price(_BUILTIN_DEFAULT, "default")


class PriceTable:
    """The `prices` section, validated once, with each model's Price resolved once.

    price_for() builds and checks a Price from the section on every call; the request path
    asks for the same few models again and again, so their answers are kept. Model names
    come from clients, so the memo is bounded: when full it starts afresh (a flood of made-up
    names costs them the lookup they cost before, and evicts nothing for good)."""

    __slots__ = ("_prices", "_memo", "_max")

    def __init__(self, prices: Mapping[str, Any] | None, max_models: int = 1024) -> None:
        self._prices = prices or {}
        self._memo: dict[str, Price] = {}
        self._max = max_models
        for name in list(self._prices) or ["default"]:  # every entry checked now (ValueError)
            price_for(self._prices, name)

    def __call__(self, model: str) -> Price:
        """price_for(prices, model), from the memo."""
        price = self._memo.get(model)
        if price is None:
            price = price_for(self._prices, model)
            if len(self._memo) >= self._max:
                self._memo.clear()
            self._memo[model] = price
        return price


def _check_count(what: str, n: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{what} must be a non-negative integer")


def _split(input_tokens: int, cached_tokens: int) -> tuple[int, int]:
    """(uncached, cached). Cached tokens are part of input_tokens (OpenAI usage semantics)."""
    # Plain non-negative ints (every call on the request path) skip the checks' calls.
    if not (type(input_tokens) is int and type(cached_tokens) is int and input_tokens >= 0 and cached_tokens >= 0):
        _check_count("input_tokens", input_tokens)
        _check_count("cached_tokens", cached_tokens)
    cached = cached_tokens if cached_tokens < input_tokens else input_tokens
    return input_tokens - cached, cached


def cost_micros(price: Price, input_tokens: int, cached_tokens: int, output_tokens: int) -> int:
    """ceil((uncached*input + cached*cached_input + output*output) / 1_000_000), integers only."""
    if not (type(output_tokens) is int and output_tokens >= 0):
        _check_count("output_tokens", output_tokens)
    uncached, cached = _split(input_tokens, cached_tokens)
    return -(-(uncached * price.input + cached * price.cached_input + output_tokens * price.output) // PER)


def input_cost_micros(price: Price, input_tokens: int, cached_tokens: int) -> int:
    return cost_micros(price, input_tokens, cached_tokens, 0)


def max_output_tokens_for(price: Price, budget_micros: int, input_tokens: int, cached_tokens: int) -> int:
    """The largest n with cost_micros(price, input, cached, n) <= budget_micros; 0 when the
    input alone exceeds the budget; UNLIMITED (sys.maxsize) when output is free."""
    if isinstance(budget_micros, bool) or not isinstance(budget_micros, int):
        raise ValueError("budget_micros must be an integer")
    uncached, cached = _split(input_tokens, cached_tokens)
    # ceil(x / PER) <= B  <=>  x <= B * PER  (for integer x, B), so no rounding is lost here.
    room = budget_micros * PER - (uncached * price.input + cached * price.cached_input)
    if room < 0:
        return 0
    if price.output == 0:
        return UNLIMITED
    return room // price.output
