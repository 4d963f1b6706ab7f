"""`python -m bench.limits_redis`: what `limits.backend: redis` adds per request over memory.

One admission and one release per request (what middlewares/limits.py does), against the
in-memory counter and against a throwaway redis-server on loopback (tests/support/redis_server.py),
with a key that has a concurrency, a rate and a tokens-per-minute limit (the longest script
path). Sequential (c=1: the latency one request sees) and 16 at once (c=16). CPU is this
process's (time.process_time) and the redis-server's (/proc/<pid>/stat), per request.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time

from proxy.limits.base import Ask
from proxy.limits.memory import MemoryCounter
from proxy.limits.redis_backend import RedisCounter
from tests.support.redis_server import RedisServer

ASK = Ask("key_bench", 1024, 64, 10**9, 10**9)
TICK = os.sysconf("SC_CLK_TCK")


def _server_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def _run(counter, requests: int, concurrency: int) -> list[float]:
    latencies: list[float] = []

    async def one_worker(n: int) -> None:
        for _ in range(n):
            start = time.perf_counter()
            ticket = await counter.admit(ASK)
            await counter.release(ticket, 10)
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(one_worker(requests // concurrency) for _ in range(concurrency)))
    return latencies


async def _cell(name: str, counter, server: RedisServer | None, requests: int, concurrency: int) -> str:
    await _run(counter, 500, concurrency)  # warm-up (scripts loaded, connections open)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    srv0 = _server_cpu(server.proc.pid) if server else 0.0
    latencies = await _run(counter, requests, concurrency)
    wall = time.perf_counter() - wall0
    cpu = (time.process_time() - cpu0) / len(latencies) * 1e6
    srv = ((_server_cpu(server.proc.pid) - srv0) / len(latencies) * 1e6) if server else 0.0
    latencies.sort()
    p50 = statistics.median(latencies) * 1e6
    p99 = latencies[int(len(latencies) * 0.99)] * 1e6
    return (f"| {name} | {concurrency} | {len(latencies) / wall:,.0f} | {p50:.1f} | {p99:.1f} | {cpu:.1f} | "
            f"{srv:.1f} |")


async def main(requests: int = 20000) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(tmp)
        server.start()
        try:
            redis = RedisCounter({"url": server.url, "socket_timeout_ms": 1000})
            rows = ["| backend | c | admit+release/s | p50 us | p99 us | proxy CPU/req us | redis-server CPU/req us |",
                    "|---|---|---|---|---|---|---|"]
            async with redis.running():
                for concurrency in (1, 16):
                    rows.append(await _cell("memory", MemoryCounter(), None, requests, concurrency))
                    rows.append(await _cell("redis", redis, server, requests, concurrency))
        finally:
            server.stop()
    print("\n".join(rows))


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(main())
    else:
        uvloop.run(main())  # as the proxy runs
