"""python -m soak [--minutes 3] [--concurrency 32] [--interval 10]

Starts the simulator in this process and the proxy as a subprocess (full default chain, a
fresh SQLite ledger in a temporary directory), then drives mixed traffic: JSON and streamed
answers, tool calls, clients that vanish mid-stream, upstream faults (resets, garbage, error
events, 503 pages, stalls), and invalid bodies. Every interval it prints one line: requests
by outcome, the proxy's RSS and open fds, open holds, the simulator's in-flight count.

At the end it compares the last third of the samples with the first third: RSS may not grow
by more than --rss-slack-mb, fds by more than --fd-slack, and no unexpected outcome (a 5xx
other than 502/503/504, a malformed answer, a client error) may appear. Exit code 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[1]

SCRIPTS = [
    (30, None),  # the default deterministic answer
    (10, {"text": "a short scripted answer"}),
    (8, {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}),
    (4, {"text": "one two three four five six", "drop_after": 2}),
    (4, {"text": "one two three", "garbage": True}),
    (4, {"text": "one two three four", "error_after": 2}),
    (3, {"status": 503, "body": "<html><body>overloaded</body></html>"}),
    (3, {"reset_before_headers": True}),
    (2, {"text": "one two three four", "stall_after": 2}),
    (2, {"first_byte_delay": 3}),
]
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _holds(db: Path) -> int:
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute("SELECT COUNT(*) FROM holds").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return -1


def _pick(rnd: random.Random):
    total = sum(w for w, _ in SCRIPTS)
    x = rnd.uniform(0, total)
    for w, s in SCRIPTS:
        x -= w
        if x <= 0:
            return s
    return None


async def _one(http: aiohttp.ClientSession, url: str, key: str, rnd: random.Random, counts: Counter) -> None:
    kind = rnd.random()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if kind < 0.05:  # invalid bodies
        raw = rnd.choice([b"{", b"[]", b'{"model": 1}', b'{"model":"tiny-org/tiny-model","input":[{"type":"x"}]}',
                          b'{"model":"tiny-org/tiny-model","input":"x","tools":{}}'])
        async with http.post(url + "/v1/responses", data=raw, headers=headers) as r:
            await r.read()
            counts["invalid_4xx" if 400 <= r.status < 500 else f"UNEXPECTED_{r.status}"] += 1
        return
    script = _pick(rnd)
    stream = rnd.random() < 0.6
    text = f"question {rnd.randrange(10**6)}" + (f" SIM:{json.dumps(script)}" if script else "")
    body = {"model": "tiny-org/tiny-model", "input": text, "stream": stream, "max_output_tokens": 64}
    if script and "tool_calls" in script:
        body["tools"] = TOOLS
    vanish = stream and rnd.random() < 0.1
    async with http.post(url + "/v1/responses", data=orjson.dumps(body), headers=headers) as r:
        if vanish and r.status == 200:
            await r.content.readline()
            r.connection.transport.abort() if r.connection and r.connection.transport else None
            r.close()
            counts["vanished"] += 1
            return
        raw = await r.read()
        if r.status == 200 and stream:
            events = [line for line in raw.split(b"\n") if line.startswith(b"event: ")]
            last = events[-1] if events else b""
            outcome = last.removeprefix(b"event: response.").decode() if last else "MALFORMED_stream"
            counts[f"stream_{outcome}"] += 1
        elif r.status == 200:
            counts[f"json_{orjson.loads(raw).get('status')}"] += 1
        elif r.status in (502, 503, 504) and set(orjson.loads(raw)) == {"error"}:
            counts[f"envelope_{r.status}"] += 1
        else:
            counts[f"UNEXPECTED_{r.status}"] += 1


async def main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    from proxy.simulator.server import Simulator

    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    async with Simulator() as sim:
        cfg = {
            "server": {"log_format": "json", "log_level": "error"},
            "workers": [{"name": "sim", "url": sim.url, "models": ["tiny-org/tiny-model"], "capacity": 4096,
                         "timeouts": {"connect": 2, "first_byte": 1.5, "idle": 1.5, "total": 5}}],
            "ledger": {"path": str(tmp / "ledger.db")},
            "limits": {"global_concurrency": 4096, "default_key_concurrency": 4096},
            "balance": {"demo_balance_micros": 10**12},
            # one worker playing every fault on purpose: passive ejection would turn the rest into 503s
            "health": {"outlier": {"consecutive_failures": 10**9}},
        }
        (tmp / "proxy.yaml").write_text(yaml.safe_dump(cfg))
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        log = open(tmp / "proxy.log", "ab")
        proc = await asyncio.create_subprocess_exec(
            str(Path(sys.executable)), "-m", "proxy", "serve", "--config", str(tmp / "proxy.yaml"),
            "--port", str(port), "--demo-key", cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=log)
        key = ""
        while not key:
            line = await proc.stdout.readline()
            if not line:
                print("the proxy did not start; see", tmp / "proxy.log")
                return 1
            if line.startswith(b"demo key: "):
                key = line.decode().split(": ", 1)[1].strip()
        await asyncio.sleep(0.5)
        counts: Counter = Counter()
        samples: list[tuple[float, int, int, int, int]] = []
        deadline = time.monotonic() + args.minutes * 60
        started = time.monotonic()

        async def worker(i: int) -> None:
            local = random.Random(args.seed * 1000 + i)
            connector = aiohttp.TCPConnector(limit=4)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
                while time.monotonic() < deadline:
                    try:
                        await _one(http, url, key, local, counts)
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                        counts[f"CLIENT_{type(exc).__name__}"] += 1

        async def sampler() -> None:
            print(f"{'t_s':>6} {'requests':>9} {'rss_mb':>7} {'fds':>5} {'holds':>6} {'sim_in_flight':>13}  outcomes")
            while time.monotonic() < deadline:
                await asyncio.sleep(args.interval)
                rss, fds = _rss_kib(proc.pid), _fds(proc.pid)
                t = time.monotonic() - started
                samples.append((t, rss, fds, _holds(tmp / "ledger.db"), sim.in_flight))
                bad = {k: v for k, v in counts.items() if k.isupper() or k.startswith(("UNEXPECTED", "CLIENT", "MALF"))}
                print(f"{t:6.0f} {sum(counts.values()):9d} {rss / 1024:7.1f} {fds:5d} {samples[-1][3]:6d} "
                      f"{sim.in_flight:13d}  {dict(sorted(counts.items()))}" + (f"  BAD {bad}" if bad else ""),
                      flush=True)

        await asyncio.gather(sampler(), *(worker(i) for i in range(args.concurrency)))
        await asyncio.sleep(2)  # settle, then the final sample (idle: no holds, nothing in flight)
        final = (time.monotonic() - started, _rss_kib(proc.pid), _fds(proc.pid), _holds(tmp / "ledger.db"),
                 sim.in_flight)
        proc.terminate()
        await proc.wait()
        log.close()

    third = max(1, len(samples) // 3)
    first_rss = min(s[1] for s in samples[:third]) if samples else final[1]
    last_rss = min(s[1] for s in samples[-third:]) if samples else final[1]
    first_fds = max(s[2] for s in samples[:third]) if samples else final[2]
    bad = {k: v for k, v in counts.items() if k.startswith(("UNEXPECTED", "CLIENT", "MALFORMED"))}
    problems = []
    if last_rss - first_rss > args.rss_slack_mb * 1024:
        problems.append(f"RSS grew {first_rss / 1024:.1f} -> {last_rss / 1024:.1f} MB")
    if final[2] > first_fds + args.fd_slack:
        problems.append(f"fds grew {first_fds} -> {final[2]}")
    if final[3] != 0:
        problems.append(f"{final[3]} holds left open when idle")
    if final[4] != 0:
        problems.append(f"{final[4]} upstream requests left in flight")
    if bad:
        problems.append(f"unexpected outcomes {bad}")
    print(f"\nsoak: {args.minutes:g} min, {sum(counts.values())} requests, {counts['vanished']} clients vanished, "
          f"RSS {first_rss / 1024:.1f} -> {last_rss / 1024:.1f} MB (idle end {final[1] / 1024:.1f}), "
          f"fds {first_fds} -> {final[2]}, holds at end {final[3]}, ledger {tmp / 'ledger.db'}")
    print("FAIL: " + "; ".join(problems) if problems else "OK: nothing grew, nothing was lost")
    return 1 if problems else 0


def cli() -> int:
    parser = argparse.ArgumentParser(prog="python -m soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", 3)))
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--interval", type=float, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rss-slack-mb", type=float, default=15)
    parser.add_argument("--fd-slack", type=int, default=8)
    return asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(cli())
