"""The SQLite ledger's tables and rows: the schema, checks of what goes into a row, records
from rows, and the batch insert of usage rows that lease_commit runs (proxy/ledger/sqlite/ledger.py
holds the operations; this module holds what they share and need no connection state for).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
from typing import Any

from proxy.ledger.base import SECRET_PREFIX, USAGE_STATUSES, KeyRecord, LedgerError, UsageRecord
from proxy.ledger.rollup import hourly_sums
from proxy.ledger.usage import MAX_AMOUNT

SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    key_id          TEXT PRIMARY KEY,
    name            TEXT NOT NULL,
    prefix          TEXT NOT NULL,
    secret_sha256   BLOB NOT NULL UNIQUE,
    balance_micros  INTEGER NOT NULL DEFAULT 0 CHECK (balance_micros >= 0),
    allowed_models  TEXT,            -- JSON array, NULL = every model
    concurrency     INTEGER,
    rate_per_min    INTEGER,
    revoked         INTEGER NOT NULL DEFAULT 0,
    created_at      REAL NOT NULL,
    expires_at      REAL,
    tokens_per_min  INTEGER,
    daily_budget_micros   INTEGER,
    monthly_budget_micros INTEGER
);
CREATE TABLE IF NOT EXISTS holds (
    request_id      TEXT PRIMARY KEY,
    key_id          TEXT NOT NULL REFERENCES keys(key_id),
    amount_micros   INTEGER NOT NULL CHECK (amount_micros >= 0),
    expires_at      REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS holds_by_key ON holds(key_id, expires_at);
CREATE INDEX IF NOT EXISTS holds_by_expiry ON holds(expires_at);
CREATE TABLE IF NOT EXISTS usage (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id       TEXT NOT NULL UNIQUE,
    key_id           TEXT NOT NULL REFERENCES keys(key_id),
    model            TEXT NOT NULL,
    input_tokens     INTEGER NOT NULL,
    cached_tokens    INTEGER NOT NULL,
    output_tokens    INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL,
    cost_micros      INTEGER NOT NULL CHECK (cost_micros >= 0),
    debited_micros   INTEGER NOT NULL CHECK (debited_micros >= 0 AND debited_micros <= cost_micros),
    status           TEXT NOT NULL,
    created_at       REAL NOT NULL,
    worker           TEXT,
    served_model     TEXT,            -- what resolve_model chose; NULL: rows from before it was kept
    endpoint         TEXT,            -- the API path (/v1/chat/completions, ...); NULL: rows from before it was kept
    transport        TEXT,            -- http | websocket; NULL: rows from before it was kept
    latency_ms       REAL             -- arrival to settlement; NULL: rows from before it was kept
);
CREATE INDEX IF NOT EXISTS usage_by_key ON usage(key_id, seq);
CREATE TRIGGER IF NOT EXISTS usage_no_update BEFORE UPDATE ON usage
    BEGIN SELECT RAISE(ABORT, 'usage is append-only'); END;
CREATE TRIGGER IF NOT EXISTS usage_no_delete BEFORE DELETE ON usage
    BEGIN SELECT RAISE(ABORT, 'usage is append-only'); END;
-- Every credit, so that balance == sum(topups) - sum(usage.debited_micros) can be audited.
CREATE TABLE IF NOT EXISTS topups (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    key_id          TEXT NOT NULL REFERENCES keys(key_id),
    micros          INTEGER NOT NULL,
    created_at      REAL NOT NULL
);
-- The levels above keys (proxy/ledger/levels.py): organisations, teams, users.
CREATE TABLE IF NOT EXISTS levels (
    level_id        TEXT PRIMARY KEY,
    kind            TEXT NOT NULL CHECK (kind IN ('org', 'team', 'user')),
    name            TEXT NOT NULL,
    parent_id       TEXT REFERENCES levels(level_id),
    balance_micros  INTEGER CHECK (balance_micros >= 0),   -- NULL: no purse of its own
    budget_micros   INTEGER,
    budget_period   TEXT,
    budget_reset    TEXT NOT NULL DEFAULT '+00:00',
    period_spent    INTEGER NOT NULL DEFAULT 0,
    period_end      REAL,
    allowed_models  TEXT,
    concurrency     INTEGER,
    rate_per_min    INTEGER,
    tokens_per_min  INTEGER,
    blocked         INTEGER NOT NULL DEFAULT 0,
    tags            TEXT,
    metadata        TEXT,
    created_at      REAL NOT NULL
);
-- Every credit of a level's balance: balance == sum(level_topups) - the debits of its keys' rows.
CREATE TABLE IF NOT EXISTS level_topups (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    level_id        TEXT NOT NULL REFERENCES levels(level_id),
    micros          INTEGER NOT NULL,
    created_at      REAL NOT NULL
);
-- Every change to a key or a level (the operator's console): who, what, when. Never a secret.
CREATE TABLE IF NOT EXISTS audit (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at      REAL NOT NULL,
    actor           TEXT NOT NULL,
    action          TEXT NOT NULL,
    key_id          TEXT,
    details         TEXT NOT NULL    -- JSON object
);
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
    BEGIN SELECT RAISE(ABORT, 'audit is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
    BEGIN SELECT RAISE(ABORT, 'audit is append-only'); END;
"""

# Columns added after the first release: a ledger made before them gets them on open.
_ADDED_COLUMNS = (
    ("keys", "expires_at", "REAL"),
    ("keys", "tokens_per_min", "INTEGER"),
    ("keys", "daily_budget_micros", "INTEGER"),
    ("keys", "monthly_budget_micros", "INTEGER"),
    ("usage", "worker", "TEXT"),
    ("usage", "served_model", "TEXT"),
    ("usage", "endpoint", "TEXT"),
    # the organisation (issue 39): a key's levels, its lifecycle, a rotated secret's grace
    ("keys", "org_id", "TEXT"),
    ("keys", "team_id", "TEXT"),
    ("keys", "user_id", "TEXT"),
    ("keys", "own_balance", "INTEGER NOT NULL DEFAULT 1"),
    ("keys", "blocked", "INTEGER NOT NULL DEFAULT 0"),
    ("keys", "tags", "TEXT"),
    ("keys", "metadata", "TEXT"),
    ("keys", "prev_secret_sha256", "BLOB"),
    ("keys", "prev_secret_until", "REAL"),
    ("keys", "deleted", "INTEGER NOT NULL DEFAULT 0"),
    ("usage", "transport", "TEXT"),
    ("usage", "latency_ms", "REAL"),
)

# The time-range reads of the console and of budgets: by time over all keys, by key then
# time (covering the debit: a budget check reads the index alone).
INDEXES = """
CREATE INDEX IF NOT EXISTS usage_by_time ON usage(created_at);
CREATE INDEX IF NOT EXISTS usage_by_key_time ON usage(key_id, created_at, debited_micros);
CREATE INDEX IF NOT EXISTS audit_by_key ON audit(key_id, seq);
CREATE INDEX IF NOT EXISTS audit_by_time ON audit(created_at);
CREATE INDEX IF NOT EXISTS keys_by_org ON keys(org_id) WHERE org_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS keys_by_team ON keys(team_id) WHERE team_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS keys_by_user ON keys(user_id) WHERE user_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS keys_by_prev_secret ON keys(prev_secret_sha256) WHERE prev_secret_sha256 IS NOT NULL;
CREATE INDEX IF NOT EXISTS levels_by_parent ON levels(parent_id);
"""

# Usage summed per UTC hour, key, served model (the client's string for rows without one) and
# worker, added to in the transaction that inserts
# the usage rows (roll_up below, called by settle and lease_commit: one upsert per group of a
# batch, not per row): reports over days or months read these sums instead of every row
# (proxy/ledger/sqlite/console.py; the rules: proxy/ledger/rollup.py). Derived data: filled from
# the usage rows when missing.
_ROLLUP_SUMS = "input_tokens, cached_tokens, output_tokens, reasoning_tokens, cost_micros, debited_micros"
ROLLUP = """
CREATE TABLE IF NOT EXISTS usage_hourly (
    hour             INTEGER NOT NULL,   -- Unix seconds of the UTC hour's start
    key_id           TEXT NOT NULL,
    model            TEXT NOT NULL,      -- the served model: COALESCE(usage.served_model, usage.model)
    worker           TEXT NOT NULL,      -- '' for rows without one
    requests         INTEGER NOT NULL,
    input_tokens     INTEGER NOT NULL,
    cached_tokens    INTEGER NOT NULL,
    output_tokens    INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL,
    cost_micros      INTEGER NOT NULL,
    debited_micros   INTEGER NOT NULL,
    PRIMARY KEY (hour, key_id, model, worker)
) WITHOUT ROWID;
"""
_ROLLUP_BACKFILL = (
    "INSERT OR IGNORE INTO usage_hourly SELECT CAST(created_at / 3600 AS INTEGER) * 3600, key_id,"
    " COALESCE(served_model, model),"
    f" COALESCE(worker, ''), COUNT(*), {', '.join(f'SUM({c})' for c in _ROLLUP_SUMS.split(', '))}"
    " FROM usage GROUP BY 1, 2, 3, 4"
)
_ROLLUP_ADD = (
    "INSERT INTO usage_hourly VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (hour, key_id, model, worker) DO UPDATE SET requests = requests + excluded.requests,"
    " input_tokens = input_tokens + excluded.input_tokens, cached_tokens = cached_tokens + excluded.cached_tokens,"
    " output_tokens = output_tokens + excluded.output_tokens,"
    " reasoning_tokens = reasoning_tokens + excluded.reasoning_tokens,"
    " cost_micros = cost_micros + excluded.cost_micros, debited_micros = debited_micros + excluded.debited_micros"
)


def roll_up(conn: sqlite3.Connection, inserted: list[tuple[tuple, int]]) -> None:
    """Add usage rows just inserted (each a row as proxy/ledger/sqlite/usage.py inserts it, and
    its debit) to the hourly sums, in the caller's transaction: one upsert per group
    (proxy/ledger/rollup.py)."""
    conn.executemany(_ROLLUP_ADD, hourly_sums(inserted))


# The SQLite schema's version, kept in PRAGMA user_version: a release that changes the schema in a
# way an older one cannot read raises it, and an older release then refuses the file.
SQLITE_SCHEMA_VERSION = 2  # 2: levels (an older release would not bound their keys)


def apply_schema(conn: sqlite3.Connection) -> None:
    """Create the tables, add the columns an older ledger lacks, then the indexes and the
    hourly rollup (filled from the usage rows when it is new). A file a newer release made
    is refused (LedgerError) before anything is changed."""
    found = conn.execute("PRAGMA user_version").fetchone()[0]
    if found > SQLITE_SCHEMA_VERSION:
        raise LedgerError(f"the ledger's schema is at version {found}, newer than this release knows "
                          f"({SQLITE_SCHEMA_VERSION}): run the release that made it (or a newer one)")
    conn.executescript(SCHEMA)
    for table, column, kind in _ADDED_COLUMNS:
        present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in present:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")  # fixed names, not input
    old_index = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'usage_by_key_time'").fetchone()
    if old_index and "debited_micros" not in old_index[0]:
        conn.execute("DROP INDEX usage_by_key_time")
    conn.executescript(INDEXES)
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'usage_hourly'").fetchone() is None:
        # One transaction: the table and the sums of the rows already there; a process that
        # raced this one to it filled it already (OR IGNORE), and adds its own rows since.
        conn.executescript(f"BEGIN IMMEDIATE; {ROLLUP} {_ROLLUP_BACKFILL}; COMMIT;")
    if found < SQLITE_SCHEMA_VERSION:
        conn.execute(f"PRAGMA user_version = {SQLITE_SCHEMA_VERSION}")  # a constant, not input



KEY_COLUMNS = (
    "key_id, name, prefix, balance_micros, allowed_models, concurrency, rate_per_min, revoked, created_at,"
    " expires_at, tokens_per_min, daily_budget_micros, monthly_budget_micros,"
    " org_id, team_id, user_id, own_balance, blocked, tags, metadata, prev_secret_until"
)
# What a hold or a settle reads of a key besides its balance: whether it has a purse of its
# own and its levels (proxy/ledger/levels.py); all NULL / true: the key stands alone.
KEY_CHAIN_COLUMNS = "own_balance, org_id, team_id, user_id"


def hash_secret(secret: str) -> bytes:
    """sha256 of the secret. The secret carries 192 random bits, so a fast hash is right
    (a slow KDF protects low-entropy passwords; there is nothing to brute-force here)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(24)  # 24 bytes -> 32 urlsafe chars, 192 bits


def key_record_of(row: tuple) -> KeyRecord:
    models = json.loads(row[4]) if row[4] is not None else None
    return KeyRecord(
        key_id=row[0],
        name=row[1],
        prefix=row[2],
        balance_micros=row[3],
        allowed_models=tuple(models) if models is not None else None,
        concurrency=row[5],
        rate_per_min=row[6],
        revoked=bool(row[7]),
        created_at=row[8],
        expires_at=row[9],
        tokens_per_min=row[10],
        daily_budget_micros=row[11],
        monthly_budget_micros=row[12],
        org_id=row[13],
        team_id=row[14],
        user_id=row[15],
        own_balance=bool(row[16]),
        blocked=bool(row[17]),
        tags=tuple(json.loads(row[18])) if row[18] else (),
        metadata=json.loads(row[19]) if row[19] else None,
        grace_until=row[20],
    )


def usage_record_of(row: tuple) -> UsageRecord:
    return UsageRecord(*row)


def opt_limit(value: Any, what: str) -> int | None:
    """A concurrency or rate limit: a positive integer, or None (no limit). 0 is refused:
    it reads as "unlimited" to the limits middleware and as "nothing" to a person."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_AMOUNT:
        raise ValueError(f"{what} must be a positive integer (None: no limit), not {value!r}")
    return value


def as_int(value: Any, what: str, *, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}")
    if not -MAX_AMOUNT <= value <= MAX_AMOUNT:
        # SQLite's INTEGER is 64-bit: beyond it the value would be stored as a REAL.
        raise ValueError(f"{what} must be at most {MAX_AMOUNT} in absolute value")
    return value


def models_json(models: Any) -> str | None:
    if models is None:
        return None
    if isinstance(models, str):
        models = [m for m in (part.strip() for part in models.split(",")) if m]
    models = list(models)
    if not all(isinstance(m, str) and m for m in models):
        raise ValueError("allowed_models must be a list of model names")
    return json.dumps(models)


# The statements of lease_commit (one insert per usage row, then one update per key and lease).
DEBIT_KEY = "UPDATE keys SET balance_micros = balance_micros - ? WHERE key_id = ?"
# Without a new expiry the update leaves expires_at, and so both indexes on it, alone:
# two fewer pages written (and fsync'd) per commit.
REDUCE_LEASE = "UPDATE holds SET amount_micros = MAX(0, amount_micros - ?) WHERE request_id = ? AND expires_at > ?"
REDUCE_AND_RENEW_LEASE = (
    "UPDATE holds SET amount_micros = MAX(0, amount_micros - ?), expires_at = ?"
    " WHERE request_id = ? AND expires_at > ?"
)


def check_usage(usage: UsageRecord) -> None:
    """ValueError unless `usage` can be recorded (the first problem, in field order)."""
    if not usage.request_id:
        raise ValueError("request_id is required")
    check_usage_values(usage)


def check_usage_values(usage: UsageRecord) -> None:
    """ValueError unless usage's status, served model and counts can be recorded (settle and lease_commit)."""
    if usage.status not in USAGE_STATUSES:
        raise ValueError(f"usage.status must be one of {sorted(USAGE_STATUSES)}")
    served = usage.served_model
    if served is not None and (type(served) is not str or not served):
        raise ValueError("usage.served_model must be a non-empty string or None")
    a, b, c, d, cost = (
        usage.input_tokens, usage.cached_tokens, usage.output_tokens, usage.reasoning_tokens, usage.cost_micros
    )
    # The common case in one test; as_int says what is wrong (or accepts an int subclass).
    if not (type(a) is type(b) is type(c) is type(d) is type(cost) is int and min(a, b, c, d, cost) >= 0
            and max(a, b, c, d, cost) <= MAX_AMOUNT):
        for value, name in ((a, "input_tokens"), (b, "cached_tokens"), (c, "output_tokens"),
                            (d, "reasoning_tokens"), (cost, "cost_micros")):
            as_int(value, name)
