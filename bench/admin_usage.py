"""The console's reads on a big ledger: `python -m bench.admin_usage [--rows 1000000] [--backend both]`.

Builds a ledger of each backend (the real schema, indexes and hourly sums: proxy/ledger/schema.py,
proxy/ledger/postgres/schema.py) holding --rows usage rows spread over 30 days, 1,000 keys (a few of
them carrying most of the traffic), 8 models and 4 workers, then times through the ledger
object (SQLiteLedger's writer thread, PostgresLedger's pool: as the admin API calls them) the
reads the admin API and the dashboard make. The same rows on both backends (one seed).
PostgreSQL is a throwaway local cluster (tests/support/pg_server.py: loopback, fsync off,
shared_buffers 32 MB), bulk-loaded with COPY. Prints a Markdown table for bench/results.md
("Design measurements"). Not part of `make test` (building takes a while);
tests/ledger/test_console.py checks that the same reads use the indexes and the sums.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from proxy.ledger.schema import _ROLLUP_BACKFILL
from proxy.ledger.service import period_starts
from proxy.ledger.sqlite.ledger import SQLiteLedger

DAY = 86400
_USAGE_COLUMNS = ("request_id", "key_id", "model", "input_tokens", "cached_tokens", "output_tokens",
                  "reasoning_tokens", "cost_micros", "debited_micros", "status", "created_at", "worker")
_KEY_COLUMNS = ("key_id", "name", "prefix", "secret_sha256", "balance_micros", "created_at")


def _keys(keys: int, start: float) -> list[tuple]:
    return [(f"key_{i:016x}", f"team-{i}", "sk-rp-xxxxxx", i.to_bytes(32, "big"), 10**12, start) for i in range(keys)]


def _usage(rows: int, keys: int, start: float, seed: int) -> Iterator[tuple]:
    rng = random.Random(seed)
    models = [f"org/model-{i}" for i in range(8)]
    workers = [f"gpu-{i}" for i in range(4)]
    for n in range(rows):
        at = start + (n / rows) * 30 * DAY  # time order, as settles arrive
        key = int(rng.paretovariate(1.2)) % keys  # a few keys carry most traffic
        inp = rng.randint(50, 4000)
        out = rng.randint(10, 800)
        cost = inp // 2 + out * 3 // 2
        yield (f"req_{n:024x}", f"key_{key:016x}", rng.choice(models), inp, rng.randint(0, inp), out, 0,
               cost, cost, "completed" if rng.random() > 0.01 else "failed", at, rng.choice(workers))


def build_sqlite(path: Path, rows: int, now: float, keys: int = 1000, seed: int = 7) -> None:
    start = now - 30 * DAY
    conn = sqlite3.connect(path)
    conn.execute("BEGIN")
    conn.executemany(f"INSERT INTO keys ({', '.join(_KEY_COLUMNS)}) VALUES (?, ?, ?, ?, ?, ?)", _keys(keys, start))
    conn.executemany(f"INSERT INTO usage ({', '.join(_USAGE_COLUMNS)}) VALUES ({', '.join('?' * 12)})",
                     _usage(rows, keys, start, seed))
    # the hourly sums, as settles and lease commits add to them row by row
    conn.execute("DELETE FROM usage_hourly")
    conn.execute(_ROLLUP_BACKFILL)
    conn.execute("COMMIT")
    conn.execute("ANALYZE")
    conn.close()


async def build_postgres(dsn: str, rows: int, now: float, keys: int = 1000, seed: int = 7) -> None:
    """COPY the rows in (the hourly sums, if the schema has them, are added by the ledger's
    own rule as for any insert), then VACUUM ANALYZE (index-only scans need the visibility map)."""
    import asyncpg

    start = now - 30 * DAY
    conn = await asyncpg.connect(dsn)
    try:
        await conn.copy_records_to_table("keys", records=_keys(keys, start), columns=_KEY_COLUMNS)
        await conn.copy_records_to_table("usage", records=_usage(rows, keys, start, seed), columns=_USAGE_COLUMNS)
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()


def _cases(now: float) -> list[tuple[str, Any]]:
    day, month = period_starts(now)
    busy_key = "key_0000000000000001"
    return [
        ("totals of the last 24 h (dashboard tiles)", lambda l: l.usage_totals((), since=now - DAY)),
        ("24 h by hour and key (spend per key chart)", lambda l: l.usage_totals(("hour", "key"), since=now - DAY)),
        ("24 h by hour and model", lambda l: l.usage_totals(("hour", "model"), since=now - DAY)),
        ("24 h by worker (cached share)", lambda l: l.usage_totals(("worker",), since=now - DAY)),
        ("30 d by day and key", lambda l: l.usage_totals(("day", "key"), since=now - 30 * DAY)),
        ("30 d by model, one busy key", lambda l: l.usage_totals(("model",), key_id=busy_key,
                                                                 since=now - 30 * DAY)),
        ("spend today, one busy key (budget check, /v1/key)", lambda l: l.spend_since(busy_key, day)),
        ("spend this month, one busy key", lambda l: l.spend_since(busy_key, month)),
        ("page of 100 rows, newest", lambda l: l.usage_rows(limit=100)),
        ("page of 100 rows, one key, last 7 d", lambda l: l.usage_rows(key_id=busy_key, since=now - 7 * DAY,
                                                                       limit=100)),
        ("last 20 errors in 24 h", lambda l: l.usage_rows(since=now - DAY, statuses=("failed", "error"),
                                                          limit=20)),
    ]


async def measure(ledger: Any, now: float, repeat: int) -> list[tuple[str, float, int]]:
    """(read, median ms, rows answered) of each case, through a started ledger."""
    out = []
    for name, call in _cases(now):
        times = []
        size = 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            found = await call(ledger)
            times.append(time.perf_counter() - t0)
            size = len(found) if isinstance(found, list) else 1
        out.append((name, statistics.median(times) * 1000, size))
    return out


async def run_sqlite(tmp: str, rows: int, now: float, repeat: int) -> tuple[str, list]:
    path = Path(tmp) / "ledger.db"
    async with SQLiteLedger(path):
        pass  # the schema and indexes
    t0 = time.perf_counter()
    build_sqlite(path, rows, now)
    built = time.perf_counter() - t0
    async with SQLiteLedger(path) as ledger:
        results = await measure(ledger, now, repeat)
    return f"SQLite file {path.stat().st_size / 1e6:.0f} MB, built in {built:.0f} s", results


async def run_postgres(tmp: str, rows: int, now: float, repeat: int) -> tuple[str, list]:
    from proxy.ledger.postgres.ledger import PostgresLedger
    from tests.support.pg_server import PgServer

    with PgServer() as server:
        _, dsn = server.create_database("bench")
        ledger = PostgresLedger(dsn, spool_path=Path(tmp) / "spool.jsonl", statement_timeout_ms=600_000)
        await ledger.start()  # the schema (every migration)
        try:
            t0 = time.perf_counter()
            await build_postgres(dsn, rows, now)
            built = time.perf_counter() - t0
            results = await measure(ledger, now, repeat)
            size = await ledger._db(lambda c: c.fetchval("SELECT pg_database_size(current_database())"),
                                    transaction=False)
        finally:
            await ledger.close()
    return f"PostgreSQL database {size / 1e6:.0f} MB, built in {built:.0f} s", results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    args = parser.parse_args()
    now = time.time()
    backends = ("sqlite", "postgres") if args.backend == "both" else (args.backend,)
    runs = {"sqlite": run_sqlite, "postgres": run_postgres}
    found: dict[str, tuple[str, list]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            found[backend] = asyncio.run(runs[backend](tmp, args.rows, now, args.repeat))
    notes = "; ".join(note for note, _ in found.values())
    print(f"{args.rows:,} usage rows over 30 days, 1,000 keys, 8 models, 4 workers; {notes}; "
          f"median of {args.repeat} calls through the ledger object")
    print()
    print("| read | " + " | ".join(f"{b} ms" for b in backends) + " | rows |")
    print("|---|" + "---:|" * (len(backends) + 1))
    for i, (name, _, size) in enumerate(next(iter(found.values()))[1]):
        print(f"| {name} | " + " | ".join(f"{found[b][1][i][1]:.1f}" for b in backends) + f" | {size} |")


if __name__ == "__main__":
    main()
