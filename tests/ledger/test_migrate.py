"""`responses-proxy migrate`: the ledger's schema brought up to this release on its own (a
deployment's migration job), once whatever the number of replicas starting together; a schema
newer than this release knows is refused by migrate and by serve, before anything is changed."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import sys
from pathlib import Path

import asyncpg
import pytest

from proxy.ledger import LedgerError, open_ledger
from proxy.ledger.postgres.schema import MIGRATIONS, latest_version
from proxy.ledger.schema import SQLITE_SCHEMA_VERSION
from tests.support.paths import REPO

ROOT = REPO


async def _cli(config: Path, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "proxy", "--config", str(config), *args,
                                                cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode()


async def test_four_replicas_migrating_an_empty_postgres_at_once_apply_each_migration_once(pg_dsn, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"ledger: {{backend: postgres, dsn: '{pg_dsn}', spool_path: {tmp_path / 'spool.jsonl'}}}\n")
    runs = await asyncio.gather(*(_cli(config, "migrate") for _ in range(4)))
    assert all(code == 0 for code, _ in runs), runs
    applied = []
    for _, out in runs:
        found = re.search(r"applied ([\d, ]+)\)", out)
        applied += [int(v) for v in found.group(1).split(", ")] if found else []
        assert f"schema at version {latest_version()}" in out, out
    assert sorted(applied) == [v for v, _, _ in MIGRATIONS]  # each by exactly one of the four
    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")
    finally:
        await conn.close()
    assert [r["version"] for r in rows] == [v for v, _, _ in MIGRATIONS]
    code, out = await _cli(config, "migrate")  # a fifth: nothing left
    assert code == 0 and "nothing to apply" in out


async def test_a_postgres_schema_newer_than_this_release_is_refused(pg_dsn, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"ledger: {{backend: postgres, dsn: '{pg_dsn}', spool_path: {tmp_path / 'spool.jsonl'}}}\n")
    assert (await _cli(config, "migrate"))[0] == 0
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, 'future', 0)",
                           latest_version() + 1)
    finally:
        await conn.close()
    code, out = await _cli(config, "migrate")
    assert code == 1 and f"newer than this release knows ({latest_version()})" in out, out
    ledger = open_ledger({"backend": "postgres", "dsn": pg_dsn, "spool_path": str(tmp_path / "s.jsonl")})
    with pytest.raises(LedgerError, match="newer than this release knows"):
        await ledger.start()  # serve's start refuses it the same way


async def test_a_sqlite_file_of_a_newer_release_is_refused_untouched(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"ledger: {{path: {tmp_path / 'ledger.db'}}}\n")
    code, out = await _cli(config, "migrate")
    assert code == 0 and f"schema at version {SQLITE_SCHEMA_VERSION}" in out
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SQLITE_SCHEMA_VERSION
        conn.execute(f"PRAGMA user_version = {SQLITE_SCHEMA_VERSION + 1}")
        tables = conn.execute("SELECT name FROM sqlite_master ORDER BY name").fetchall()
    code, out = await _cli(config, "migrate")
    assert code == 1 and "newer than this release knows" in out, out
    ledger = open_ledger({"path": str(tmp_path / "ledger.db")})
    with pytest.raises(LedgerError, match="newer than this release knows"):
        await ledger.start()
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        assert conn.execute("SELECT name FROM sqlite_master ORDER BY name").fetchall() == tables
