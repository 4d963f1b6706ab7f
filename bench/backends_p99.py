"""Tail latency of the proxy on its two backend pairs: SQLite ledger + memory limits (one node)
against PostgreSQL ledger + Redis limits (the scale-out setup), the same load on each.

    .venv/bin/python -m bench.backends_p99 [--clients 50] [--seconds 20] [--hot 5] [--out FILE]

Per backend pair: the proxy (`python -m proxy serve`, 1 worker, the full default chain, leases on,
JSON logs to a file) in front of the built-in simulator (`python -m proxy.simulator.server`, 20
tokens per answer, no delay between them unless --delay), and N concurrent clients (this
process, aiohttp, keep-alive), half their requests JSON, half SSE streams, each client paced (its next request
1/rate after the last one was sent, or half that after it ended when it took longer), so both
backend pairs get about the same offered load and the percentiles compare latency, not
throughput:
  * N - hot clients each spend a key of their own at --own-rate requests/s (1: a key takes a
    lease after balance.lease_min_rate, 4, requests in its last two 1-second windows, so
    these never do: every request takes the exact path, one ledger hold and one settle, each
    a PostgreSQL transaction on that backend; at 2.5/s they would all lease);
  * --hot clients share one hot key at --hot-rate requests/s each (that key runs on leases).
Measured after a warm-up: per request the total time (sent -> last byte) and the time to first
byte (sent -> first body bytes); printed per pair: requests, errors, p50 / p90 / p99 / max of
each, for all requests and for the own-key and hot-key ones apart; then PG+Redis p99 / SQLite
p99 (the target: within 2x). The PostgreSQL and redis-server are throwaway local servers
(bench/backing.py: tests/support/pg_server.py, fsync off, as the output says; redis-server without
persistence). Nothing is pinned unless --proxy-core N: the proxy alone on core N, the
simulator, the servers and the clients on the others. About 55 s with the defaults. With
--out, the table replaces the "### Backends p99" part of that file (bench/results.md), as
bench.ledger_backends does; `make bench` runs it last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
HEADING = "### Backends p99"
MODEL = "tiny-org/tiny-model"
TOKENS = " ".join(["tok"] * 20)
NCPU = len(os.sched_getaffinity(0))
ALL_CORES = {int(c) for c in os.sched_getaffinity(0)}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def start(cmd: list[str], cores: str | None, log: Path) -> subprocess.Popen:
    """The process, on these cores (taskset) or wherever the kernel puts it (None)."""
    if cores is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", cores, *cmd]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def wait_ready(url: str, proc: subprocess.Popen, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as http:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: the process exited ({proc.returncode})")
            try:
                async with http.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready within {within_s} s")
            await asyncio.sleep(0.1)


async def create_keys(section: dict, names: list[str]) -> dict[str, str]:
    """name -> secret; bottomless balances, no per-key limits."""
    sys.path.insert(0, str(ROOT))
    from proxy.ledger import open_ledger

    ledger = open_ledger(section)
    await ledger.start()
    try:
        return {name: (await ledger.create_key(name, balance_micros=10**15))[0] for name in names}
    finally:
        await ledger.close()


def proxy_config(tmp: Path, tag: str, sim_url: str, ledger: dict, limits: dict) -> Path:
    cfg = {
        "server": {"log_format": "json", "workers": 1},
        "workers": [{"name": "sim", "url": sim_url, "models": [MODEL], "capacity": 100_000,
                     "timeouts": {"connect": 5, "first_byte": 60, "idle": 60, "total": 600}}],
        "ledger": ledger,
        "limits": {"global_concurrency": 4096, "default_key_concurrency": 4096, **limits},
    }
    path = tmp / f"proxy-{tag}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


class Samples:
    def __init__(self) -> None:
        self.total: dict[str, list[float]] = {"own": [], "hot": []}
        self.ttfb: dict[str, list[float]] = {"own": [], "hot": []}
        self.errors = 0


async def one(http: aiohttp.ClientSession, url: str, headers: dict, stream: bool,
              script: dict) -> tuple[float, float, bool]:
    """(total s, time to first body bytes s, complete)."""
    body = json.dumps({"model": MODEL, "stream": stream, "max_output_tokens": 40,
                       "input": "hello SIM:" + json.dumps(script)})
    t0 = time.perf_counter()
    first = None
    tail = b""
    async with http.post(url, data=body, headers=headers) as r:
        async for chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter()
            tail = (tail + chunk)[-4096:]
        ok = r.status == 200
    t1 = time.perf_counter()
    ok = ok and (b"response.completed" in tail if stream else b'"status":"completed"' in tail)
    return t1 - t0, (first or t1) - t0, ok


async def client(i: int, group: str, url: str, secret: str, period_s: float, measure_from: float, until: float,
                 samples: Samples, script: dict) -> None:
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                     timeout=aiohttp.ClientTimeout(total=60)) as http:
        await asyncio.sleep(random.random() * period_s)  # the clients out of step
        n = i
        while time.monotonic() < until:
            sent = time.monotonic()
            try:
                total, ttfb, ok = await one(http, url, headers, n % 2 == 1, script)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                total, ttfb, ok = 0.0, 0.0, False
            n += 1
            if sent >= measure_from:
                if ok:
                    samples.total[group].append(total)
                    samples.ttfb[group].append(ttfb)
                else:
                    samples.errors += 1
            # On time: the next one period after this one was sent; late: half a period after it
            # ended (no burst to catch up, which would put an own key over lease_min_rate).
            await asyncio.sleep(max(sent + period_s, time.monotonic() + period_s / 2) - time.monotonic())


async def run_load(url: str, secrets_by_name: dict[str, str], args: argparse.Namespace) -> Samples:
    samples = Samples()
    now = time.monotonic()
    measure_from, until = now + args.warmup, now + args.warmup + args.seconds
    tasks = []
    for i in range(args.clients):
        hot = i < args.hot
        tasks.append(client(i, "hot" if hot else "own", url, secrets_by_name["hot" if hot else f"own{i}"],
                            1.0 / (args.hot_rate if hot else args.own_rate), measure_from, until, samples,
                            {"text": TOKENS, "delay": args.delay}))
    await asyncio.gather(*tasks)
    return samples


async def one_backend(tag: str, sim_url: str, ledger: dict, limits: dict, tmp: Path,
                      args: argparse.Namespace) -> Samples:
    names = ["hot"] + [f"own{i}" for i in range(args.hot, args.clients)]
    keys = await create_keys(ledger, names)
    port = free_port()
    cfg = proxy_config(tmp, tag, sim_url, ledger, limits)
    proc = start([sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--port", str(port)],
                 args.proxy_core, tmp / f"proxy-{tag}.log")
    try:
        await wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
        return await run_load(f"http://127.0.0.1:{port}/v1/responses", keys, args)
    finally:
        stop(proc)


def row(label: str, group: str, samples: Samples) -> tuple[str, float]:
    total = samples.total["own"] + samples.total["hot"] if group == "all" else samples.total[group]
    ttfb = samples.ttfb["own"] + samples.ttfb["hot"] if group == "all" else samples.ttfb[group]
    ms = [f"{pct(total, q) * 1000:.1f}" for q in (0.5, 0.9, 0.99)] + [f"{max(total, default=0) * 1000:.1f}"]
    ms += [f"{pct(ttfb, q) * 1000:.1f}" for q in (0.5, 0.9, 0.99)] + [f"{max(ttfb, default=0) * 1000:.1f}"]
    errors = samples.errors if group == "all" else "-"
    return f"| {label} | {group} | {len(total)} | {errors} | " + " | ".join(ms) + " |", pct(total, 0.99)


def measure(args: argparse.Namespace) -> list[str]:
    from bench.backing import Backing

    lines = ["| backend | requests of | requests | errors | total p50 ms | p90 | p99 | max |"
             " first byte p50 ms | p90 | p99 | max |", "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    p99: dict[str, float] = {}
    others = ALL_CORES - {int(args.proxy_core)} if args.proxy_core is not None else ALL_CORES
    others = others or ALL_CORES
    with tempfile.TemporaryDirectory(prefix="rp-bench-p99-") as tmp_name, Backing(others) as backing:
        tmp = Path(tmp_name)
        fsync = backing.pg.psql("SHOW fsync").strip()
        sim_port = free_port()
        sim = start([sys.executable, "-m", "proxy.simulator.server", "--port", str(sim_port)],
                    ",".join(map(str, sorted(others))), tmp / "sim.log")
        try:
            asyncio.run(wait_ready(f"http://127.0.0.1:{sim_port}/health", sim))
            sim_url = f"http://127.0.0.1:{sim_port}"
            setups = [
                ("sqlite + memory", {"backend": "sqlite", "path": str(tmp / "ledger.db")}, {"backend": "memory"}),
                (f"postgres (fsync {fsync}) + redis",
                 {"backend": "postgres", "dsn": backing.pg_database("p99"), "spool_path": str(tmp / "spool.jsonl")},
                 {"backend": "redis",
                  "redis": {"url": backing.redis.url, "key_prefix": f"p99-{secrets.token_hex(3)}:"}}),
            ]
            for label, ledger, limits in setups:
                tag = re.sub(r"\W+", "-", label)
                samples = asyncio.run(one_backend(tag, sim_url, ledger, limits, tmp, args))
                for group in ("all", "own", "hot"):
                    line, value = row(label, group, samples)
                    print(line, flush=True)
                    lines.append(line)
                    p99[f"{label}/{group}"] = value
        finally:
            stop(sim)
    base, other = [label for label, _, _ in setups]
    ratio = p99[f"{other}/all"] / p99[f"{base}/all"]
    lines.append("")
    lines.append(f"PG+Redis p99 / SQLite p99: {ratio:.2f} (all requests), "
                 f"{p99[f'{other}/own'] / p99[f'{base}/own']:.2f} (own keys: the exact path), "
                 f"{p99[f'{other}/hot'] / p99[f'{base}/hot']:.2f} (the hot key: leases); target <= 2")
    print(lines[-1], flush=True)
    return lines


def write(out: Path, lines: list[str], args: argparse.Namespace) -> None:
    block = (f"{HEADING}\n\n`python -m bench.backends_p99 --clients {args.clients} --seconds {args.seconds:g}` "
             f"({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; {args.clients - args.hot} clients on keys "
             f"of their own at {args.own_rate} requests/s each, {args.hot} on one hot key at {args.hot_rate} "
             f"requests/s each; half JSON, half SSE; 20-token answers; {args.seconds:g} s measured after "
             f"{args.warmup:g} s of warm-up; see the module docstring):\n\n" + "\n".join(lines) + "\n")
    text = out.read_text() if out.exists() else ""
    pattern = re.compile(re.escape(HEADING) + r".*?(?=\n### |\n## |\Z)", re.S)
    text = pattern.sub(lambda _: block.rstrip("\n"), text) if HEADING in text else text.rstrip("\n") + "\n\n" + block
    out.write_text(text if text.endswith("\n") else text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--hot", type=int, default=5, help="clients sharing the hot key (the others: a key each)")
    parser.add_argument("--own-rate", type=float, default=1.0,
                        help="requests/s of each own-key client (under 2: no lease, the exact path)")
    parser.add_argument("--hot-rate", type=float, default=20, help="requests/s of each hot-key client")
    parser.add_argument("--delay", type=float, default=0.0, help="the simulator's delay per token, seconds")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--warmup", type=float, default=3)
    parser.add_argument("--proxy-core", default=None,
                        help="pin the proxy to this core and everything else (simulator, PostgreSQL, redis-server, "
                             "the clients) to the others; default: no pinning")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not 0 < args.hot < args.clients:
        parser.error("--hot must be between 1 and --clients - 1")
    try:
        import uvloop  # the proxy's loop, for the load generator too

        uvloop.install()
    except ImportError:
        pass
    if args.proxy_core is not None and NCPU > 1:  # the load generator beside the servers, off the proxy's core
        os.sched_setaffinity(0, ALL_CORES - {int(args.proxy_core)})
    print(f"backends p99: {args.clients} clients ({args.hot} on the hot key), {args.seconds:g} s per backend pair "
          f"after {args.warmup:g} s of warm-up", flush=True)
    lines = measure(args)
    if args.out:
        write(Path(args.out), lines, args)


if __name__ == "__main__":
    main()
