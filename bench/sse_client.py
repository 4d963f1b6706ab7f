"""The streaming load generator: C concurrent clients, each posting and reading whole SSE streams.

    python -m bench.sse_client URL BODY_JSON CONCURRENCY SECONDS [--header K:V] [--hold N] [--wait]

Prints one JSON line: streams, errors, streams/s, time to first delta and full-stream time
(p50/p99, ms), and this client's own CPU seconds. Per stream it does the least it can: it
reads whatever arrived, looks for the first delta's marker and the terminal marker.
--hold N opens N streams at once, all together, and reports once all have ended.
--wait: after the warm-up streams, print `warm` and wait for a line on stdin before the
measured streams, so that the caller can read the server's CPU around the measured part only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time

import aiohttp

DELTA_MARKERS = (b"response.output_text.delta", b'{"content":"')
END_MARKERS = (b"response.completed", b"data: [DONE]")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def one(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict, ttft: list, full: list) -> bool:
    t0 = time.perf_counter()
    first = None
    tail = b""
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            await resp.read()
            return False
        async for data in resp.content.iter_any():
            window = tail + data
            if first is None and any(m in window for m in DELTA_MARKERS):
                first = time.perf_counter()
            tail = window[-64:]
        if not any(m in window for m in END_MARKERS):
            return False
    end = time.perf_counter()
    if first is None:
        return False
    ttft.append((first - t0) * 1000)
    full.append((end - t0) * 1000)
    return True


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("body")
    ap.add_argument("concurrency", type=int)
    ap.add_argument("seconds", type=float)
    ap.add_argument("--header", action="append", default=[])
    ap.add_argument("--hold", type=int, default=0)
    ap.add_argument("--wait", action="store_true", help="after the warm-up, print `warm`, wait for a line on stdin")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    headers = {"Content-Type": "application/json"}
    for h in args.header:
        k, _, v = h.partition(":")
        headers[k.strip()] = v.strip()
    body = args.body.encode()
    ttft: list[float] = []
    full: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        # one warm-up stream per client, not counted
        await asyncio.gather(*(one(session, args.url, body, headers, [], [])
                               for _ in range(min(args.concurrency, 64) if not args.hold else 1)),
                             return_exceptions=True)
        if args.wait:
            print("warm", flush=True)
            # the idle pooled connections wait too: the caller reads the server's CPU meanwhile
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        started = time.perf_counter()
        cpu0 = time.process_time()
        if args.hold:
            results = await asyncio.gather(*(one(session, args.url, body, headers, ttft, full)
                                             for _ in range(args.hold)), return_exceptions=True)
            errors = sum(1 for r in results if r is not True)
        else:
            deadline = started + args.seconds

            async def worker() -> None:
                nonlocal errors
                while time.perf_counter() < deadline:
                    try:
                        ok = await one(session, args.url, body, headers, ttft, full)
                    except Exception:  # noqa: BLE001 - counted, not raised
                        ok = False
                    errors += not ok
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu0
    print(json.dumps({
        "streams": len(full), "errors": errors, "seconds": elapsed, "rps": len(full) / elapsed,
        "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
        "full_p50": pct(full, 0.5), "full_p99": pct(full, 0.99), "client_cpu_s": cpu,
    }), flush=True)


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
