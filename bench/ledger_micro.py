"""Micro-benchmark of the balance middleware's ledger calls (no HTTP).

    .venv/bin/python -m bench.ledger_micro [--requests 20000] [--concurrency 1,16,64] [--rounds 3]

N simulated requests, C at a time, each doing what the balance middleware does for one
non-stream request: Leases.hold_up_to (the reservation), a zero-length "upstream" (one loop
turn), then Leases.finish with a UsageRecord (the settle). Three modes:
  none   the same loop without any ledger call (the floor)
  exact  lease_max_micros = 0: a ledger round trip for the hold and one for the settle (before)
  lease  the default: holds and settles in memory from a lease (after)
CPU per request, net of `none`: on the event-loop thread (time.thread_time) and for the
whole process (time.process_time: the loop, the ledger writer thread, SQLite). Medians of
the rounds; ledger writer ops and groups per request from SQLiteLedger.stats.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from proxy.ledger import UsageRecord
from proxy.ledger.lease import Leases
from proxy.ledger.sqlite.ledger import SQLiteLedger


async def _run(mode: str, requests: int, concurrency: int, db: Path) -> dict[str, float]:
    ledger = SQLiteLedger(db)
    await ledger.start()
    _, record = await ledger.create_key("bench", balance_micros=10**15)
    leases = Leases(ledger, hold_ttl_s=900, max_micros=0 if mode == "exact" else 10_000_000)
    key_id = record.key_id
    todo = iter(range(requests))

    async def worker(w: int, tag: str = "") -> None:
        for i in todo:
            request_id = f"req_{tag}{w}_{i}"
            if mode == "none":
                await asyncio.sleep(0)
                continue
            hold = await leases.hold_up_to(request_id, key_id, 1_000, 50_000)
            await asyncio.sleep(0)  # the upstream
            leases.finish(hold, UsageRecord(request_id, key_id, "m", 100, 0, 20, 0, 130, "completed"))

    # warm up (the lease, the page cache), then measure
    warm = iter(range(min(2000, requests)))
    todo, saved = warm, todo
    await asyncio.gather(*(worker(w, "warm") for w in range(concurrency)))
    await leases.flush()
    todo = saved
    ops0 = ledger.stats["ops"]
    groups0 = ledger.stats["groups"]
    t0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    await leases.flush()
    t1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
    result = {
        "loop_us": (t1 - t0) / requests * 1e6,
        "total_us": (p1 - p0) / requests * 1e6,
        "req_s": requests / (w1 - w0),
        "ops": (ledger.stats["ops"] - ops0) / requests,
        "groups": (ledger.stats["groups"] - groups0) / requests,
        "lease_share": leases.stats["lease_holds"] / max(1, leases.stats["lease_holds"] + leases.stats["exact_holds"]),
    }
    await leases.close()
    if mode != "none":
        audit = await ledger.audit()
        assert all(balance == expected for _, balance, expected in audit), audit
        used = await ledger.list_usage(key_id, limit=10**9)
        spent = sum(u.debited_micros for u in used)
        assert 10**15 - (await ledger.get_key(key_id)).balance_micros == spent
        assert await ledger.holds() == [], "a hold or lease was left behind"
    await ledger.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        import uvloop  # the proxy's loop

        uvloop.install()
    except ImportError:
        pass
    print("| c | mode | loop CPU/req us (net) | total CPU/req us (net) | req/s | writer ops/req | commits/req | from lease |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as tmp:
        for c in [int(x) for x in args.concurrency.split(",")]:
            rows: dict[str, list[dict[str, float]]] = {"none": [], "exact": [], "lease": []}
            for r in range(args.rounds):
                for mode in rows:  # interleaved, so the machine's noise hits every mode alike
                    db = Path(tmp) / f"{mode}-{c}-{r}.db"
                    rows[mode].append(asyncio.run(_run(mode, args.requests, c, db)))
            floor_loop = statistics.median(x["loop_us"] for x in rows["none"])
            floor_total = statistics.median(x["total_us"] for x in rows["none"])
            for mode in ("exact", "lease"):
                med = {name: statistics.median(x[name] for x in rows[mode]) for name in rows[mode][0]}
                print(f"| {c} | {mode} | {med['loop_us'] - floor_loop:.1f} | {med['total_us'] - floor_total:.1f}"
                      f" | {med['req_s']:.0f} | {med['ops']:.3f} | {med['groups']:.3f} | {med['lease_share']:.0%} |",
                      flush=True)


if __name__ == "__main__":
    main()
