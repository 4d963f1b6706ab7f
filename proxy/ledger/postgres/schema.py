"""The PostgreSQL ledger's schema, as numbered migrations the proxy applies itself.

`migrate(conn)` applies every migration not yet in `schema_migrations`, each in its own
transaction that first takes a transaction-level advisory lock (`pg_advisory_xact_lock`,
one fixed key), so replicas starting at once queue on it: the first applies migration N
and records it, the others then find N recorded and skip it. Migration N is applied once,
atomically (PostgreSQL's DDL is transactional: a failed migration leaves nothing behind).
The statements are deliberately plain CREATEs (no IF NOT EXISTS): applying one twice
would fail loudly, which is what tests/ledger/test_postgres.py's "4 replicas start at once" checks.

Tables match the SQLite ledger's (proxy/ledger/schema.py) column for column, so records
and checks are shared; money is BIGINT micro-units, times are DOUBLE PRECISION Unix
seconds written by the proxy (not the database's clock: see proxy/ledger/postgres/ledger.py).
Migration 3 adds usage_hourly, the hourly sums of SQLite's schema (proxy/ledger/schema.py
ROLLUP; the rules: proxy/ledger/rollup.py), filled from the rows already there in the same
transaction. The sums are kept by a statement-level trigger on usage, not by the proxy's
code: every INSERT into usage (settle, lease_commit's batch, the spool's replay, a replica
still running the previous release during a rolling upgrade, an operator's own INSERT) adds
the rows it actually inserted (its transition table: a duplicate skipped by ON CONFLICT DO
NOTHING is not in it) with one upsert per (hour, key, model, worker) group, in the inserting
transaction. Created before the backfill, the trigger's lock on usage (SHARE ROW EXCLUSIVE)
waits for every open insert and holds off new ones until the migration commits: each row is
summed exactly once, by the backfill or by the trigger.
Migration 4 adds usage.served_model (what resolve_model chose, beside the client's string in
`model`) and re-creates the trigger's function to sum by COALESCE(served_model, model): the
sums are per served model, whatever aliases clients send; rows without one (made before, or
by a replica of an older release during a rolling upgrade) are summed under their `model`,
as they already were, so the sums made before stay right and nothing is re-summed. Adding a
nullable column without a default is a change of the catalog only (no table rewrite).
Migration 5 adds ledger_hold(), PostgresLedger.hold_up_to's transaction as one function, so
a hold is one round trip to the database instead of five (BEGIN, lock, read, insert, COMMIT)
on the request's path to its first byte: the same statements in the same order.
Migration 6 adds usage.endpoint, the API path a row was billed for (/v1/responses,
/v1/chat/completions, /v1/messages, ...; NULL: rows from before it was kept, all Responses).
Nullable without a default: a change of the catalog only. The hourly sums are not split by it.
Migration 7 adds the levels above keys (proxy/ledger/levels.py: organisations, teams, users, their
top-ups), a key's levels and lifecycle columns (blocked, tags, metadata, a rotated secret's grace,
deleted), and makes ledger_hold hand a key under levels to the proxy's own transaction.
"""

from __future__ import annotations

import time
from typing import Any

from proxy.ledger.base import LedgerError

# An arbitrary, fixed 64-bit key: "every ledger migration" across every replica.
MIGRATION_LOCK = 0x7270_6C65_6467_6572  # "rpledger"


class SchemaTooNew(LedgerError):
    """The ledger's schema was made by a newer release than this one."""

# usage_hourly's sums (migration 3): the groups of proxy/ledger/rollup.py, in SQL.
_SUMS = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens", "cost_micros", "debited_micros")
_SUM_COLUMNS_DDL = ",\n    ".join(f"{c:<16} BIGINT NOT NULL" for c in _SUMS)
_ROLLUP_FROM = ("SELECT (floor(created_at / 3600) * 3600)::bigint, key_id, model, COALESCE(worker, ''), COUNT(*), "
                + ", ".join(f"SUM({c})::bigint" for c in _SUMS) + " FROM {rows} GROUP BY 1, 2, 3, 4")
_ROLLUP_ADD = ", ".join(f"{c} = h.{c} + EXCLUDED.{c}" for c in _SUMS)
# From migration 4 on, the model summed is the served one (migration 3's text stays as applied).
_ROLLUP_FROM_SERVED = _ROLLUP_FROM.replace(" key_id, model,", " key_id, COALESCE(served_model, model),", 1)
assert _ROLLUP_FROM_SERVED != _ROLLUP_FROM

MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "keys, holds, usage, topups, audit", """
CREATE TABLE keys (
    key_id          TEXT PRIMARY KEY,
    name            TEXT NOT NULL,
    prefix          TEXT NOT NULL,
    secret_sha256   BYTEA NOT NULL UNIQUE,
    balance_micros  BIGINT NOT NULL DEFAULT 0 CHECK (balance_micros >= 0),
    allowed_models  TEXT,
    concurrency     INTEGER,
    rate_per_min    INTEGER,
    revoked         BOOLEAN NOT NULL DEFAULT FALSE,
    created_at      DOUBLE PRECISION NOT NULL,
    expires_at      DOUBLE PRECISION,
    tokens_per_min  INTEGER,
    daily_budget_micros   BIGINT,
    monthly_budget_micros BIGINT
);
CREATE TABLE holds (
    request_id      TEXT PRIMARY KEY,
    key_id          TEXT NOT NULL REFERENCES keys(key_id),
    amount_micros   BIGINT NOT NULL CHECK (amount_micros >= 0),
    expires_at      DOUBLE PRECISION NOT NULL
);
CREATE INDEX holds_by_key ON holds(key_id, expires_at);
CREATE INDEX holds_by_expiry ON holds(expires_at);
CREATE TABLE usage (
    seq              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id       TEXT NOT NULL UNIQUE,
    key_id           TEXT NOT NULL REFERENCES keys(key_id),
    model            TEXT NOT NULL,
    input_tokens     BIGINT NOT NULL,
    cached_tokens    BIGINT NOT NULL,
    output_tokens    BIGINT NOT NULL,
    reasoning_tokens BIGINT NOT NULL,
    cost_micros      BIGINT NOT NULL CHECK (cost_micros >= 0),
    debited_micros   BIGINT NOT NULL CHECK (debited_micros >= 0 AND debited_micros <= cost_micros),
    status           TEXT NOT NULL,
    created_at       DOUBLE PRECISION NOT NULL,
    worker           TEXT
);
CREATE INDEX usage_by_key ON usage(key_id, seq);
CREATE INDEX usage_by_time ON usage(created_at);
CREATE INDEX usage_by_key_time ON usage(key_id, created_at) INCLUDE (debited_micros);
CREATE TABLE topups (
    seq             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key_id          TEXT NOT NULL REFERENCES keys(key_id),
    micros          BIGINT NOT NULL,
    created_at      DOUBLE PRECISION NOT NULL
);
CREATE INDEX topups_by_key ON topups(key_id);
CREATE TABLE audit (
    seq             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    created_at      DOUBLE PRECISION NOT NULL,
    actor           TEXT NOT NULL,
    action          TEXT NOT NULL,
    key_id          TEXT,
    details         TEXT NOT NULL
);
CREATE INDEX audit_by_key ON audit(key_id, seq);
CREATE INDEX audit_by_time ON audit(created_at);
"""),
    (2, "usage and audit are append-only", """
CREATE FUNCTION ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME;
END $$;
CREATE TRIGGER usage_no_change BEFORE UPDATE OR DELETE OR TRUNCATE ON usage
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_append_only();
CREATE TRIGGER audit_no_change BEFORE UPDATE OR DELETE OR TRUNCATE ON audit
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_append_only();
"""),
    (3, "usage_hourly: usage summed per UTC hour, key, model and worker", f"""
CREATE TABLE usage_hourly (
    hour             BIGINT NOT NULL,    -- Unix seconds of the UTC hour's start
    key_id           TEXT NOT NULL,
    model            TEXT NOT NULL,
    worker           TEXT NOT NULL,      -- '' for rows without one
    requests         BIGINT NOT NULL,
    {_SUM_COLUMNS_DDL},
    PRIMARY KEY (hour, key_id, model, worker)
);
CREATE FUNCTION usage_roll_up() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_hourly AS h {_ROLLUP_FROM.format(rows="new_rows")}
        ON CONFLICT (hour, key_id, model, worker) DO UPDATE SET requests = h.requests + EXCLUDED.requests,
        {_ROLLUP_ADD};
    RETURN NULL;
END $$;
CREATE TRIGGER usage_roll_up AFTER INSERT ON usage REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION usage_roll_up();
INSERT INTO usage_hourly {_ROLLUP_FROM.format(rows="usage")};
"""),
    (4, "usage.served_model; usage_hourly summed per served model", f"""
ALTER TABLE usage ADD COLUMN served_model TEXT;
CREATE OR REPLACE FUNCTION usage_roll_up() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_hourly AS h {_ROLLUP_FROM_SERVED.format(rows="new_rows")}
        ON CONFLICT (hour, key_id, model, worker) DO UPDATE SET requests = h.requests + EXCLUDED.requests,
        {_ROLLUP_ADD};
    RETURN NULL;
END $$;
COMMENT ON COLUMN usage_hourly.model IS 'the served model: COALESCE(usage.served_model, usage.model)';
"""),
    (5, "ledger_hold: a hold in one round trip", """
CREATE FUNCTION ledger_hold(p_request_id TEXT, p_key_id TEXT, p_low BIGINT, p_high BIGINT, p_now DOUBLE PRECISION,
                            p_ttl DOUBLE PRECISION, p_lease_id TEXT, p_lease_return BIGINT,
                            OUT outcome TEXT, OUT amount BIGINT)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_balance BIGINT;
    v_held BIGINT;
    v_settled BOOLEAN;
BEGIN
    -- First: every money move of the key waits here. Each statement below takes a fresh
    -- snapshot (READ COMMITTED, a VOLATILE function), so it sees every hold committed
    -- before this lock was granted.
    SELECT balance_micros INTO v_balance FROM keys WHERE key_id = p_key_id FOR UPDATE;
    IF p_lease_id IS NOT NULL THEN  -- a lease's free part goes back first, kept even when refused
        UPDATE holds SET amount_micros = GREATEST(0, amount_micros - p_lease_return) WHERE request_id = p_lease_id;
    END IF;
    IF v_balance IS NULL THEN
        outcome := 'unknown_key'; RETURN;
    END IF;
    SELECT COALESCE(SUM(h.amount_micros), 0)::BIGINT INTO v_held FROM holds h
        WHERE h.key_id = p_key_id AND h.expires_at > p_now;
    SELECT EXISTS (SELECT 1 FROM usage u WHERE u.request_id = p_request_id) INTO v_settled;
    IF v_settled THEN
        outcome := 'duplicate'; RETURN;
    END IF;
    IF v_balance - v_held < p_low THEN
        outcome := 'insufficient'; amount := GREATEST(v_balance - v_held, 0); RETURN;
    END IF;
    amount := LEAST(v_balance - v_held, p_high);
    INSERT INTO holds (request_id, key_id, amount_micros, expires_at) VALUES (p_request_id, p_key_id, amount, p_now + p_ttl)
        ON CONFLICT (request_id) DO NOTHING;
    IF NOT FOUND THEN
        outcome := 'duplicate'; amount := NULL; RETURN;
    END IF;
    outcome := 'held';
END $$;
"""),  # noqa: E501 - a migration's text is what the databases ran: never reflowed
    (6, "usage.endpoint: the API path a row was billed for", """
ALTER TABLE usage ADD COLUMN endpoint TEXT;
"""),
    (7, "levels: organisations, teams and users above keys; key lifecycle", """
CREATE TABLE levels (
    level_id        TEXT PRIMARY KEY,
    kind            TEXT NOT NULL CHECK (kind IN ('org', 'team', 'user')),
    name            TEXT NOT NULL,
    parent_id       TEXT REFERENCES levels(level_id),
    balance_micros  BIGINT CHECK (balance_micros >= 0),
    budget_micros   BIGINT,
    budget_period   TEXT,
    budget_reset    TEXT NOT NULL DEFAULT '+00:00',
    period_spent    BIGINT NOT NULL DEFAULT 0,
    period_end      DOUBLE PRECISION,
    allowed_models  TEXT,
    concurrency     INTEGER,
    rate_per_min    INTEGER,
    tokens_per_min  INTEGER,
    blocked         BOOLEAN NOT NULL DEFAULT FALSE,
    tags            TEXT,
    metadata        TEXT,
    created_at      DOUBLE PRECISION NOT NULL
);
CREATE INDEX levels_by_parent ON levels(parent_id);
CREATE TABLE level_topups (
    seq             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    level_id        TEXT NOT NULL REFERENCES levels(level_id),
    micros          BIGINT NOT NULL,
    created_at      DOUBLE PRECISION NOT NULL
);
ALTER TABLE keys ADD COLUMN org_id TEXT REFERENCES levels(level_id),
    ADD COLUMN team_id TEXT REFERENCES levels(level_id), ADD COLUMN user_id TEXT REFERENCES levels(level_id),
    ADD COLUMN own_balance BOOLEAN NOT NULL DEFAULT TRUE,
    ADD COLUMN blocked BOOLEAN NOT NULL DEFAULT FALSE, ADD COLUMN tags TEXT, ADD COLUMN metadata TEXT,
    ADD COLUMN prev_secret_sha256 BYTEA, ADD COLUMN prev_secret_until DOUBLE PRECISION,
    ADD COLUMN deleted BOOLEAN NOT NULL DEFAULT FALSE;
CREATE INDEX keys_by_org ON keys(org_id) WHERE org_id IS NOT NULL;
CREATE INDEX keys_by_team ON keys(team_id) WHERE team_id IS NOT NULL;
CREATE INDEX keys_by_user ON keys(user_id) WHERE user_id IS NOT NULL;
CREATE INDEX keys_by_prev_secret ON keys(prev_secret_sha256) WHERE prev_secret_sha256 IS NOT NULL;
-- The request browser's transport and latency of each row (NULL: rows from before they were kept).
ALTER TABLE usage ADD COLUMN transport TEXT, ADD COLUMN latency_ms DOUBLE PRECISION;
-- A key under levels is held by the proxy's own transaction (proxy/ledger/postgres/levels.py):
-- this function says so ('levels') before it changes anything.
CREATE OR REPLACE FUNCTION ledger_hold(p_request_id TEXT, p_key_id TEXT, p_low BIGINT, p_high BIGINT,
                            p_now DOUBLE PRECISION, p_ttl DOUBLE PRECISION, p_lease_id TEXT, p_lease_return BIGINT,
                            OUT outcome TEXT, OUT amount BIGINT)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_balance BIGINT;
    v_chained BOOLEAN;
    v_held BIGINT;
    v_settled BOOLEAN;
BEGIN
    SELECT balance_micros, (NOT own_balance OR org_id IS NOT NULL OR team_id IS NOT NULL OR user_id IS NOT NULL)
        INTO v_balance, v_chained FROM keys WHERE key_id = p_key_id FOR UPDATE;
    IF v_chained THEN
        outcome := 'levels'; RETURN;
    END IF;
    IF p_lease_id IS NOT NULL THEN  -- a lease's free part goes back first, kept even when refused
        UPDATE holds SET amount_micros = GREATEST(0, amount_micros - p_lease_return) WHERE request_id = p_lease_id;
    END IF;
    IF v_balance IS NULL THEN
        outcome := 'unknown_key'; RETURN;
    END IF;
    SELECT COALESCE(SUM(h.amount_micros), 0)::BIGINT INTO v_held FROM holds h
        WHERE h.key_id = p_key_id AND h.expires_at > p_now;
    SELECT EXISTS (SELECT 1 FROM usage u WHERE u.request_id = p_request_id) INTO v_settled;
    IF v_settled THEN
        outcome := 'duplicate'; RETURN;
    END IF;
    IF v_balance - v_held < p_low THEN
        outcome := 'insufficient'; amount := GREATEST(v_balance - v_held, 0); RETURN;
    END IF;
    amount := LEAST(v_balance - v_held, p_high);
    INSERT INTO holds (request_id, key_id, amount_micros, expires_at)
        VALUES (p_request_id, p_key_id, amount, p_now + p_ttl) ON CONFLICT (request_id) DO NOTHING;
    IF NOT FOUND THEN
        outcome := 'duplicate'; amount := NULL; RETURN;
    END IF;
    outcome := 'held';
END $$;
"""),
)

_BOOKKEEPING = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version     INTEGER PRIMARY KEY,
    name        TEXT NOT NULL,
    applied_at  DOUBLE PRECISION NOT NULL
)
"""


async def migrate(conn: Any, migrations: tuple[tuple[int, str, str], ...] = MIGRATIONS) -> list[int]:
    """Apply the migrations `conn`'s database lacks, in order; returns the versions this call
    applied (none when another replica got there first)."""
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
        await conn.execute(_BOOKKEEPING)
        newest = await conn.fetchval("SELECT max(version) FROM schema_migrations")
    check_known(newest, latest_version(migrations))
    for version, name, sql in migrations:
        async with conn.transaction():
            # Held to the end of this transaction; also serialises the bookkeeping table's
            # creation (concurrent CREATE TABLE IF NOT EXISTS can still collide).
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
            await conn.execute(_BOOKKEEPING)
            if await conn.fetchval("SELECT 1 FROM schema_migrations WHERE version = $1", version):
                continue
            await conn.execute(sql)
            await conn.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
                               version, name, time.time())
            applied.append(version)
    return applied


def check_known(found: int | None, known: int) -> None:
    """A database migrated by a newer release is refused: this one would not know its tables."""
    if found is not None and found > known:
        raise SchemaTooNew(f"the ledger's schema is at version {found}, newer than this release knows ({known}): "
                           "run the release that migrated it (or a newer one)")


def latest_version(migrations: tuple[tuple[int, str, str], ...] = MIGRATIONS) -> int:
    return max(version for version, _, _ in migrations)
