"""Prepaid balances: reserve before forwarding, settle the real cost after.

    balance:
      hold_ttl_s: 900                  # a hold whose request never settles expires after this
      demo_balance_micros: 100000000   # the demo key's balance (used by auth)
      default_max_output_tokens: 32768 # the output cap to reserve for when neither the request
                                       # nor the worker pool says one
      bytes_per_token: 2               # the input estimate (see below)

Only POST /v1/responses is billed (input_tokens bills nothing), and only for a ledger
key: without the auth middleware, or for a static key (no account), this passes through.
Prices come from the top-level `prices` section (proxy.ledger.pricing).

Before forwarding:
  * the input is estimated from above: ceil(utf-8 bytes of the chat messages and tools,
    as compact JSON, / bytes_per_token) + 16 for the chat template. Real tokenizers
    average 3-4 bytes per token on English and JSON, so 2 over-estimates; the estimate
    is only a reservation (and the bill when the model server reports no usage).
  * the output cap is max_output_tokens, else the model's window from the worker pool,
    else default_max_output_tokens.
  * ONE ledger operation, hold_up_to(min = input + 1 output token, max = input + cap),
    atomically holds min(available, max), or fails when available < min -> 402
    insufficient_quota (its message says whether not even the input is covered). When
    less than input + cap was held, the cap is lowered to what the held amount covers
    (pricing.max_output_tokens_for; request[OUTPUT_CAP], applied by the forwarder) with a
    notice "max_output_tokens lowered to N to fit the balance". Concurrent requests of
    one key cannot overdraw it: the check and the hold are one transaction under the
    database write lock. The hold is on the request under HOLD.

After the handler (also when the client disconnected and the handler was cancelled:
the ledger call runs in a task of its own, which the cancellation cannot reach and
shutdown waits for):
  * the upstream answered (completed / incomplete / failed / cancelled mid-stream), or
    the client left while the model server was working -> settle once with the real
    usage: the reported tokens, else the counted output deltas and the input estimate;
    cached tokens at the cached price.
  * the model server was never reached, or refused before producing anything -> release.

Nothing on the response path waits for an fsync: the hold commits without one (the ledger's
hold_synchronous, see proxy/ledger/sqlite.py for why that is safe) and the settle, which
is fsync'd, runs after the response in its own task.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from middlewares.auth import API_KEY, is_static
from proxy import state
from proxy.config import ConfigError
from proxy.errors import APIError
from proxy.ledger import USAGE_STATUSES, Hold, InsufficientBalance, UsageRecord
from proxy.ledger.pricing import Price, cost_micros, max_output_tokens_for, price_for
from proxy.logs import log
from proxy.request import translation

HOLD = web.RequestKey("hold", Hold)
TEMPLATE_OVERHEAD = 16
_ANSWERED = ("completed", "incomplete", "failed", "cancelled")
_PENDING: set[asyncio.Task] = set()  # settlements in flight (a strong reference each)


async def wait_for_settlements(timeout: float = 30) -> None:
    """Wait for the settlements still in flight (shutdown, and tests that read the ledger)."""
    loop = asyncio.get_running_loop()  # tests run apps on several loops; wait only on this one's
    pending = [task for task in _PENDING if task.get_loop() is loop]
    if pending:
        await asyncio.wait(pending, timeout=timeout)


def estimate_input_tokens(chat: dict[str, Any], bytes_per_token: float = 2) -> int:
    """An over-estimate of the prompt tokens of a chat-completions body."""
    size = len(orjson.dumps(chat.get("messages") or []))
    if chat.get("tools"):
        size += len(orjson.dumps(chat["tools"]))
    return int(-(-size // bytes_per_token)) + TEMPLATE_OVERHEAD


def _insufficient(message: str) -> APIError:
    return APIError(402, message, code="insufficient_quota", type="insufficient_quota")


def _positive(section: dict, name: str, default: Any, kind=(int,)) -> Any:
    value = section.get(name, default)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise ConfigError(f"balance.{name} must be a positive number, not {value!r}")
    return value


def create(section: dict[str, Any], app: web.Application):
    unknown = set(section) - {"hold_ttl_s", "demo_balance_micros", "default_max_output_tokens", "bytes_per_token"}
    if unknown:
        raise ConfigError(f"balance: unknown setting(s) {', '.join(sorted(unknown))}")
    hold_ttl = float(_positive(section, "hold_ttl_s", 900, (int, float)))
    default_cap = _positive(section, "default_max_output_tokens", 32768)
    bytes_per_token = _positive(section, "bytes_per_token", 2, (int, float))
    demo = section.get("demo_balance_micros", 0)
    if isinstance(demo, bool) or not isinstance(demo, int) or demo < 0:
        raise ConfigError("balance.demo_balance_micros must be a non-negative integer")
    prices = app[state.CONFIG].section("prices")
    try:
        for name in list(prices) or ["default"]:
            price_for(prices, name)
    except ValueError as exc:
        raise ConfigError(f"prices: {exc}") from None

    def output_cap(request: web.Request, t: Any) -> int:
        if t.max_output_tokens is not None:
            return int(t.max_output_tokens)
        from proxy.forwarder import POOL

        models = request.app[POOL].models()
        window = models.get(t.upstream_model) or models.get(t.model)
        return int(window) if window else default_cap

    async def reserve(request: web.Request, ledger: Any, key_id: str, t: Any, price: Price, est: int) -> Hold:
        wanted = output_cap(request, t)
        if wanted < 1:
            raise _insufficient("The available balance does not cover any output for this request.")
        least = cost_micros(price, est, 0, 1)  # the input and one output token
        most = cost_micros(price, est, 0, wanted)
        try:
            found = await ledger.hold_up_to(request[state.REQUEST_ID], key_id, least, most, hold_ttl)
        except InsufficientBalance as exc:
            if exc.available_micros < cost_micros(price, est, 0, 0):
                raise _insufficient("The available balance does not cover the input of this request. "
                                    "Top up the key or send a shorter input.") from None
            raise _insufficient("The available balance does not cover any output for this request.") from None
        cap = min(wanted, max_output_tokens_for(price, found.amount_micros, est, 0))
        if cap < wanted:  # >= 1: at least `least` was held
            request[state.OUTPUT_CAP] = cap
            state.notices(request).append(f"max_output_tokens lowered to {cap} to fit the balance")
        return found

    async def close(request: web.Request, ledger: Any, hold: Hold, t: Any, price: Price, est: int,
                    cancelled: bool) -> None:
        request_id = hold.request_id
        try:
            out = request.get(state.OUTCOME)
            reached = out is not None and out.upstream is not None
            answered = reached and (out.status in _ANSWERED or out.usage_reported or out.output_tokens > 0)
            if not answered and not (reached and cancelled):
                await ledger.release(request_id)
                return
            if out.usage_reported:
                input_tokens, cached = out.input_tokens, out.cached_tokens
            else:
                input_tokens, cached = est, 0
            status = out.status if out.status in USAGE_STATUSES else ("cancelled" if cancelled else "error")
            output = max(0, int(out.output_tokens))
            usage = UsageRecord(
                request_id=request_id, key_id=hold.key_id, model=t.model,
                input_tokens=int(input_tokens), cached_tokens=int(cached), output_tokens=output,
                reasoning_tokens=max(0, int(out.reasoning_tokens)),
                cost_micros=cost_micros(price, int(input_tokens), int(cached), output), status=status,
            )
            await ledger.settle(request_id, usage)
        except Exception:
            # The hold stays and expires after hold_ttl_s: never a charge without a record.
            log.exception("settlement failed", request_id=request_id)

    @web.middleware
    async def balance(request: web.Request, handler):
        if request.method != "POST" or request.path != "/v1/responses":
            return await handler(request)
        record = request.get(API_KEY)
        if record is None or is_static(record):
            return await handler(request)
        from proxy.app import LEDGER

        ledger = request.app.get(LEDGER)
        if ledger is None:
            return await handler(request)
        t = await translation(request)
        price = price_for(prices, t.model)
        est = estimate_input_tokens(t.chat, bytes_per_token)
        hold = await reserve(request, ledger, record.key_id, t, price, est)
        request[HOLD] = hold
        cancelled = False
        try:
            return await handler(request)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            # Its own task: a cancelled handler (the client left) cannot interrupt it, and the
            # response (and the limits slot) need not wait for the ledger's commit. Shutdown
            # waits for the settlements still in flight (drain).
            task = asyncio.ensure_future(close(request, ledger, hold, t, price, est, cancelled))
            _PENDING.add(task)
            task.add_done_callback(_PENDING.discard)

    async def drain(app: web.Application) -> None:
        await wait_for_settlements()

    app.on_shutdown.append(drain)
    return balance
