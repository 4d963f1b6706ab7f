"""The console's reads on a big ledger: `python -m bench.admin_usage [--rows 1000000]`.

Builds a SQLite ledger (the real schema, indexes and hourly sums, proxy/ledger/schema.py)
holding --rows usage rows spread over 30 days, 1,000 keys (a few of them carrying most of
the traffic), 8 models and 4 workers, then times
through SQLiteLedger (the writer thread, as the admin API calls it) the reads the admin API
and the dashboard make. Prints a Markdown table for bench/results.md ("Design measurements").
Not part of `make test` (building the file takes a while); tests/test_admin_ledger.py checks
that the same reads use the indexes.
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

from proxy.ledger.schema import _ROLLUP_BACKFILL
from proxy.ledger.service import period_starts
from proxy.ledger.sqlite import SQLiteLedger

DAY = 86400


def build(path: Path, rows: int, keys: int = 1000, seed: int = 7) -> float:
    """Fill the ledger; returns the newest row's time."""
    rng = random.Random(seed)
    now = time.time()
    start = now - 30 * DAY
    conn = sqlite3.connect(path)
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO keys (key_id, name, prefix, secret_sha256, balance_micros, created_at) VALUES (?, ?, ?, ?, ?, ?)",
        [(f"key_{i:016x}", f"team-{i}", "sk-rp-xxxxxx", i.to_bytes(32, "big"), 10**12, start) for i in range(keys)])
    models = [f"org/model-{i}" for i in range(8)]
    workers = [f"gpu-{i}" for i in range(4)]

    def gen():
        for n in range(rows):
            at = start + (n / rows) * 30 * DAY  # time order, as settles arrive
            key = int(rng.paretovariate(1.2)) % keys  # a few keys carry most traffic
            inp = rng.randint(50, 4000)
            out = rng.randint(10, 800)
            cost = inp // 2 + out * 3 // 2
            yield (f"req_{n:024x}", f"key_{key:016x}", rng.choice(models), inp, rng.randint(0, inp), out, 0,
                   cost, cost, "completed" if rng.random() > 0.01 else "failed", at, rng.choice(workers))

    conn.executemany(
        "INSERT INTO usage (request_id, key_id, model, input_tokens, cached_tokens, output_tokens,"
        " reasoning_tokens, cost_micros, debited_micros, status, created_at, worker)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", gen())
    # the hourly sums, as settles and lease commits add to them row by row
    conn.execute("DELETE FROM usage_hourly")
    conn.execute(_ROLLUP_BACKFILL)
    conn.execute("COMMIT")
    conn.execute("ANALYZE")
    conn.close()
    return now


async def measure(path: Path, now: float, repeat: int) -> list[tuple[str, float, int]]:
    day, month = period_starts(now)
    busy_key = "key_0000000000000001"
    cases = [
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
    out = []
    async with SQLiteLedger(path) as ledger:
        for name, call in cases:
            times = []
            size = 0
            for _ in range(repeat):
                t0 = time.perf_counter()
                found = await call(ledger)
                times.append(time.perf_counter() - t0)
                size = len(found) if isinstance(found, list) else 1
            out.append((name, statistics.median(times) * 1000, size))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.db"
        asyncio.run(_create(path))
        t0 = time.perf_counter()
        now = build(path, args.rows)
        built = time.perf_counter() - t0
        results = asyncio.run(measure(path, now, args.repeat))
        size_mb = path.stat().st_size / 1e6
    print(f"{args.rows:,} usage rows over 30 days, 1,000 keys, 8 models, 4 workers; file {size_mb:.0f} MB "
          f"(built in {built:.0f} s); median of {args.repeat} calls through SQLiteLedger")
    print()
    print("| read | ms | rows |")
    print("|---|---:|---:|")
    for name, ms, size in results:
        print(f"| {name} | {ms:.1f} | {size} |")


async def _create(path: Path) -> None:
    async with SQLiteLedger(path):
        pass  # the schema and indexes


if __name__ == "__main__":
    main()
