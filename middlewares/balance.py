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
  * the input is bounded from above by the prompt's bound (proxy.protocol.prompt.prompt_bound,
    the context check's too): the UTF-8 bytes of the text the template renders / bytes_per_token
    (a byte-level BPE token covers at least one byte: digits and punctuation reach one token
    per byte) + the chat template's tokens. Real tokenizers average 3-4 bytes per token on
    English, so the hold is generous; the bill is what the worker reports (see below), not
    this bound.
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

Settlement, from the handler's AnswerReport (ctx.report) when the handler returns, before the
answer's last bytes are sent (a stream's end is the request's Tail, which the envelope writes
after the phases; a JSON body is written after them too), so a client that waited for its
answer finds its balance settled; the bill is the context's `bill`. When the
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

The hold commits without an fsync (the ledger's hold_synchronous, see proxy/ledger/sqlite/ledger.py
for why that is safe). A per-request hold's settle is fsync'd and the end of the answer waits
for it (one commit, without the settle linger); a lease hold's settle is an in-memory debit,
its usage row committed (fsync'd) within lease_commit_ms after the answer ended.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.ledger import USAGE_STATUSES, Hold, InsufficientBalance, RequestLedger, UsageRecord
from proxy.ledger.base import is_static
from proxy.ledger.lease import Leases
from proxy.ledger.pricing import Price, PriceTable, cost_micros, max_output_tokens_for
from proxy.ledger.service import budget_room
from proxy.ledger.usage import MAX_AMOUNT, clean_usage
from proxy.logs import log
from proxy.protocol.answer_report import AnswerReport, Tokens
from proxy.protocol.passthrough import Passthrough
from proxy.protocol.prompt import TEMPLATE_OVERHEAD, prompt_bound
from proxy.protocol.translate import Translation
from proxy.runtime.metrics import METRICS
from proxy.runtime.reload import RELOADERS
from proxy.state import Bill, RequestContext
from proxy.upstream.tokens import TokenCounter

# What the balance holds for: a Responses request or a pass-through one.
Priced = Translation | Passthrough

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Balance

_ANSWERED = ("completed", "incomplete", "failed", "cancelled")


class Settlements:
    """One app's ledger work in flight: the settle tasks (a strong reference each, so none is
    collected mid-way) and the app's Leases. On the app (SETTLEMENTS), so waiting for
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
    settlements = app.get(SETTLEMENTS)
    if settlements is not None:
        await settlements.wait(timeout)
    ledger = app.get(state.LEDGER)
    if ledger is not None:
        await ledger.settled(timeout)  # written durably; in the database too (a server-side ledger)


def _loggable(usage: Any) -> Any:
    """The reported usage for a log line: bounded (it comes from the upstream)."""
    try:
        text = orjson.dumps(usage, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        text = repr(usage)
    return text[:500]


def _budget_refusal(room: int, least: int) -> str:
    """Why a key's budget refuses a request: spent, or too little left for its smallest hold."""
    resets = "it resets at the start of the next UTC day or month"
    if room <= 0:
        return f"This API key's daily or monthly budget is spent; {resets}."
    return (f"This API key's daily or monthly budget has {room} micro-units left, less than this request's "
            f"smallest hold ({least} micro-units: its input and one output token); {resets}.")


def _whose_room(ctx: RequestContext, exc: InsufficientBalance) -> str:
    """" (the team ml's balance or budget this period)" when a level above the key was the
    bound (proxy/ledger/levels.py), else nothing: the key's holder learns which purse ran out."""
    level = next((lv for lv in ctx.levels if lv.level_id == exc.level), None) if exc.level else None
    if level is None:
        return ""
    what = " and ".join(part for part, there in (("balance", level.balance_micros is not None),
                                                 (f"{level.budget_period} budget", level.budget_micros is not None))
                        if there)
    return f" (the {level.kind} {level.name[:64]!r}'s {what or 'room'}, shared by its keys)"


def _insufficient(message: str) -> APIError:
    return APIError(402, message, code="insufficient_quota", type="insufficient_quota")


def _settings(section: Balance) -> tuple[float, int, float, dict[str, Any]]:
    """config.balance -> (hold_ttl_s, default output cap, bytes_per_token, Leases settings)."""
    lease_settings = {
        "max_micros": section.lease_max_micros,
        "seconds": section.lease_seconds,
        "min_rate": section.lease_min_rate,
        "idle_s": section.lease_idle_s,
        "ttl_s": section.lease_ttl_s,
        # Each commit is a ledger transaction plus a round trip to its writer: batching the
        # usage rows this far apart, rather than per request, spares a busy key's CPU per
        # request; each row is on local disk before its answer ends all the same (the journal).
        "linger_s": section.lease_commit_ms / 1000,
        # ...and no more rows than this wait for one: a commit is a function of the requests,
        # not of the clock, and the journal a restart replays stays short.
        "commit_rows": section.lease_commit_rows,
        "journal": section.lease_journal,
    }
    return section.hold_ttl_s, section.default_max_output_tokens, section.bytes_per_token, lease_settings


def _billable(report: AnswerReport | None, cancelled: bool) -> bool:
    """The upstream answered (completed / incomplete / failed / cancelled mid-stream), or the
    client left while the model server was working; else the hold is released."""
    if report is None or report.upstream is None:
        return False
    return cancelled or report.status in _ANSWERED or report.usage is not None or report.shown.output > 0


def _needs_count(report: AnswerReport | None, cancelled: bool) -> bool:
    """A bill without a usage report: the worker's tokenizer says what it processed."""
    return (report is not None and _billable(report, cancelled) and report.usage is None
            and not report.count_failed)


def _per_answer(price: Price, amount: int, est: int, choices: int) -> int:
    """The output cap each of `choices` answers may have within `amount`."""
    covered = max_output_tokens_for(price, amount, est, 0)
    return covered if choices == 1 else covered // choices


def _fit_cap(ctx: RequestContext, t: Priced, price: Price, found: Hold, est: int,
             wanted: int) -> tuple[Hold, Priced]:
    """(the hold, `t` with its output held to what `found` covers: a new Translation (with_cap),
    lowered and sent upstream when it covers less than wanted)."""
    cap = min(wanted, _per_answer(price, found.amount_micros, est, t.choices))
    lowered = cap < wanted  # >= 1: at least `least` was held
    if lowered:
        ctx.notices.append(f"max_output_tokens lowered to {cap} to fit the balance")
    return found, t.with_cap(cap, lowered=lowered)


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
        self.settlements = app[SETTLEMENTS] = Settlements()

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

    async def reserve(self, ctx: RequestContext, leases: Leases, key_id: str, t: Priced, price: Price,
                      est: int, room: int | None = None) -> tuple[Hold, Priced, int]:
        """(the hold, `t` capped to it, the input bound it was sized with). `room`: what the key's
        budgets still allow (None: no budget); the hold, and so the output cap, stays within it."""
        wanted = self.output_cap(t)
        if wanted < 1:
            raise _insufficient("The available balance does not cover any output for this request.")
        # (no balance exceeds MAX_AMOUNT: a larger amount is simply one it cannot cover)
        choices = t.choices  # n answers (a pass-through's n, best_of, batch): each up to the cap
        least = min(cost_micros(price, est, 0, choices), MAX_AMOUNT)  # the input and one output token each
        capped = t
        if room is not None:
            if room < least:
                raise APIError(402, _budget_refusal(room, least), code="budget_exceeded", type="insufficient_quota")
            fits = _per_answer(price, room, est, choices)  # >= 1: room covers `least`
            if fits < wanted:
                wanted = fits
                capped = t.with_cap(fits)  # sent upstream and echoed
                ctx.notices.append(f"max_output_tokens lowered to {fits} to fit the key's budget")
        most = min(cost_micros(price, est, 0, wanted * choices), MAX_AMOUNT)
        try:
            found = await leases.hold_up_to(ctx.request_id, key_id, least, most)
        except InsufficientBalance as exc:
            return await self.reserve_counted(ctx, leases, key_id, t, capped, price, est, wanted, exc)
        return (*_fit_cap(ctx, capped, price, found, est, wanted), est)

    async def reserve_counted(self, ctx: RequestContext, leases: Leases, key_id: str, t: Priced,
                              capped: Priced, price: Price, est: int, wanted: int,
                              exc: InsufficientBalance) -> tuple[Hold, Priced, int]:
        """The bytes bound did not fit: retry with the prompt as a worker counts it, else refuse."""
        # The bound from the prompt's bytes is generous (3-4x on English text): before a
        # refusal, a worker's tokenizer gives the prompt's real size, which may fit. Not
        # asked when even a 16-bytes-per-token prompt would not fit (an empty key's retries
        # cost the workers nothing).
        choices = t.choices
        floor = cost_micros(price, max(1, (est - TEMPLATE_OVERHEAD) // 16), 0, choices)
        counted = await self.prompt_count(t) if exc.available_micros >= floor else None
        if counted is not None and counted < est and exc.available_micros >= cost_micros(price, counted, 0, choices):
            try:
                found = await leases.hold_up_to(ctx.request_id, key_id,
                                                min(cost_micros(price, counted, 0, choices), MAX_AMOUNT),
                                                min(cost_micros(price, counted, 0, wanted * choices), MAX_AMOUNT))
            except InsufficientBalance as again:
                exc = again
            else:
                return (*_fit_cap(ctx, capped, price, found, counted, wanted), counted)
            est = counted
        whose = _whose_room(ctx, exc)
        if exc.available_micros < cost_micros(price, est, 0, 0):
            raise _insufficient(f"The available balance{whose} does not cover the input of this request. "
                                "Top up the key or send a shorter input.") from None
        raise _insufficient(f"The available balance{whose} does not cover any output for this request.") from None

    def counter(self) -> TokenCounter:
        return TokenCounter(self.app.get(state.SESSION), self.app.get(state.POOL))

    async def prompt_count(self, t: Any) -> int | None:
        """The prompt's tokens as a worker serving the model counts them; None when none can
        (a refusal stays a refusal)."""
        return await self.counter().prompt(t)

    def count_corrections(self, fixes: list[str], hold: Hold, usage: Any) -> None:
        log.warning("usage corrected", request_id=hold.request_id, corrections=fixes,
                    reported=_loggable(usage))
        metrics = self.app.get(METRICS)
        if metrics is not None:
            for reason in fixes:
                metrics.usage_corrections.inc((reason,))

    async def worker_count(self, report: AnswerReport, t: Any) -> int | None:
        """The prompt as the worker that served it counts it (its tokenizer and template);
        None when it cannot say (billing never fails because a count could not be had)."""
        return await self.counter().prompt(t, report.upstream) if report.upstream else None

    def usage_of(self, ctx: RequestContext, report: AnswerReport | None, hold: Hold, t: Any, price: Price, est: int,
                 cancelled: bool, counted_input: int | None) -> UsageRecord | None:
        """The usage to settle, or None to release the hold. Never raises."""
        if report is None or not _billable(report, cancelled):
            return None
        cap = t.reserved_output  # the capped translation (the output the hold was sized for)
        if cap is not None and t.choices != 1:
            cap *= t.choices  # each answer up to the cap
        media = t.prompt_bound().media
        billed = clean_usage(report.usage, counted_output=report.counted_output,
                             input_fallback=counted_input if counted_input is not None else est,
                             input_bound=None if media else est, output_cap=cap, price=price,
                             hold_micros=hold.amount_micros)
        if billed.corrections:
            self.count_corrections(billed.corrections, hold, report.usage)
        # What the access line and the metrics print: the billed figures.
        ctx.bill = Bill(Tokens(billed.input_tokens, billed.cached_tokens, billed.output_tokens,
                               billed.reasoning_tokens), billed.cost_micros)
        status = report.status if report.status in USAGE_STATUSES else ("cancelled" if cancelled else "error")
        return UsageRecord(
            request_id=hold.request_id, key_id=hold.key_id, model=t.model,
            input_tokens=billed.input_tokens, cached_tokens=billed.cached_tokens, output_tokens=billed.output_tokens,
            reasoning_tokens=billed.reasoning_tokens, cost_micros=billed.cost_micros, status=status,
            worker=report.upstream, served_model=t.upstream_model, endpoint=ctx.path, transport=ctx.transport,
            latency_ms=round((time.perf_counter() - ctx.started_at) * 1000, 1),
        )

    def finish(self, ctx: RequestContext, leases: Leases, hold: Hold, t: Any, price: Price, est: int,
               cancelled: bool, counted_input: int | None) -> asyncio.Future | None:
        report = ctx.report
        try:
            usage = self.usage_of(ctx, report, hold, t, price, est, cancelled, counted_input)
        except Exception:
            log.exception("settlement failed", request_id=hold.request_id)
            # The upper bound, clamped at the hold: a request that reached the worker is never free.
            usage = None if report is None or report.upstream is None else UsageRecord(
                request_id=hold.request_id, key_id=hold.key_id, model=t.model, input_tokens=est, cached_tokens=0,
                output_tokens=0, reasoning_tokens=0, cost_micros=min(hold.amount_micros, cost_micros(price, est, 0, 0)),
                status="error", worker=report.upstream, served_model=t.upstream_model, endpoint=ctx.path)
            if usage is not None:
                ctx.bill = Bill(Tokens(input=est), usage.cost_micros)
        return leases.finish(hold, usage, waited=not cancelled)

    async def settle(self, ctx: RequestContext, leases: Leases, hold: Hold, t: Any, price: Price, est: int,
                     cancelled: bool) -> None:
        report = ctx.report
        counted = await self.worker_count(report, t) if report is not None and _needs_count(report, cancelled) else None
        task = self.finish(ctx, leases, hold, t, price, est, cancelled, counted)
        if task is not None:
            await task

    def start_settling(self, ctx: RequestContext, leases: Leases, hold: Hold, t: Any, price: Price, est: int,
                       cancelled: bool) -> asyncio.Future | None:
        """Settle (or release) now; the task to wait for, None when it is done already (in
        memory, from a lease). The ledger work runs in a task of its own, which a cancelled
        handler (the client left) cannot interrupt and shutdown waits for."""
        if _needs_count(ctx.report, cancelled):
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
        bound = t.prompt_bound()  # computed once with the translation, at one byte per token
        est = bound.tokens if self.bytes_per_token == 1 else \
            prompt_bound(t.chat, (bound.text, bound.media), self.bytes_per_token).tokens
        leases = self.leases_for(ledger)
        # A LedgerUnavailable here holds nothing: the envelope answers it 503 with Retry-After.
        room = await budget_room(ledger, record)
        hold, t, est = await self.reserve(ctx, leases, key_id, t, price, est, room)
        ctx.hold, ctx.capped = hold, t  # the handler answers the capped translation (ctx.to_answer())
        try:
            response = await call_next(request, ctx)
        except asyncio.CancelledError:
            # The client left: the settlement runs in a task of its own, never waited for; the
            # envelope writes the access line and the metrics once it is done, so they carry
            # the billed figures.
            task = self.start_settling(ctx, leases, hold, t, price, est, True)
            if task is not None and not task.done():
                ctx.settling = task
            raise
        except BaseException:
            await self.settled(ctx, leases, hold, t, price, est)
            raise
        # Before the answer's last bytes go out (a stream's end is the envelope's to write, a
        # JSON body is written after the phases return): a client that waits for its answer
        # finds its balance settled.
        await self.settled(ctx, leases, hold, t, price, est)
        return response

    async def settled(self, ctx: RequestContext, leases: Leases, hold: Hold, t: Any, price: Price, est: int) -> None:
        """Settle the answer and wait for it. Cancelled (the client left) while the ledger works,
        the settlement goes on in its task and the envelope waits for it (ctx.settling)."""
        task = self.start_settling(ctx, leases, hold, t, price, est, False)
        if task is None or task.done():
            return
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            ctx.settling = task
            raise

    async def drain(self, app: web.Application) -> None:
        for leases in self.accounts:
            await leases.close()
        await self.settlements.wait()


def create(section: Balance, app: web.Application):
    """config.yaml `balance` (config.balance); the prices from `prices` (checked at load)."""
    hold_ttl, default_cap, bytes_per_token, lease_settings = _settings(section)
    price_of = PriceTable(app[state.CONFIG].prices)
    billing = _Billing(app, price_of, hold_ttl, default_cap, bytes_per_token, lease_settings)
    reloaders = app.get(RELOADERS)
    if reloaders is not None:  # new prices for new requests; one in flight keeps the price it read at its start
        reloaders.on("prices", lambda new: partial(setattr, billing, "price_of", PriceTable(new.prices)))

    async def balance(request: web.Request, ctx: RequestContext, call_next) -> web.StreamResponse:
        record = ctx.key
        if record is None or is_static(record):
            return await call_next(request, ctx)
        ledger = app.get(state.LEDGER)  # this phase's app: the one whose ledger bills its requests
        if ledger is None:
            return await call_next(request, ctx)
        return await billing.bill(request, ctx, call_next, ledger, record)

    app.on_shutdown.append(billing.drain)
    return balance


SETTLEMENTS = web.AppKey("settlements", Settlements)  # middlewares.balance: the ledger work in flight
