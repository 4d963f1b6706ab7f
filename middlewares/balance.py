"""Prepaid balances: reserve before forwarding, settle the real cost after.

    balance:
      hold_ttl_s: 900                  # a hold whose request never settles expires after this
      demo_balance_micros: 100000000   # the demo key's balance (used by auth)
      default_max_output_tokens: 32768 # the output cap to reserve for when neither the request
                                       # nor the worker pool says one
      bytes_per_token: 1               # the input bound (see below); at most 1
      lease_max_micros: 10000000       # leases (below); 0: every hold is a ledger round trip
      lease_min_rate: 4                # requests/s of a key in this process before a lease
      lease_seconds: 2                 # lease size: ~this long of the key's spend (+2x peak)
      lease_idle_s: 2                  # an unused lease is given back after this
      lease_ttl_s: 30                  # lease row expiry after its last renewal (<= hold_ttl_s)
      lease_commit_ms: 20              # a lease's usage rows are committed in batches this far apart
      lease_commit_rows: 64            # ...or as soon as this many wait

Only POST /v1/responses is billed (input_tokens bills nothing), and only for a ledger
key: without the auth middleware, or for a static key (no account), this passes through.
Prices come from the top-level `prices` section (proxy.ledger.pricing).

Before forwarding:
  * the input is bounded from above: the utf-8 bytes of the chat messages and tools as
    compact JSON (a byte-level BPE token covers at least one byte: digits and punctuation
    reach one token per byte) + the chat template's tokens (256, 16 per message, 512 for
    a tool list). Real tokenizers average 3-4 bytes per token on English, so the hold is
    generous; the bill is what the worker reports (see below), not this bound.
  * the output cap is max_output_tokens, else the model's window from the worker pool,
    else default_max_output_tokens.
  * ONE ledger operation, hold_up_to(min = input + 1 output token, max = input + cap),
    atomically holds min(available, max), or fails when available < min -> 402
    insufficient_quota (its message says whether not even the input is covered). When
    less than input + cap was held, the cap is lowered to what the held amount covers
    (pricing.max_output_tokens_for): the context's Translation is replaced by a capped copy
    (Translation.with_cap), with a notice "max_output_tokens lowered to N to fit the
    balance". Concurrent requests of one key cannot overdraw it: the check and the hold are
    one transaction under the database write lock. The hold is the context's `hold`.

Settlement, before the answer's last bytes are sent (the forwarder calls the hook under
the context's `settle` before the end of a stream; a JSON body is written after this middleware
returns), so a client that waited for its answer finds its balance settled. When the
client disconnected (the handler was cancelled) it runs in a task of its own, which the
cancellation cannot reach and shutdown waits for:
  * the upstream answered (completed / incomplete / failed / cancelled mid-stream), or
    the client left while the model server was working -> settle once with the usage
    checked by proxy.ledger.usage.clean_usage: the reported tokens when they are possible,
    else the output deltas counted and the prompt as the worker's tokenizer counts it
    (the bound above when it cannot); output at most the cap sent upstream, the cost at
    most the hold. Each correction is logged and counted
    (responses_proxy_usage_corrections_total{reason}); the access line and the metrics
    print the billed figures.
  * the model server was never reached, or refused before producing anything -> release.

Budgets. A key with daily_budget_micros / monthly_budget_micros (UTC day, calendar month)
is refused with 402 budget_exceeded once its settled spend in the period reaches the
budget, and a request's hold (so its output cap) is kept within what is left
(proxy.ledger.service.budget_room: one indexed read per budget, only for keys with one).
Requests in flight are not in the spend yet: concurrent ones may pass a budget by their
holds; the prepaid balance stays the hard bound.

Leases. The ledger calls go through proxy.ledger.lease.Leases (one per app): for a busy key
the hold above is taken in memory from the process's lease (a hold row of its own in the
ledger) and the settle / release is an in-memory debit whose usage row is committed with
others a few ms later; only a request the lease cannot cover does the ledger operation
above (and gives the lease's free part back in it, so the exact semantics hold near the end
of a balance). See README "Keys and balances" for the guarantees and the crash window.

The hold commits without an fsync (the ledger's hold_synchronous, see proxy/ledger/sqlite.py
for why that is safe). A per-request hold's settle is fsync'd and the end of the answer waits
for it (one commit, without the settle linger); a lease hold's settle is an in-memory debit,
its usage row committed (fsync'd) within lease_commit_ms after the answer ended.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import orjson
from aiohttp import web

from middlewares.auth import is_static
from proxy import state
from proxy.config import settings as config_settings
from proxy.errors import APIError
from proxy.http.units import BALANCE
from proxy.ledger import USAGE_STATUSES, Hold, InsufficientBalance, RequestLedger, UsageRecord
from proxy.ledger.lease import Leases
from proxy.ledger.pricing import Price, PriceTable, cost_micros, max_output_tokens_for
from proxy.ledger.service import budget_room
from proxy.ledger.usage import MAX_AMOUNT, clean_usage
from proxy.runtime.logs import log
from proxy.state import METRICS, RequestContext
from proxy.upstream.routing import TokenCountError, count_tokens

_DEFAULTS = config_settings.of("balance")  # a caller without a configuration (a test, a tool) gets these
# The chat template's own tokens (see estimate_input_tokens): in front of everything, around
# each message, in front of a tool list. The same margins as the context check's bound
# (proxy.upstream.routing).
TEMPLATE_OVERHEAD = 256
PER_MESSAGE_OVERHEAD = 16
TOOLS_OVERHEAD = 512
_ANSWERED = ("completed", "incomplete", "failed", "cancelled")


class Settlements:
    """One app's ledger work in flight: the settle tasks (a strong reference each, so none is
    collected mid-way) and the app's Leases. On the app (state.SETTLEMENTS), so waiting for
    one app's settlements never waits for, or commits, another app's."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()
        self.leases: weakref.WeakSet[Leases] = weakref.WeakSet()

    def track(self, task: asyncio.Task) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait(self, timeout: float = 30) -> None:
        loop = asyncio.get_running_loop()
        for leases in list(self.leases):
            if leases.loop is loop:
                await asyncio.wait_for(leases.quiesce(), timeout)
        pending = [task for task in self.tasks if task.get_loop() is loop]
        if pending:
            await asyncio.wait(pending, timeout=timeout)


async def wait_for_settlements(app: web.Application, timeout: float = 30) -> None:
    """Wait for the app's settlements still in flight and commit the queued ones, then give
    back the leases nothing holds (shutdown, and tests that read the ledger)."""
    settlements = app.get(state.SETTLEMENTS)
    if settlements is not None:
        await settlements.wait(timeout)
    ledger = app.get(state.LEDGER)
    if ledger is not None:
        await ledger.settled(timeout)  # written durably; in the database too (a server-side ledger)


def estimate_input_tokens(chat: dict[str, Any], bytes_per_token: float = _DEFAULTS.bytes_per_token) -> int:
    """An upper bound of the prompt tokens of a chat-completions body (text prompts).

    A byte-level BPE token (and a byte-fallback one) covers at least one byte, so the text
    the template renders is at most as many tokens as its UTF-8 bytes; the compact JSON of
    the messages and tools holds every such byte (and more). The template adds its own
    tokens: a few around each message, a preamble in front of a tool list, a default system
    prompt. Images and audio are not bounded by their bytes: for them the bill is the
    worker's report (clamped at the hold)."""
    messages = chat.get("messages") or []
    size = len(orjson.dumps(messages))
    overhead = TEMPLATE_OVERHEAD + PER_MESSAGE_OVERHEAD * (len(messages) if isinstance(messages, list) else 1)
    if chat.get("tools"):
        size += len(orjson.dumps(chat["tools"]))
        overhead += TOOLS_OVERHEAD
    return int(-(-size // bytes_per_token)) + overhead


def _loggable(usage: Any) -> Any:
    """The reported usage for a log line: bounded (it comes from the upstream)."""
    try:
        text = orjson.dumps(usage, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        text = repr(usage)
    return text[:500]


def _insufficient(message: str) -> APIError:
    return APIError(402, message, code="insufficient_quota", type="insufficient_quota")


def _settings(section: Any) -> tuple[float, int, float, dict[str, Any]]:
    """config.balance -> (hold_ttl_s, default output cap, bytes_per_token, Leases settings)."""
    lease_settings = {
        "max_micros": section.lease_max_micros,
        "seconds": section.lease_seconds,
        "min_rate": section.lease_min_rate,
        "idle_s": section.lease_idle_s,
        "ttl_s": section.lease_ttl_s,
        # Each commit is an fsync'd transaction plus a round trip to the writer thread: batching
        # the usage rows this far apart, rather than per request, spares a busy key's CPU per
        # request, for a SIGKILL window of the rows settled in the last lease_commit_ms.
        "linger_s": section.lease_commit_ms / 1000,
        # ...and no more rows than this wait for one: the rows a crash can lose stay bounded
        # in number too, and a commit is a function of the requests, not of the clock.
        "commit_rows": section.lease_commit_rows,
    }
    return section.hold_ttl_s, section.default_max_output_tokens, section.bytes_per_token, lease_settings


def _billable(out: Any, cancelled: bool) -> bool:
    """The upstream answered (completed / incomplete / failed / cancelled mid-stream), or the
    client left while the model server was working; else the hold is released."""
    reached = out is not None and out.upstream is not None
    answered = reached and (out.status in _ANSWERED or out.usage_reported or out.output_tokens > 0)
    return answered or (reached and cancelled)


def _needs_count(ctx: RequestContext, cancelled: bool) -> bool:
    """A bill without a usage report: the worker's tokenizer says what it processed."""
    out = ctx.outcome
    return (out is not None and _billable(out, cancelled) and not out.usage_reported
            and not out.extra.get("no_token_count"))


def _fit_cap(ctx: RequestContext, price: Price, found: Hold, est: int, wanted: int) -> Hold:
    """Hold the request's output to what `found` covers: a new Translation (with_cap), lowered
    and sent upstream when it covers less than wanted."""
    cap = min(wanted, max_output_tokens_for(price, found.amount_micros, est, 0))
    lowered = cap < wanted  # >= 1: at least `least` was held
    if lowered:
        ctx.notices.append(f"max_output_tokens lowered to {cap} to fit the balance")
    assert ctx.translation is not None  # translated before the hold
    ctx.translation = ctx.translation.with_cap(cap, lowered=lowered)
    return found


class _Billing:
    """One app's balance middleware: its settings, its price table and its Leases."""

    def __init__(self, app: web.Application, price_of: PriceTable, hold_ttl: float, default_cap: int,
                 bytes_per_token: float, lease_settings: dict[str, Any]) -> None:
        self.app = app
        self.price_of = price_of
        self.hold_ttl = hold_ttl
        self.default_cap = default_cap
        self.bytes_per_token = bytes_per_token
        self.lease_settings = lease_settings
        self.accounts: list[Leases] = []  # this app's, made on first use (the ledger opens at startup)
        self.settlements = app[state.SETTLEMENTS] = Settlements()

    def leases_for(self, ledger: RequestLedger) -> Leases:
        accounts = self.accounts
        if accounts and accounts[0].ledger is ledger:
            return accounts[0]
        made = Leases(ledger, hold_ttl_s=self.hold_ttl, tasks=self.settlements.tasks, **self.lease_settings)
        accounts[:] = [made]
        self.settlements.leases.add(made)
        return made

    def output_cap(self, t: Any) -> int:
        if t.max_output_tokens is not None:
            return int(t.max_output_tokens)
        models = self.app[state.POOL].models()
        window = models.get(t.upstream_model) or models.get(t.model)
        return int(window) if window else self.default_cap

    async def reserve(self, ctx: RequestContext, leases: Leases, key_id: str, t: Any, price: Price,
                      est: int, room: int | None = None) -> tuple[Hold, int]:
        """(the hold, the input bound it was sized with). `room`: what the key's budgets
        still allow (None: no budget); the hold, and so the output cap, stays within it."""
        wanted = self.output_cap(t)
        if wanted < 1:
            raise _insufficient("The available balance does not cover any output for this request.")
        # (no balance exceeds MAX_AMOUNT: a larger amount is simply one it cannot cover)
        least = min(cost_micros(price, est, 0, 1), MAX_AMOUNT)  # the input and one output token
        if room is not None:
            if room < least:
                raise APIError(402, "This API key's daily or monthly budget is spent; it resets at the start of "
                               "the next UTC day or month.", code="budget_exceeded", type="insufficient_quota")
            fits = max_output_tokens_for(price, room, est, 0)  # >= 1: room covers `least`
            if fits < wanted:
                wanted = fits
                assert ctx.translation is not None  # translated before the hold
                ctx.translation = ctx.translation.with_cap(fits)  # sent upstream and echoed
                ctx.notices.append(f"max_output_tokens lowered to {fits} to fit the key's budget")
        most = min(cost_micros(price, est, 0, wanted), MAX_AMOUNT)
        try:
            found = await leases.hold_up_to(ctx.request_id, key_id, least, most)
        except InsufficientBalance as exc:
            return await self.reserve_counted(ctx, leases, key_id, t, price, est, wanted, exc)
        return _fit_cap(ctx, price, found, est, wanted), est

    async def reserve_counted(self, ctx: RequestContext, leases: Leases, key_id: str, t: Any, price: Price,
                              est: int, wanted: int, exc: InsufficientBalance) -> tuple[Hold, int]:
        """The bytes bound did not fit: retry with the prompt as a worker counts it, else refuse."""
        # The bound from the prompt's bytes is generous (3-4x on English text): before a
        # refusal, a worker's tokenizer gives the prompt's real size, which may fit. Not
        # asked when even a 16-bytes-per-token prompt would not fit (an empty key's retries
        # cost the workers nothing).
        floor = cost_micros(price, max(1, (est - TEMPLATE_OVERHEAD) // 16), 0, 1)
        counted = await self.prompt_count(t) if exc.available_micros >= floor else None
        if counted is not None and counted < est and exc.available_micros >= cost_micros(price, counted, 0, 1):
            try:
                found = await leases.hold_up_to(ctx.request_id, key_id,
                                                min(cost_micros(price, counted, 0, 1), MAX_AMOUNT),
                                                min(cost_micros(price, counted, 0, wanted), MAX_AMOUNT))
            except InsufficientBalance as again:
                exc = again
            else:
                return _fit_cap(ctx, price, found, counted, wanted), counted
            est = counted
        if exc.available_micros < cost_micros(price, est, 0, 0):
            raise _insufficient("The available balance does not cover the input of this request. "
                                "Top up the key or send a shorter input.") from None
        raise _insufficient("The available balance does not cover any output for this request.") from None

    async def prompt_count(self, t: Any) -> int | None:
        """The prompt's tokens as a worker serving the model counts them; None when none can."""
        pool = self.app.get(state.POOL)
        session = self.app.get(state.SESSION)
        if pool is None or session is None:
            return None
        worker = next((w for w in pool.workers if w.available and w.serves(t.upstream_model)), None)
        if worker is None:
            return None
        try:
            return await count_tokens(session, worker, t.upstream_model, t.chat.get("messages") or [],
                                      t.chat.get("tools"))
        except (TokenCountError, Exception):  # a refusal stays a refusal when the count fails
            return None

    def count_corrections(self, fixes: list[str], hold: Hold, usage: Any) -> None:
        log.warning("usage corrected", request_id=hold.request_id, corrections=fixes,
                    reported=_loggable(usage))
        metrics = self.app.get(METRICS)
        if metrics is not None:
            for reason in fixes:
                metrics.usage_corrections.inc((reason,))

    async def worker_count(self, out: Any, t: Any) -> int | None:
        """The prompt as the worker that served it counts it (its tokenizer and template);
        None when it cannot say."""
        pool = self.app.get(state.POOL)
        session = self.app.get(state.SESSION)
        if pool is None or session is None or out is None:
            return None
        worker = next((w for w in pool.workers if w.name == out.upstream), None)
        if worker is None:
            return None
        try:
            return await count_tokens(session, worker, t.upstream_model, t.chat.get("messages") or [],
                                      t.chat.get("tools"))
        except (TokenCountError, Exception):  # billing never fails because a count could not be had
            return None

    def usage_of(self, ctx: RequestContext, hold: Hold, t: Any, price: Price, est: int, cancelled: bool,
                 counted_input: int | None) -> UsageRecord | None:
        """The usage to settle, or None to release the hold. Never raises."""
        request_id = hold.request_id
        out = ctx.outcome
        if out is None or not _billable(out, cancelled):
            return None
        assert ctx.translation is not None  # translated before the hold
        cap = ctx.translation.reserved_output
        media = t.prompt_size()[1]
        billed = clean_usage(out.reported_usage if out.usage_reported else None,
                             counted_output=out.counted_output,
                             input_fallback=counted_input if counted_input is not None else est,
                             input_bound=None if media else est, output_cap=cap, price=price,
                             hold_micros=hold.amount_micros)
        if billed.corrections:
            self.count_corrections(billed.corrections, hold, out.reported_usage)
        # What the access line and the metrics print: the billed figures.
        out.input_tokens, out.cached_tokens = billed.input_tokens, billed.cached_tokens
        out.output_tokens, out.reasoning_tokens = billed.output_tokens, billed.reasoning_tokens
        out.cost_micros = billed.cost_micros
        status = out.status if out.status in USAGE_STATUSES else ("cancelled" if cancelled else "error")
        return UsageRecord(
            request_id=request_id, key_id=hold.key_id, model=t.model,
            input_tokens=billed.input_tokens, cached_tokens=billed.cached_tokens, output_tokens=billed.output_tokens,
            reasoning_tokens=billed.reasoning_tokens, cost_micros=billed.cost_micros, status=status,
            worker=out.upstream, served_model=t.upstream_model, endpoint=ctx.path,
        )

    def finish(self, ctx: RequestContext, leases: Leases, hold: Hold, t: Any, price: Price, est: int,
               cancelled: bool, counted_input: int | None) -> asyncio.Task | None:
        try:
            usage = self.usage_of(ctx, hold, t, price, est, cancelled, counted_input)
        except Exception:
            log.exception("settlement failed", request_id=hold.request_id)
            # The upper bound, clamped at the hold: a request that reached the worker is never free.
            out = ctx.outcome
            usage = None if out is None or out.upstream is None else UsageRecord(
                request_id=hold.request_id, key_id=hold.key_id, model=t.model, input_tokens=est, cached_tokens=0,
                output_tokens=0, reasoning_tokens=0, cost_micros=min(hold.amount_micros, cost_micros(price, est, 0, 0)),
                status="error", worker=out.upstream, served_model=t.upstream_model, endpoint=ctx.path)
            if usage is not None and out is not None:
                out.cost_micros = usage.cost_micros
        return leases.finish(hold, usage, waited=not cancelled)

    async def settle(self, ctx: RequestContext, leases: Leases, hold: Hold, t: Any, price: Price, est: int,
                     cancelled: bool) -> None:
        counted = await self.worker_count(ctx.outcome, t) if _needs_count(ctx, cancelled) else None
        task = self.finish(ctx, leases, hold, t, price, est, cancelled, counted)
        if task is not None:
            await task

    def start_settling(self, ctx: RequestContext, leases: Leases, hold: Hold, t: Any, price: Price, est: int,
                       cancelled: bool) -> asyncio.Task | None:
        """Settle (or release) now; the task to wait for, None when it is done already (in
        memory, from a lease). The ledger work runs in a task of its own, which a cancelled
        handler (the client left) cannot interrupt and shutdown waits for."""
        if _needs_count(ctx, cancelled):
            task = asyncio.ensure_future(self.settle(ctx, leases, hold, t, price, est, cancelled))
            self.settlements.track(task)
            return task
        return self.finish(ctx, leases, hold, t, price, est, cancelled, None)

    async def bill(self, request: web.Request, ctx: RequestContext, call_next, ledger: RequestLedger,
                   record: Any) -> web.StreamResponse:
        """Hold, run the rest (the handler), settle (or release)."""
        key_id = record.key_id
        t = ctx.translation
        assert t is not None  # the translate phase runs before the balance
        price = self.price_of(t.model)
        est = estimate_input_tokens(t.chat, self.bytes_per_token)
        leases = self.leases_for(ledger)
        # A LedgerUnavailable here holds nothing: the envelope answers it 503 with Retry-After.
        room = await budget_room(ledger, record)
        hold, est = await self.reserve(ctx, leases, key_id, t, price, est, room)
        ctx.hold = hold
        settling: list[asyncio.Task | None] = []  # one entry once settlement started

        async def settle_now() -> None:
            """Settle before the answer's last bytes go out (the forwarder calls this before the
            end of a stream; a JSON body is written after this phase returns): a client that
            waits for its answer finds its balance settled. Never raises."""
            if not settling:
                settling.append(self.start_settling(ctx, leases, hold, t, price, est, False))
            task = settling[0]
            if task is not None and not task.done():
                await asyncio.shield(task)  # cancelled (the client left): the task goes on

        ctx.settle = settle_now
        try:
            try:
                response = await call_next(request, ctx)
            except asyncio.CancelledError:
                if not settling:  # the client left: settle in the background, never waited for
                    settling.append(self.start_settling(ctx, leases, hold, t, price, est, True))
                raise
            except BaseException:
                await settle_now()
                raise
            await settle_now()
            return response
        except asyncio.CancelledError:
            # Cancelled during the handler or while waiting for the settle: the settlement goes
            # on in its task; the envelope writes the access line and the metrics once it is
            # done, so they carry the billed figures.
            task = settling[0] if settling else None
            if task is not None and not task.done():
                ctx.settling = task
            raise
        finally:
            # ctx -> settle_now -> ctx: a cycle only the cyclic GC would free
            ctx.settle = None
            settling.clear()

    async def drain(self, app: web.Application) -> None:
        for leases in self.accounts:
            await leases.close()
        await self.settlements.wait()


def create(section: Any, app: web.Application):
    """config.yaml `balance` (config.balance); the prices from `prices` (checked at load)."""
    hold_ttl, default_cap, bytes_per_token, lease_settings = _settings(section)
    price_of = PriceTable(app[state.CONFIG].prices)
    billing = _Billing(app, price_of, hold_ttl, default_cap, bytes_per_token, lease_settings)

    async def balance(request: web.Request, ctx: RequestContext, call_next) -> web.StreamResponse:
        record = ctx.key
        if BALANCE not in ctx.unit.phases or record is None or is_static(record):
            return await call_next(request, ctx)
        ledger = app.get(state.LEDGER)  # this phase's app: the one whose ledger bills its requests
        if ledger is None:
            return await call_next(request, ctx)
        return await billing.bill(request, ctx, call_next, ledger, record)

    app.on_shutdown.append(billing.drain)
    return balance
