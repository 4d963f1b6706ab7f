"""Balance leases: per-request holds and settles without a ledger round trip.

A `Leases` object (one per process and ledger, on the event loop) sits between the balance
middleware and the ledger. For a key with steady traffic it keeps a LEASE: an amount
reserved in the database as ONE ordinary hold row (request id "lease:<pid>:<key>:<nonce>"),
from which request holds are taken in memory, with no await:

    hold_up_to(...)   in memory when the lease's free part covers the request's max; else
                      the exact ledger path: ONE op that gives the lease's free part back to
                      the database and does the ledger's atomic hold_up_to (so a key near
                      the end of its balance is served exactly as without leases: partial
                      holds, 402s, no overdraft)
    finish(hold, usage)   a lease hold: in memory, and the usage row is queued; the queue is
                      committed every `linger_s` (balance.lease_commit_ms, 20 ms), or as soon
                      as `commit_rows` wait (balance.lease_commit_rows, 64), in ONE
                      ledger transaction that inserts the rows (exactly once: UNIQUE
                      request_id), debits the balance and takes the same amount off the
                      lease row. A per-request hold: settle / release
                      in a task, as before.

Invariants (every commit boundary, across processes sharing the file):
  * balance decrease == sum of recorded debits (each row and its debit are one transaction);
  * available = balance - holds never goes below what it would be with per-request holds:
    a process only holds in memory what its lease row reserves in the database (free +
    held + queued costs == the row), and every lease row is a hold that other processes'
    hold_up_to and lease grows see;
  * a grow takes at most available // 2 of what the others left, and only when that covers
    at least one request like the current one, so small balances are not locked up by one
    process: they stay on the exact path.

Size. The lease is grown in the background ("ahead of need") when its free part drops under
half of its target: target = min(max_micros, 2 x the peak reservations of the key in flight
over the last second + lease_seconds x the key's spend per second). A key gets a lease only
after `min_rate` requests in (about) the last second in this process; a lease unused for
`idle_s` is dropped (its row deleted), and a free part beyond 2 x target is given back.

Expiry. The row expires `ttl_s` after its last renewal; renewals run every ttl_s / 3 while
the process lives. After a SIGKILL the row stays until it expires, then counts for nothing
(the ledger ignores expired holds) and the sweeper deletes it: nothing is charged for it.

The crash window is closed by the lease journal (proxy/ledger/lease_journal.py): each queued row
is written to a local file before its answer's end (fsync'd, group-committed: balance.lease_journal),
and a restart commits the rows a dead process left, exactly once by request id. A row the journal
cannot keep (a full disk) makes its answer wait for a commit with the ledger, started at once.
Nothing is billed twice and nothing is overdrawn.

If the event loop stalls longer than ttl_s, the row can expire under requests in flight;
the next commit or grow notices ("lapsed") and starts a new row with what is available,
the same as a per-request hold outliving its ttl (their costs are still debited, clamped
at the balance).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Any

from proxy.config import settings as config_settings
from proxy.ledger import Hold, LedgerUnavailable, RequestLedger, UsageRecord
from proxy.ledger.lease_journal import LeaseJournal

# Defaults of config.yaml `balance` and `ledger` (a Leases made without a configuration: tests, benches).
_BALANCE, _LEDGER = config_settings.of("balance"), config_settings.of("ledger")

log = logging.getLogger("proxy.ledger")

__all__ = ["Leases", "LeaseHold"]

_FORGET_S = 30.0  # a key without a lease, quiet this long, is forgotten (its rate starts afresh)


class LeaseHold(Hold):
    """A hold taken in memory from a lease (not a row of its own)."""

    __slots__ = ()


class _Key:
    __slots__ = (
        "key_id", "lease_id", "row", "free", "held", "queued", "committing", "growing", "grow_after",
        "last_used", "win_start", "count", "count_prev", "spend", "spend_prev", "peak", "peak_prev",
        "reserved", "typical",
    )

    def __init__(self, key_id: str, now: float) -> None:
        self.key_id = key_id
        self.lease_id = ""
        self.row = False  # a lease row is believed to exist
        self.free = 0  # reserved by the row, not held by a request, not queued to be debited
        self.held = 0  # held in memory by requests in flight
        self.queued = 0  # costs settled in memory, not committed yet
        self.committing = 0  # commits in flight that touch this lease
        self.growing = False
        self.grow_after = 0.0
        self.last_used = now
        self.win_start = now
        self.count = self.count_prev = 0  # requests in this / the previous 1 s window
        self.spend = self.spend_prev = 0  # costs settled in this / the previous window
        self.peak = self.peak_prev = 0  # peak reservations in flight (memory + rows)
        self.reserved = 0  # reservations in flight now, lease holds and per-request holds
        self.typical = 0  # the max hold of the latest request

    def roll(self, now: float) -> None:
        if now - self.win_start >= 1.0:
            if now - self.win_start >= 2.0:
                self.count_prev = self.spend_prev = self.peak_prev = 0
            else:
                self.count_prev, self.spend_prev, self.peak_prev = self.count, self.spend, self.peak
            self.count = self.spend = 0
            self.peak = self.reserved
            self.win_start = now

    def target(self, max_micros: int, seconds: float) -> int:
        # max()/min() spelled out: this runs on every lease hold, and the builtins' calls
        # cost more than the comparisons.
        peak = self.peak if self.peak > self.peak_prev else self.peak_prev
        if self.typical > peak:
            peak = self.typical
        spend = self.spend if self.spend > self.spend_prev else self.spend_prev
        target = 2 * peak + int(spend * seconds)
        return target if target < max_micros else max_micros


class Leases:
    def __init__(
        self,
        ledger: RequestLedger,
        *,
        hold_ttl_s: float,
        max_micros: int = _BALANCE.lease_max_micros,
        seconds: float = _BALANCE.lease_seconds,
        min_rate: int = _BALANCE.lease_min_rate,
        idle_s: float = _BALANCE.lease_idle_s,
        ttl_s: float = _BALANCE.lease_ttl_s,
        linger_s: float | None = None,
        commit_rows: int = _BALANCE.lease_commit_rows,
        tasks: set[asyncio.Task] | None = None,
        journal: str = _BALANCE.lease_journal,
    ) -> None:
        self.ledger = ledger
        self.hold_ttl_s = float(hold_ttl_s)
        self.enabled = ledger.supports_leases and max_micros > 0
        self.max_micros = int(max_micros)
        self.seconds = float(seconds)
        self.min_rate = int(min_rate)
        self.idle_s = float(idle_s)
        self.ttl_s = min(float(ttl_s), self.hold_ttl_s)  # never outlive a request hold
        if linger_s is None:  # no balance.lease_commit_ms given (tests, benches): ledger.settle_linger_ms's default
            linger_s = _LEDGER.settle_linger_ms / 1000
        self.linger_s = max(0.0, float(linger_s))
        self.commit_rows = max(1, int(commit_rows))
        self._keys: dict[str, _Key] = {}
        self._leased: dict[str, _Key] = {}  # request id -> key, for holds taken from a lease
        self._queue: list[tuple[_Key, str, UsageRecord]] = []
        # Each queued row on local disk before its answer ends (proxy/ledger/lease_journal.py):
        # balance.lease_journal says how ("fsync", "write"; "off": not at all).
        folder = ledger.lease_journal_path if self.enabled and journal != "off" else None
        self.journal = LeaseJournal(folder, fsync=journal == "fsync") if folder else None
        if self.journal is not None:
            self.journal.commit_now = self._journal_failed
        self._timer: asyncio.TimerHandle | None = None
        # commits, grows, per-request settles (shared with the caller's set when given)
        self._tasks: set[asyncio.Task] = tasks if tasks is not None else set()
        self._ticker: asyncio.Task | None = None
        self._nonce = f"{os.getpid()}:{secrets.token_hex(4)}"
        self._serial = 0
        self._closed = False
        self._said: dict[str, float] = {}  # what _say_once_a_minute last said, and when
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stats = {"lease_holds": 0, "exact_holds": 0, "grows": 0, "commits": 0, "lapsed": 0}

    # ------------------------------------------------------------------ the request path

    def _say_once_a_minute(self, what: str, line: str) -> None:
        """A warning that repeats with every request while an outage lasts: once a minute."""
        now = time.monotonic()
        if now - self._said.get(what, float("-inf")) >= 60.0:
            self._said[what] = now
            log.warning(line)

    async def hold_up_to(self, request_id: str, key_id: str, low: int, high: int) -> Hold:
        """As Ledger.hold_up_to (ttl: hold_ttl_s), from the key's lease when it can."""
        now = time.monotonic()
        k = self._keys.get(key_id)
        if k is None:
            if self.loop is None:
                self.loop = asyncio.get_running_loop()
            if self._ticker is None and not self._closed:
                self._ticker = asyncio.ensure_future(self._tick_forever())
            k = self._keys[key_id] = _Key(key_id, now)
        k.roll(now)
        k.count += 1
        k.last_used = now
        k.typical = high
        # A ledger with a fault (a dropped table, a rejected password) could not record what a
        # lease would serve: every request takes the exact path, which answers it 503.
        if self.enabled and not self._closed and self.ledger.fault is None:
            if k.row and k.free >= high:  # the common case: no await at all
                k.free -= high
                k.held += high
                self._reserve(k, high)
                self._leased[request_id] = k
                self.stats["lease_holds"] += 1
                if k.free * 2 < k.target(self.max_micros, self.seconds):
                    self._grow(k, now)
                return LeaseHold(request_id, key_id, high, 0.0)
            if k.count + k.count_prev >= self.min_rate:
                self._grow(k, now)
        # The exact path; the lease's free part goes back to the database in the same op.
        give_back = k.free if k.row and k.free > 0 else 0
        k.free -= give_back
        self.stats["exact_holds"] += 1
        if give_back:
            op = self.ledger.hold_up_to(request_id, key_id, low, high, self.hold_ttl_s,
                                        lease_return=(k.lease_id, give_back))
        else:
            op = self.ledger.hold_up_to(request_id, key_id, low, high, self.hold_ttl_s)
        # A client that goes away (aiohttp cancels its handler) while the hold is in flight
        # would leave a hold nobody knows of, refusing the key's next requests until it expires
        # (hold_ttl_s): the request's hold is released in a tracked task, queued behind the
        # operation in flight (the ledger runs one key's money moves in order), so a hold made
        # after all is given back; releasing one that was never made changes nothing.
        try:
            hold = await op
        except asyncio.CancelledError:
            self._spawn(self._settle_exact(Hold(request_id, key_id, 0, 0.0), None))
            raise
        self._reserve(k, hold.amount_micros)
        return hold

    def finish(self, hold: Hold, usage: UsageRecord | None, *, waited: bool = False) -> asyncio.Future | None:
        """Settle (usage) or release (None) a hold from hold_up_to; never waits. A lease hold
        is settled in memory at once, its row queued for the next commit and written to the
        journal: the future returned (None: nothing to wait for) is the row on disk; a
        per-request hold in the returned task (the caller may wait for either; `waited`: it
        will, so nothing lingers for company).
        A cost above the hold is clamped at it: a request never takes money held for another."""
        if usage is not None and not (type(usage.cost_micros) is int and 0 <= usage.cost_micros <= hold.amount_micros):
            log.warning("usage cost %r of request %s clamped at its hold %d", usage.cost_micros,
                        hold.request_id, hold.amount_micros)
            cost = usage.cost_micros if type(usage.cost_micros) is int else hold.amount_micros
            usage.cost_micros = min(max(0, cost), hold.amount_micros)
        k = self._keys.get(hold.key_id)
        if k is not None:
            k.reserved -= hold.amount_micros
            if usage is not None:
                k.roll(time.monotonic())
                k.spend += usage.cost_micros
        if k is not None and self._leased.pop(hold.request_id, None) is k:
            k.held -= hold.amount_micros
            if usage is None:
                k.free += hold.amount_micros
                return None
            k.queued += usage.cost_micros
            k.free += hold.amount_micros - usage.cost_micros
            self._queue.append((k, k.lease_id, usage))
            durable = self.journal.write(usage, k.lease_id, waited) if self.journal is not None else None
            if len(self._queue) >= self.commit_rows:
                if self._timer is not None:
                    self._timer.cancel()
                self._flush()
            elif self._timer is None and self.loop is not None and self._queue:
                self._timer = self.loop.call_later(self.linger_s, self._flush)
            return durable
        return self._spawn(self._settle_exact(hold, usage, waited))

    async def _settle_exact(self, hold: Hold, usage: UsageRecord | None, waited: bool = False) -> None:
        try:
            if usage is None:
                await self.ledger.release(hold.request_id, linger=not waited, key_id=hold.key_id)
            elif waited:  # the client's last bytes wait for this: durable, not necessarily applied yet
                await self.ledger.settle_behind(hold.request_id, usage)
            else:
                await self.ledger.settle(hold.request_id, usage)
        except Exception:
            # The hold stays and expires after hold_ttl_s: never a charge without a record.
            log.exception("settlement failed (request %s)", hold.request_id)

    # ------------------------------------------------------------------ background work

    def _reserve(self, k: _Key, amount: int) -> None:
        k.reserved += amount
        if k.reserved > k.peak:
            k.peak = k.reserved

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _grow(self, k: _Key, now: float) -> None:
        if k.growing or now < k.grow_after or self._closed:
            return
        want = k.target(self.max_micros, self.seconds) - max(0, k.free)
        if want < k.typical:
            return
        k.growing = True
        if not k.lease_id:
            self._serial += 1
            k.lease_id = f"lease:{self._nonce}:{k.key_id}:{self._serial}"
        self._spawn(self._do_grow(k, want))

    async def _do_grow(self, k: _Key, want: int) -> None:
        try:
            self.stats["grows"] += 1
            # At least one request like the latest, or nothing (then stay on the exact path).
            granted, existed = await self.ledger.lease_grow(
                k.lease_id, k.key_id, min(k.typical, want), want, self.ttl_s
            )
            if k.row and not existed:
                self._lapsed(k)
            k.row = bool(granted or existed)
            k.free += granted
            if granted == 0:
                k.grow_after = time.monotonic() + 1.0  # the balance is short: back off
        except LedgerUnavailable as exc:
            # The database away (or in a fault, which the ledger logs itself, once a minute):
            # the requests take the exact path meanwhile; said once a minute, not per request.
            k.grow_after = time.monotonic() + 1.0
            self._say_once_a_minute("lease grow", f"lease grow failed, the ledger is unavailable: {exc}")
        except Exception:
            k.grow_after = time.monotonic() + 1.0
            log.exception("lease grow failed (key %s)", k.key_id)
        finally:
            k.growing = False

    def _lapsed(self, k: _Key) -> None:
        # The row expired under us: it reserves nothing any more, so neither may we.
        self.stats["lapsed"] += 1
        log.warning("ledger lease %s lapsed (event loop stalled beyond its ttl?)", k.lease_id)
        k.free = -(k.held + k.queued)

    def _journal_failed(self, exc: OSError) -> None:
        """The journal could not keep a row (a full disk, a failed fsync): the rows written so
        far are committed now, and the journal's waiters wait for that commit instead."""
        self._say_once_a_minute("journal", f"lease journal {self.journal!r} cannot be written ({exc}): leased "
                                           "usage rows are committed with the ledger before their answers end")
        if self._timer is not None:
            self._timer.cancel()
        self._flush()

    def _flush(self, adjust: list[tuple[_Key, str, int, bool]] | None = None) -> asyncio.Task | None:
        self._timer = None
        batch, self._queue = self._queue, []
        if not batch and not adjust:
            return None
        touched = {k for k, _, _ in batch} | {k for k, _, _, _ in adjust or ()}
        for k in touched:
            k.committing += 1
        segment = self.journal.cut() if self.journal is not None and batch else None
        return self._spawn(self._commit(batch, adjust or [], touched, segment))

    async def _commit(self, batch: list[tuple[_Key, str, UsageRecord]],
                      adjust: list[tuple[_Key, str, int, bool]], touched: set[_Key],
                      segment: int | None = None) -> None:
        self.stats["commits"] += 1
        leases = [(lease_id, give_back, None if drop else self.ttl_s, drop)
                  for _, lease_id, give_back, drop in adjust]
        try:
            results, lapsed = await self.ledger.lease_commit(
                [(lid, u) for _, lid, u in batch], leases)
            committed = True
        except Exception:
            committed = False
            log.exception("committing %d usage records failed; they wait in the lease journal for the next start"
                          if self.journal is not None else "committing %d usage records failed; they stay unbilled",
                          len(batch))
            results, lapsed = [None] * len(batch), set()
        if segment is not None and self.journal is not None:
            self.journal.done(segment, committed)
        for (k, _, usage), result in zip(batch, results):
            k.queued -= usage.cost_micros
            debited = result if isinstance(result, int) else 0
            if isinstance(result, BaseException):
                log.error("usage of request %s not recorded: %s", usage.request_id, result)
            # Only `debited` left the row; the rest of what was set aside is free again.
            k.free += usage.cost_micros - debited
        for k in touched:
            k.committing -= 1
            if k.row and k.lease_id in lapsed:
                k.row = False
                self._lapsed(k)

    async def _tick_forever(self) -> None:
        period = max(0.05, min(self.ttl_s / 3, self.idle_s / 2, 1.0))
        while True:
            await asyncio.sleep(period)
            try:
                self._tick()
            except Exception:
                log.exception("lease renewal failed")

    def _tick(self, drop_idle_now: bool = False) -> asyncio.Task | None:
        """Renew every lease row; drop idle ones; give back a free part beyond 2 x target;
        forget keys without a lease that have been quiet for a while (bounded memory)."""
        now = time.monotonic()
        adjust: list[tuple[_Key, str, int, bool]] = []
        quiet: list[str] = []
        for k in self._keys.values():
            k.roll(now)
            if not k.row:
                if (k.reserved == 0 and k.held == 0 and k.queued == 0 and not k.growing
                        and k.committing == 0 and now - k.last_used > _FORGET_S):
                    quiet.append(k.key_id)
                continue
            idle = k.held == 0 and k.queued == 0 and not k.growing and k.committing == 0
            if idle and (drop_idle_now or now - k.last_used >= self.idle_s):
                adjust.append((k, k.lease_id, 0, True))
                k.row = False
                k.free = 0
                k.lease_id = ""  # a later lease is a new row: never confused with this drop
                continue
            give_back = 0
            target = k.target(self.max_micros, self.seconds)
            if k.free > 2 * target:
                give_back = k.free - target
                k.free -= give_back
            adjust.append((k, k.lease_id, give_back, False))
        for key_id in quiet:
            del self._keys[key_id]
        if self._timer is not None:
            self._timer.cancel()
        return self._flush(adjust)

    # ------------------------------------------------------------------ draining

    async def flush(self) -> None:
        """Commit the queued usage rows and wait for everything in flight."""
        while True:
            if self._timer is not None:
                self._timer.cancel()
                self._flush()
            loop = asyncio.get_running_loop()
            tasks = [t for t in self._tasks if not t.done() and t.get_loop() is loop]
            if not tasks:
                return
            await asyncio.wait(tasks, timeout=30)

    async def quiesce(self) -> None:
        """flush(), then give back every lease no request holds anything from."""
        await self.flush()
        if any(k.row for k in self._keys.values()):
            self._tick(drop_idle_now=True)
            await self.flush()

    async def close(self) -> None:
        self._closed = True
        await self.quiesce()
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if self.journal is not None:
            await self.journal.close()
