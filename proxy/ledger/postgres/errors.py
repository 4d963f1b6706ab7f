"""What an error from the PostgreSQL driver (asyncpg) means for the ledger: pure, no I/O.

    failure = classify(exc)       # None: not the database's (our own refusals, a bug)
    failure.kind                  # RETRY, UNAVAILABLE or FAULT
    failure.cause                 # "unreachable", "auth_failed", "schema_missing", ...

Three answers, because an operator and a client need different things from each:

  RETRY        the transaction lost a race (deadlock, serialisation) or ran a statement
               cached before a schema change: run it again at once.
  UNAVAILABLE  the database cannot answer now and will by itself (stopped, restarting,
               frozen, a broken connection, too many connections, a cancelled statement):
               503 ledger_unavailable with Retry-After, settlements spooled and replayed.
  FAULT        the database answers, but no retry fixes it (a rejected password, a missing
               table or database, no privilege, read-only, a full disk, any error we did not
               foresee): 503 ledger_fault naming the cause, /readyz not ready with it, one
               log line when it starts and one when it ends, exit 2 at start-up; settlements
               are spooled and stay until a replay after the repair applies them.

Whatever the class, nothing the driver raises reaches a client as 500: the unforeseen
falls in FAULT, the safe side (the operator is told; money is not moved).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import asyncpg
from asyncpg import exceptions as pg

from proxy.ledger.base import FAULT_EXPLAINED as EXPLAIN

RETRY = "retry"
UNAVAILABLE = "unavailable"
FAULT = "fault"


class Failure(NamedTuple):
    kind: str  # RETRY, UNAVAILABLE or FAULT
    cause: str  # a stable code for /readyz, the 503's message and the metrics


# First match wins: subclasses before their bases.
_TABLE: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], str, str], ...] = (
    ((pg.DeadlockDetectedError, pg.SerializationError, pg.InvalidCachedStatementError,
      pg.OutdatedSchemaCacheError), RETRY, "conflict"),
    (pg.InvalidAuthorizationSpecificationError, FAULT, "auth_failed"),  # 28xxx: password, pg_hba
    (pg.InvalidCatalogNameError, FAULT, "database_missing"),  # 3D000
    (pg.InsufficientPrivilegeError, FAULT, "permission_denied"),  # 42501
    ((pg.UndefinedTableError, pg.UndefinedColumnError, pg.UndefinedFunctionError, pg.UndefinedObjectError),
     FAULT, "schema_missing"),
    (pg.ReadOnlySQLTransactionError, FAULT, "read_only"),  # pointed at a standby after a failover
    (pg.DiskFullError, FAULT, "disk_full"),
    (pg.TooManyConnectionsError, UNAVAILABLE, "too_many_connections"),
    (pg.InsufficientResourcesError, UNAVAILABLE, "unreachable"),  # out of memory, ...
    (pg.OperatorInterventionError, UNAVAILABLE, "unreachable"),  # shutting down, starting, cancelled
    (pg.PostgresConnectionError, UNAVAILABLE, "unreachable"),  # 08xxx
    (pg.IdleInTransactionSessionTimeoutError, UNAVAILABLE, "unreachable"),
    (pg.ClientConfigurationError, FAULT, "misconfigured"),
    # A connection the server closed under a statement: "cannot switch to state 15; another
    # operation is in progress" (InternalClientError) during a fast shutdown, or "connection
    # was closed in the middle of operation" (InterfaceError).
    ((asyncpg.InterfaceError, pg.InternalClientError), UNAVAILABLE, "unreachable"),
    ((OSError, asyncio.TimeoutError), UNAVAILABLE, "unreachable"),  # refused, reset, timed out
    (pg.PostgresError, FAULT, "database_error"),  # anything else the server says
)



def classify(exc: BaseException) -> Failure | None:
    """The Failure an exception means, or None when it is not the database's."""
    for types, kind, cause in _TABLE:
        if isinstance(exc, types):
            return Failure(kind, cause)
    return None


def describe(failure: Failure, exc: BaseException) -> str:
    """One line for the operator's log: the cause, the driver's class and its message (a
    password never appears in asyncpg's messages; the DSN is not in them)."""
    detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    sqlstate = getattr(exc, "sqlstate", None)
    name = type(exc).__name__ + (f" {sqlstate}" if sqlstate else "")
    return f"{EXPLAIN.get(failure.cause, failure.cause)} ({name}: {detail})" if detail else \
        f"{EXPLAIN.get(failure.cause, failure.cause)} ({name})"


__all__ = ["Failure", "classify", "describe", "EXPLAIN", "RETRY", "UNAVAILABLE", "FAULT"]
