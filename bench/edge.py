"""What an unauthenticated or hostile request costs the proxy, measured on a real process.

    python -m bench.edge                       # this tree
    python -m bench.edge --root /tmp/old-tree  # another checkout of the proxy (before/after)

Starts `python -m proxy serve` (cwd = --root, so that tree's code runs) with the default
chain, an embedded simulator and a temp SQLite ledger, then prints:

  * cpu/unauth-8MB: the proxy's CPU (every thread, the kernel's per-process clock) per POST of
    an 8 MB JSON body without a key, sent back to back over --requests requests, and the
    status the client saw;
  * cpu/unauth-{bad: the same for a 5-byte `{bad` body (status only: 401 or 400);
  * latency: a paying client's request latency (small JSON requests, one at a time, for
    --seconds) alone, then beside --senders unauthenticated clients posting 8 MB bodies in a loop;
  * rss/<encoding>: the proxy's peak RSS growth (VmHWM, reset first) over one request, with
    a valid key, whose body is a compression bomb expanding to --bomb-mb of zeros.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    return time.clock_gettime((~pid << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_hwm(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _zeros_deflate(total: int) -> tuple[bytes, int]:
    """A raw deflate stream of `total` zero bytes, built from one full-flushed 1 MiB block
    repeated (a full flush resets the window, so every block compresses the same)."""
    chunk = bytes(1 << 20)
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = z.compress(chunk) + z.flush(zlib.Z_FULL_FLUSH)
    return block * (total >> 20) + z.flush(), total


def bomb(encoding: str, total: int) -> bytes:
    chunk = bytes(1 << 20)
    if encoding in ("gzip", "deflate"):
        raw, size = _zeros_deflate(total)
        if encoding == "gzip":
            crc = 0
            for _ in range(size >> 20):
                crc = zlib.crc32(chunk, crc)
            return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + raw + struct.pack("<II", crc, size & 0xFFFFFFFF)
        adler = 1
        for _ in range(size >> 20):
            adler = zlib.adler32(chunk, adler)
        return b"\x78\xda" + raw + struct.pack(">I", adler)
    if encoding == "zstd":
        import zstandard

        c = zstandard.ZstdCompressor(level=3).compressobj()  # streamed: no content size in the header
        return b"".join([c.compress(chunk) for _ in range(total >> 20)] + [c.flush()])
    raise ValueError(encoding)


async def start(root: Path, tmp: Path) -> tuple[subprocess.Popen, int, str]:
    import yaml

    cfg = {"server": {"log_format": "json", "log_level": "warning"},
           "workers": [{"name": "local", "url": "embedded", "models": ["tiny-org/tiny-model"], "capacity": 256}],
           "ledger": {"path": str(tmp / "ledger.db")}, "auth": {"demo_key": True}}
    path = tmp / "proxy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "--config", str(path), "serve", "--port", str(port)],
                            cwd=root, stdout=subprocess.PIPE, stderr=open(tmp / "proxy.log", "ab"))
    key = ""
    while not key:
        line = await asyncio.to_thread(proc.stdout.readline)
        if not line:
            raise SystemExit((tmp / "proxy.log").read_text()[-2000:])
        if line.startswith(b"demo key: "):
            key = line.decode().split(": ", 1)[1].strip()
    await until_ok(f"http://127.0.0.1:{port}/v1/models", {"Authorization": f"Bearer {key}"})
    return proc, port, key


async def until_ok(url: str, headers: dict | None = None, tries: int = 400) -> None:
    """Until GET `url` answers 200 (a server just started), at most `tries` x 50 ms."""
    async with aiohttp.ClientSession() as http:
        for _ in range(tries):
            try:
                async with http.get(url, headers=headers or {}) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)


async def post(port: int, body: bytes, headers: dict) -> int | str:
    async with aiohttp.ClientSession() as http:
        try:
            async with http.post(f"http://127.0.0.1:{port}/v1/responses", data=body,
                                 headers={"Content-Type": "application/json", **headers}) as r:
                await r.read()
                return r.status
        except aiohttp.ClientError as exc:
            return type(exc).__name__


async def paying_latencies(port: int, key: str, seconds: float) -> list[float]:
    body = b'{"model":"tiny-org/tiny-model","input":"hi","max_output_tokens":4}'
    out = []
    async with aiohttp.ClientSession() as http:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter()
            async with http.post(f"http://127.0.0.1:{port}/v1/responses", data=body,
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status
            out.append(time.perf_counter() - started)
    return out


_FLOOD = r"""
import socket, sys, threading, time
port, seconds, senders, rate = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
body = b'{"model":"tiny-org/tiny-model","input":"' + b"x" * (8 * 1024 * 1024 - 64) + b'"}'
head = (b"POST /v1/responses HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body))
end = time.monotonic() + seconds
sent = [0] * senders
def run(i):
    due = time.monotonic()
    while time.monotonic() < end:
        if rate > 0:  # an offered load the same for every build: one body per sender every 1/rate s
            time.sleep(max(0.0, due - time.monotonic()))
            due += 1 / rate
        with socket.create_connection(("127.0.0.1", port)) as s:
            try:
                s.sendall(head + body)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
            except OSError:
                pass
        sent[i] += 1
threads = [threading.Thread(target=run, args=(i,)) for i in range(senders)]
[t.start() for t in threads]
[t.join() for t in threads]
print(sum(sent))
"""


def _summary(values: list[float]) -> str:
    values = sorted(values)
    p = lambda q: values[min(len(values) - 1, int(q * len(values)))] * 1000  # noqa: E731
    return f"n={len(values)} p50 {p(0.5):.1f} ms  p99 {p(0.99):.1f} ms  max {values[-1] * 1000:.1f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--bomb-mb", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--rate", type=float, default=2.0, help="bodies per second per sender (0: back to back)")
    args = parser.parse_args()
    big = b'{"model":"tiny-org/tiny-model","input":"' + b"x" * (8 * 1024 * 1024 - 64) + b'"}'
    with tempfile.TemporaryDirectory() as tmp:
        proc, port, key = await start(args.root.resolve(), Path(tmp))
        try:
            for name, body in (("unauth-8MB", big), ("unauth-{bad", b"{bad")):
                await post(port, body, {})  # warm-up
                before = cpu_seconds(proc.pid)
                statuses = set()
                for _ in range(args.requests):
                    statuses.add(await post(port, body, {}))
                spent = (cpu_seconds(proc.pid) - before) / args.requests
                print(f"cpu/{name:12s} {spent * 1000:8.2f} ms per request   status {sorted(map(str, statuses))}")
            alone = await paying_latencies(port, key, args.seconds)
            print(f"latency/alone          {_summary(alone)}")
            # The unauthenticated senders run in their own process (blocking sockets, one thread
            # each), so their sending does not queue the paying client's requests behind it here.
            flooder = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _FLOOD, str(port), str(args.seconds + 1), str(args.senders), str(args.rate),
                stdout=asyncio.subprocess.PIPE)
            await asyncio.sleep(0.5)
            beside = await paying_latencies(port, key, args.seconds)
            sent = int((await flooder.communicate())[0] or 0)
            print(f"latency/beside-{args.senders}x8MB  {_summary(beside)}   "
                  f"({sent} unauthenticated 8 MB bodies sent, "
                  f"{args.rate or 'no'} per second per sender)")
            auth = {"Authorization": f"Bearer {key}"}
            for encoding in ("gzip", "deflate", "zstd"):
                payload = bomb(encoding, args.bomb_mb << 20)
                await post(port, b"{}", auth)  # warm-up
                rss = status_kb(proc.pid, "VmRSS")
                reset_hwm(proc.pid)
                status = await post(port, payload, {**auth, "Content-Encoding": encoding})
                peak = status_kb(proc.pid, "VmHWM")
                print(f"rss/{encoding:8s} body {len(payload) / 1024:8.0f} KiB -> {args.bomb_mb} MiB: "
                      f"peak RSS +{(peak - rss) / 1024:7.1f} MiB (base {rss / 1024:.0f} MiB)   status {status}")
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(main())
