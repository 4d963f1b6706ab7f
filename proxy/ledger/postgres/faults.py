"""The PostgreSQL ledger's fault state: a mixin of PostgresLedger (proxy/ledger/postgres/ledger.py),
which supplies the connection settings, `stats`, `spool` and `retry_after_s`.

A driver error is classified by proxy/ledger/postgres/errors.py. An UNAVAILABLE one is only
answered (LedgerUnavailable: 503, the settlement spooled). A FAULT (no retry fixes it) is
also remembered in `fault` (its cause) until a probe passes: a fresh connection, so a
rejected password shows, reading every ledger table, so a missing one shows. Meanwhile new
holds and lease growth are refused at once (503 ledger_fault: what they would reserve could
not be settled), leases are not spent (proxy/ledger/lease.py), /readyz names the cause, and
the operator reads one log line when it starts (again each minute while it lasts) and one
when it ends. Settlements are never refused: they wait in the spool (proxy/ledger/postgres/spool.py).
"""

from __future__ import annotations

import logging
import time

import asyncpg

from proxy.ledger.base import FAULT_EXPLAINED as EXPLAIN, LedgerFault, LedgerUnavailable
from proxy.ledger.postgres.errors import FAULT, Failure, classify, describe
from proxy.ledger.spool import Spool

log = logging.getLogger("proxy.ledger")

_FAULT_LOG_EVERY_S = 60.0  # a fault that stays is logged again this often, not per request
# Every table the request path writes, and the columns it names most: the fault probe.
_PROBE = ("SELECT (SELECT count(*) FROM (SELECT key_id, balance_micros FROM keys LIMIT 1) k),"
          " (SELECT count(*) FROM (SELECT request_id, amount_micros, expires_at FROM holds LIMIT 1) h),"
          " (SELECT count(*) FROM (SELECT request_id, debited_micros FROM usage LIMIT 1) u),"
          " (SELECT count(*) FROM (SELECT key_id, micros FROM topups LIMIT 1) t)")


class PgFaults:
    fault: str | None = None
    _fault_logged: tuple[str | None, float] = (None, 0.0)
    # PostgresLedger's, which mixes this in (declared for the type checker: no value here)
    stats: dict[str, int]
    retry_after_s: float
    spool: Spool
    dsn: str
    connect_timeout_s: float
    statement_timeout_ms: int
    _settings: dict[str, str]

    def _failed(self, failure: Failure, exc: BaseException) -> LedgerUnavailable:
        """The error a driver failure becomes (every caller answers it 503, never 500)."""
        self.stats["unavailable"] += 1
        if failure.kind == FAULT:
            self._note_fault(failure.cause, describe(failure, exc))
            return LedgerFault(EXPLAIN.get(failure.cause, failure.cause), self.retry_after_s, failure.cause)
        return LedgerUnavailable(f"{EXPLAIN.get(failure.cause, 'the ledger database is unreachable')} "
                                 f"({type(exc).__name__})", self.retry_after_s, failure.cause)

    def _note_fault(self, cause: str, line: str) -> None:
        self.fault = cause
        now = time.monotonic()
        last_cause, last_at = self._fault_logged
        if last_cause != cause or now - last_at >= _FAULT_LOG_EVERY_S:
            self._fault_logged = (cause, now)
            log.error("ledger database fault (%s): %s. New requests get 503 ledger_fault and settlements are "
                      "spooled to %s until it is fixed", cause, line, self.spool.path)

    def _refuse_if_faulty(self) -> None:
        """New money reservations wait for the repair: what they would hold cannot be settled."""
        if self.fault is not None:
            self.stats["unavailable"] += 1
            raise LedgerFault(EXPLAIN.get(self.fault, self.fault), self.retry_after_s, self.fault)

    async def _probe(self) -> None:
        """While a fault lasts: a fresh connection (credentials, database) reading every
        ledger table (the schema); the fault is cleared only when this passes."""
        conn = await asyncpg.connect(self.dsn, timeout=self.connect_timeout_s, server_settings=self._settings,
                                     command_timeout=self.statement_timeout_ms / 1000 + 1.0)
        try:
            await conn.fetchrow(_PROBE)
        finally:
            await conn.close()

    async def check_fault(self) -> str | None:
        """Probe when faulty; the cause that remains (None: healthy). Never raises."""
        if self.fault is None:
            return None
        try:
            await self._probe()
        except Exception as exc:
            failure = classify(exc)
            if failure is not None and failure.kind == FAULT:
                self._note_fault(failure.cause, describe(failure, exc))
            return self.fault
        log.warning("ledger database fault (%s) is fixed: serving again", self.fault)
        self.fault, self._fault_logged = None, (None, 0.0)
        return None


__all__ = ["PgFaults"]
