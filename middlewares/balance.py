"""Prepaid balances: reserve before forwarding, settle the real cost after.

    balance:
      hold_ttl_s: 900                  # a hold whose request never settles expires after this
      demo_balance_micros: 100000000   # the demo key's balance (used by auth)
      default_max_output_tokens: 32768 # the output cap to reserve for when neither the request
                                       # nor the worker pool says one
      bytes_per_token: 2               # the input estimate (see below)
      lease_max_micros: 10000000       # leases (below); 0: every hold is a ledger round trip
      lease_min_rate: 4                # requests/s of a key in this process before a lease
      lease_seconds: 2                 # lease size: ~this long of the key's spend (+2x peak)
      lease_idle_s: 2                  # an unused lease is given back after this
      lease_ttl_s: 30                  # lease row expiry after its last renewal (<= hold_ttl_s)
      lease_commit_ms: 20              # a lease's usage rows are committed in batches this far apart

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

Leases. The ledger calls go through proxy.ledger.lease.Leases (one per app): for a busy key
the hold above is taken in memory from the process's lease (a hold row of its own in the
ledger) and the settle / release is an in-memory debit whose usage row is committed with
others a few ms later; only a request the lease cannot cover does the ledger operation
above (and gives the lease's free part back in it, so the exact semantics hold near the end
of a balance). See README "Keys and balances" for the guarantees and the crash window.

Nothing on the response path waits for an fsync: the hold commits without one (the ledger's
hold_synchronous, see proxy/ledger/sqlite.py for why that is safe) and the settle, which
is fsync'd, runs after the response in its own task.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import orjson
from aiohttp import web

from middlewares.auth import API_KEY, is_static
from proxy import state
from proxy.config import ConfigError
from proxy.errors import APIError
from proxy.ledger import USAGE_STATUSES, Hold, InsufficientBalance, UsageRecord
from proxy.ledger.lease import LeaseHold, Leases
from proxy.ledger.pricing import Price, PriceTable, cost_micros, max_output_tokens_for
from proxy.logs import log
from proxy.request import translation

HOLD = web.RequestKey("hold", Hold)
TEMPLATE_OVERHEAD = 16
_ANSWERED = ("completed", "incomplete", "failed", "cancelled")
_PENDING: set[asyncio.Task] = set()  # ledger calls in flight (a strong reference each)
_LEASES: "weakref.WeakSet[Leases]" = weakref.WeakSet()  # every app's Leases
_LEASE_SETTINGS = {"lease_max_micros", "lease_seconds", "lease_min_rate", "lease_idle_s", "lease_ttl_s",
                   "lease_commit_ms"}


async def wait_for_settlements(timeout: float = 30) -> None:
    """Wait for the settlements still in flight and commit the queued ones, then give back
    the leases nothing holds (shutdown, and tests that read the ledger)."""
    loop = asyncio.get_running_loop()  # tests run apps on several loops; wait only on this one's
    for leases in list(_LEASES):
        if leases.loop is loop:
            await asyncio.wait_for(leases.quiesce(), timeout)
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
    unknown = set(section) - {"hold_ttl_s", "demo_balance_micros", "default_max_output_tokens",
                              "bytes_per_token"} - _LEASE_SETTINGS
    if unknown:
        raise ConfigError(f"balance: unknown setting(s) {', '.join(sorted(unknown))}")
    hold_ttl = float(_positive(section, "hold_ttl_s", 900, (int, float)))
    default_cap = _positive(section, "default_max_output_tokens", 32768)
    bytes_per_token = _positive(section, "bytes_per_token", 2, (int, float))
    demo = section.get("demo_balance_micros", 0)
    if isinstance(demo, bool) or not isinstance(demo, int) or demo < 0:
        raise ConfigError("balance.demo_balance_micros must be a non-negative integer")
    lease_max = section.get("lease_max_micros", 10_000_000)
    if isinstance(lease_max, bool) or not isinstance(lease_max, int) or lease_max < 0:
        raise ConfigError("balance.lease_max_micros must be a non-negative integer (0: no leases)")
    lease_settings = {
        "max_micros": lease_max,
        "seconds": float(_positive(section, "lease_seconds", 2, (int, float))),
        "min_rate": int(_positive(section, "lease_min_rate", 4)),
        "idle_s": float(_positive(section, "lease_idle_s", 2, (int, float))),
        "ttl_s": float(_positive(section, "lease_ttl_s", 30, (int, float))),
        # Each commit is an fsync'd transaction plus a round trip to the writer thread (~0.5 ms
        # of CPU at low load): 20 ms apart rather than the per-request settle's 5 ms cuts a
        # single busy client's CPU per request by ~15% (`make bench`, c=1), for a SIGKILL
        # window of the rows settled in the last ~20 ms.
        "linger_s": float(_positive(section, "lease_commit_ms", 20, (int, float))) / 1000,
    }
    accounts: list[Leases] = []  # this app's, made on first use (the ledger opens at startup)

    def leases_for(ledger: Any) -> Leases:
        if accounts and accounts[0].ledger is ledger:
            return accounts[0]
        made = Leases(ledger, hold_ttl_s=hold_ttl, tasks=_PENDING, **lease_settings)
        accounts[:] = [made]
        _LEASES.add(made)
        return made

    try:
        price_of = PriceTable(app[state.CONFIG].section("prices"))
    except ValueError as exc:
        raise ConfigError(f"prices: {exc}") from None
    # Imported here, not at the top (proxy.app imports this package), and once: an import
    # statement on the request path costs microseconds per request.
    from proxy.app import LEDGER
    from proxy.forwarder import POOL

    def output_cap(t: Any) -> int:
        if t.max_output_tokens is not None:
            return int(t.max_output_tokens)
        models = app[POOL].models()
        window = models.get(t.upstream_model) or models.get(t.model)
        return int(window) if window else default_cap

    async def reserve(request: web.Request, leases: Leases, key_id: str, t: Any, price: Price, est: int) -> Hold:
        wanted = output_cap(t)
        if wanted < 1:
            raise _insufficient("The available balance does not cover any output for this request.")
        least = cost_micros(price, est, 0, 1)  # the input and one output token
        most = cost_micros(price, est, 0, wanted)
        try:
            found = await leases.hold_up_to(request[state.REQUEST_ID], key_id, least, most)
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

    def close(request: web.Request, leases: Leases, hold: Hold, t: Any, price: Price, est: int,
              cancelled: bool) -> None:
        request_id = hold.request_id
        try:
            usage = usage_of(request, hold, t, price, est, cancelled)
        except Exception:
            log.exception("settlement failed", request_id=request_id)
            if isinstance(hold, LeaseHold):  # back to the lease: never a charge without a record
                leases.finish(hold, None)
            return  # a hold row stays and expires after hold_ttl_s
        leases.finish(hold, usage)

    def usage_of(request: web.Request, hold: Hold, t: Any, price: Price, est: int,
                 cancelled: bool) -> UsageRecord | None:
        """The usage to settle, or None to release the hold."""
        request_id = hold.request_id
        out = request.get(state.OUTCOME)
        reached = out is not None and out.upstream is not None
        answered = reached and (out.status in _ANSWERED or out.usage_reported or out.output_tokens > 0)
        if not answered and not (reached and cancelled):
            return None
        if out.usage_reported:
            input_tokens, cached = out.input_tokens, out.cached_tokens
        else:
            input_tokens, cached = est, 0
        status = out.status if out.status in USAGE_STATUSES else ("cancelled" if cancelled else "error")
        output = max(0, int(out.output_tokens))
        return UsageRecord(
            request_id=request_id, key_id=hold.key_id, model=t.model,
            input_tokens=int(input_tokens), cached_tokens=int(cached), output_tokens=output,
            reasoning_tokens=max(0, int(out.reasoning_tokens)),
            cost_micros=cost_micros(price, int(input_tokens), int(cached), output), status=status,
        )

    @web.middleware
    async def balance(request: web.Request, handler):
        if request.method != "POST" or request.path != "/v1/responses":
            return await handler(request)
        record = request.get(API_KEY)
        if record is None or is_static(record):
            return await handler(request)
        ledger = app.get(LEDGER)  # this middleware's app: the one whose ledger bills its requests
        if ledger is None:
            return await handler(request)
        t = await translation(request)
        price = price_of(t.model)
        est = estimate_input_tokens(t.chat, bytes_per_token)
        leases = leases_for(ledger)
        hold = await reserve(request, leases, record.key_id, t, price, est)
        request[HOLD] = hold
        cancelled = False
        try:
            return await handler(request)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            # Never waits: a hold from a lease settles in memory and its usage row is queued
            # for the next commit; a per-request hold settles in a task of its own, which a
            # cancelled handler (the client left) cannot interrupt. Shutdown commits and waits
            # for both (drain).
            close(request, leases, hold, t, price, est, cancelled)

    async def drain(app: web.Application) -> None:
        for leases in accounts:
            await leases.close()
        await wait_for_settlements()

    app.on_shutdown.append(drain)
    return balance
