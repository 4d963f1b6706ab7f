"""The PostgreSQL ledger's spool: settlements written to a local file first, applied to the
database after. A mixin of PostgresLedger (proxy/ledger/postgres/ledger.py), which supplies `_db`,
`spool` (proxy/ledger/spool.py), `stats`, the fault state (proxy/ledger/postgres/faults.py) and
`replay_interval_s`.

Two ways in, one way out:
  * `settle_behind` (the balance phase's settlement of a request it waits for): the record is
    appended to the spool and fsync'd (group-committed with every other settlement arriving
    meanwhile: one fsync for them all), and that is all the client's last bytes wait for. The
    drainer applies it to the database a moment later.
  * `_spool` (settle, release or lease_commit that could not reach the database, whatever the
    reason): the same file.
  * the drainer (`_drain_forever`), woken by each append and every replay_interval_s: the
    spool's records in batches, one transaction each (proxy/ledger/postgres/usage.py settle_batch,
    insert_usage_batch), exactly once by request id.

Why this keeps every guarantee (README "PostgreSQL: what each fault gets"):
  * durable: the record is on the local disk before the client's answer ends; a crash of the
    process, or of the database, replays it at the next start (or the next drain);
  * exactly once: UNIQUE(usage.request_id), checked under the key's row lock; replaying a
    line twice (a crash between the commit and the unlink) debits nothing twice;
  * never above the hold, never an overdraft: the request's hold row stays in the database,
    counted against the key's available balance by every replica, until the transaction that
    inserts its usage row deletes it; the debit is clamped at that hold and at the balance;
  * read your writes here: `settled()` waits (bounded) for this process's settlements, and
    the reads a client makes after its answer (available, usage) call it.
A database that stays away longer than hold_ttl_s lets the hold expire before the drain: the
key may then spend that money again, and the late debit is clamped at the balance (never
negative), as it always was for a settlement spooled in an outage.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from proxy.ledger.base import (
    FAULT_EXPLAINED as EXPLAIN,
    LedgerDataRefused,
    LedgerFault,
    LedgerUnavailable,
    UnknownKey,
    UsageRecord,
)
from proxy.ledger.commit_rules import usage_row
from proxy.ledger.postgres.usage import insert_usage_batch, lease_changes, settle_batch
from proxy.ledger.schema import check_usage_values
from proxy.ledger.spool import APPLIED, KEPT, REJECTED, Spool, settle_record, usage_of

log = logging.getLogger("proxy.ledger")

SETTLED_WAIT_S = 2.0  # how long a read waits for this process's settlements to be applied
SPOOL_ROOM_BYTES = 16 * 1024  # free room that ends a full spool's fault


class PgSpoolOps:
    _wake: asyncio.Event | None = None
    _written = 0  # records settle_behind wrote
    spool_fault: str | None = None  # "spool_full" | "spool_unwritable": the last write failed
    _spool_said = float("-inf")
    _drained = 0  # _written as it was when the last complete drain began
    # PostgresLedger's, which mixes this in (declared for the type checker: no value here)
    spool: Spool
    stats: dict[str, int]
    fault: str | None
    retry_after_s: float
    replay_interval_s: float
    _closed: bool
    _kept_logged: set[str]
    _db: Callable[..., Awaitable[Any]]
    if TYPE_CHECKING:  # PgFaults' and PostgresLedger's, mixed in beside this
        async def check_fault(self) -> str | None: ...
        async def settle(self, request_id: str, usage: UsageRecord, *, linger: bool = True) -> bool: ...

    async def settle_behind(self, request_id: str, usage: UsageRecord) -> None:
        """Record a settlement durably (the local spool, fsync'd) and return: the drainer
        applies it to the database, exactly once (see the module's docstring)."""
        if not request_id:
            raise ValueError("request_id is required")
        check_usage_values(usage)
        try:
            await self.spool.write([settle_record(request_id, usage)])
        except OSError as exc:
            # The spool cannot take it (a full disk, a read-only or vanished folder): settled
            # with the database directly, which is durable too; /readyz says the spool's fault.
            self._spool_failed(exc)
            await self.settle(request_id, usage)
            return
        if self.spool_fault is not None:
            self._spool_writable()
        self._written += 1
        self._wake_drainer()

    def _spool_failed(self, exc: OSError) -> None:
        cause = "spool_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "spool_unwritable"
        now = time.monotonic()
        if cause != self.spool_fault or now - self._spool_said >= 60.0:
            self._spool_said = now
            log.error("ledger spool %s cannot be written (%s): settling with the database directly; if it "
                      "fails too, the settlement is lost: /readyz is not ready until the spool is writable",
                      self.spool.path, exc.strerror or exc)
        self.spool_fault = cause

    def _probe_spool(self) -> None:
        """While the spool's fault lasts (each replay interval): room and the right to write
        again end it, settlements or not."""
        folder = self.spool.path.parent
        try:
            room = os.statvfs(folder)
            free = room.f_bavail * room.f_frsize
        except OSError:
            return
        if free >= SPOOL_ROOM_BYTES and os.access(folder, os.W_OK):
            self._spool_writable()

    def _spool_writable(self) -> None:
        log.warning("ledger spool %s is writable again", self.spool.path)
        self.spool_fault = None

    def _wake_drainer(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def settled(self, timeout: float = SETTLED_WAIT_S) -> None:
        """Wait (at most `timeout`) until every settlement this process wrote until now is in
        the database; never raises."""
        target = self._written
        deadline = time.monotonic() + timeout
        while self._drained < target and time.monotonic() < deadline and not self._closed:
            self._wake_drainer()
            await asyncio.sleep(0.002)

    async def _spool(self, records: list[dict[str, Any]], why: BaseException | None = None) -> None:
        # On disk (fsync'd) before the settle returns; in a thread, so the fsync stalls only
        # this request, not the event loop.
        await self.spool.write(records)
        self.stats["spooled"] += len(records)
        reason = ("the ledger database is unreachable" if why is None or type(why) is LedgerUnavailable
                  else f"{type(why).__name__}: {str(why)[:200]}")
        for record in records:
            log.warning("ledger: %s of %s spooled to %s (%s)", record["kind"], record["request_id"],
                        self.spool.path, reason)

    # ------------------------------------------------------------------ applying the spool

    def _sort(self, records: list[dict[str, Any]], verdicts: list[str]) -> tuple[list, list, list]:
        """(release ids, [(index, row)] of settles, [(index, row, lease id)] of lease rows);
        a record that is no valid settlement gets REJECTED."""
        releases: list[str] = []
        settles: list[tuple[int, tuple]] = []
        leased: list[tuple[int, tuple, str]] = []
        for i, record in enumerate(records):
            if record["kind"] == "release":
                releases.append(record["request_id"])
                continue
            try:
                usage = usage_of(record)
                check_usage_values(usage)
                row = usage_row(usage, record["request_id"])
            except (ValueError, TypeError, KeyError) as exc:
                log.error("ledger spool: %s of %s is not a valid settlement (%s): set aside", record["kind"],
                          record.get("request_id"), exc)
                verdicts[i] = REJECTED
                continue
            if record["kind"] == "lease_usage":
                leased.append((i, row, str(record.get("lease_id") or "")))
            else:
                settles.append((i, row))
        return releases, settles, leased

    async def _replay_batch(self, records: list[dict[str, Any]]) -> list[str]:
        """A batch of spool records in one transaction. LedgerUnavailable (a fault included)
        propagates: the replay stops, this batch and the rest wait."""
        verdicts = [APPLIED] * len(records)
        releases, settles, leased = self._sort(records, verdicts)

        async def op(conn: Any) -> list[tuple[int, Any]]:
            out: list[tuple[int, Any]] = []
            if releases:
                await conn.execute("DELETE FROM holds WHERE request_id = ANY($1::text[])", releases)
            if settles:
                results = await settle_batch(conn, [row for _, row in settles])
                out += [(i, result) for (i, _), result in zip(settles, results)]
            if leased:
                results, taken = await insert_usage_batch(conn, [row for _, row, _ in leased],
                                                          [lease_id for _, _, lease_id in leased])
                await lease_changes(conn, taken, [], time.time())
                out += [(i, result) for (i, _, _), result in zip(leased, results)]
            return out

        if releases or settles or leased:
            try:
                results = await self._db(op)
            except LedgerDataRefused:
                # One record's data the database refuses (22xxx) fails the whole transaction:
                # each is tried alone, so that one is set aside and the others applied.
                if len(records) == 1:
                    log.error("ledger spool: %s of %s refused by the database for its data: set aside in %s",
                              records[0]["kind"], records[0].get("request_id"), self.spool.rejected_path)
                    return [REJECTED]
                out: list[str] = []
                for record in records:
                    out += await self._replay_batch([record])
                return out
            for i, result in results:
                if isinstance(result, UnknownKey):  # the key row is gone (a table restored from an old backup?)
                    verdicts[i] = KEPT
                    if records[i]["request_id"] not in self._kept_logged:
                        self._kept_logged.add(records[i]["request_id"])
                        log.error("ledger spool: %s of %s waits: %s", records[i]["kind"], records[i]["request_id"],
                                  result)
                elif isinstance(result, BaseException):
                    verdicts[i] = REJECTED
        return verdicts

    async def replay_spool(self) -> int:
        """Replay the spool now; how many records were applied (LedgerUnavailable stops it:
        the rest waits, nothing is lost). While a fault lasts, only once a probe passes."""
        if await self.check_fault() is not None:
            raise LedgerFault(EXPLAIN.get(self.fault or "", "fault"), self.retry_after_s, self.fault or "")
        mark = self._written
        done = await self.spool.replay(self._replay_batch)
        self._drained = max(self._drained, mark)
        self.stats["replayed"] += done
        if done and self.stats["spooled"]:  # not each settle_behind's drain: those are the normal path
            log.info("ledger spool: %d settlement(s) replayed", done)
        return done

    async def _drain_forever(self) -> None:
        """Apply the spool when woken (a settlement written) or every replay_interval_s; after
        a failure, wait replay_interval_s whatever wakes it (a database away is not hammered)."""
        self._wake = asyncio.Event()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.replay_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            if self.spool_fault is not None:
                self._probe_spool()
            if self.fault is not None and not self.spool.pending():
                await self.check_fault()  # the repair is noticed with nothing to replay too
            mark = self._written  # before the look: each record it counts is on disk by now
            if not self.spool.pending():
                self._drained = max(self._drained, mark)
                continue
            try:
                await self.replay_spool()
                continue
            except LedgerUnavailable:
                pass
            except Exception:
                log.exception("ledger spool replay failed")
            await asyncio.sleep(self.replay_interval_s)


__all__ = ["PgSpoolOps", "SETTLED_WAIT_S"]
