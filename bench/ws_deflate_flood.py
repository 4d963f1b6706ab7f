"""What a refused key's permessage-deflate flood costs the proxy, against refused HTTP requests:
the proxy's own CPU (a process of its own, its CPU clock), per refused message.

    python -m bench.ws_deflate_flood [--messages 120] [--inflated-mb 8]

The key has a balance of 0: every turn and every request is refused with 402. The attacker
sends small messages that inflate to --inflated-mb each (~8 KB on the wire for 8 MB of JSON)
as long as the proxy negotiates permessage-deflate, and reconnects when a socket is closed;
on a socket without deflate it sends the same ~8 KB uncompressed (all it can afford to send).
A handshake the proxy refuses (refuse_sockets_s after a socket was closed for its refusals)
counts as one refused message: it is what the attacker gets for it. The HTTP side: the same number of refused POST /v1/responses on one keep-alive connection.
Prints CPU ms per refused message for both and their ratio (the issue's bound: within 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import zlib
from pathlib import Path

import aiohttp
import orjson
import yaml

from bench.edge import cpu_seconds, free_port, until_ok

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-org/tiny-model"


async def _serve(folder: Path) -> tuple[asyncio.subprocess.Process, str, str]:
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump({
        "workers": [{"name": "local", "url": "embedded", "dialect": "vllm", "models": [MODEL]}],
        "ledger": {"path": str(folder / "ledger.db")},
        "server": {"log_format": "json", "log_level": "warning"},
        "balance": {"demo_balance_micros": 0},
        "websocket": {"max_refused_turns": int(os.environ.get("REFUSED_TURNS", "3"))},
    }))
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        str(ROOT / ".venv" / "bin" / "python"), "-m", "proxy", "--config", str(config), "serve", "--demo-key",
        "--port", str(port), cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    secret = ""
    while not secret:
        line = await proc.stdout.readline()
        if not line:
            raise SystemExit("the proxy exited")
        if line.startswith(b"demo key: "):
            secret = line.decode().split(": ", 1)[1].strip()
    url = f"http://127.0.0.1:{port}"
    await until_ok(url + "/healthz")
    return proc, url, secret


async def _http(url: str, secret: str, n: int) -> None:
    body = orjson.dumps({"model": MODEL, "input": "hi"})
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {secret}"}) as http:
        for _ in range(n):
            async with http.post(url + "/v1/responses", data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 402, r.status
                await r.read()


async def _flood(url: str, secret: str, n: int, inflated_mb: int) -> tuple[int, int]:
    """(messages refused, handshakes tried); a refused handshake counts as one refused message."""
    text = "x" * (inflated_mb * 1024 * 1024 - 200)
    message = orjson.dumps({"type": "response.create", "model": MODEL, "input": text})
    small = zlib.compressobj(9, zlib.DEFLATED, -15)
    wire = small.compress(message) + small.flush(zlib.Z_SYNC_FLUSH)
    plain = orjson.dumps({"type": "response.create", "model": MODEL, "input": "x" * max(1, len(wire) - 80)})
    refused = sockets = 0
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {secret}"}) as http:
        while refused < n:
            sockets += 1
            try:
                ws = await http.ws_connect(url.replace("http", "ws") + "/v1/responses", compress=15, max_msg_size=0)
            except aiohttp.WSServerHandshakeError as exc:  # the handshake refused instead: one refusal
                assert exc.status in (402, 429), exc.status
                refused += 1
                continue
            async with ws:
                deflated = ws.compress != 0
                while refused < n and not ws.closed:
                    # What the attacker can send for the same ~8 KB: the flood, or plain bytes.
                    try:
                        await ws.send_bytes(message if deflated else plain)
                    except aiohttp.ClientConnectionResetError:
                        break  # closed by the proxy (1008) as the message went
                    reply = await ws.receive()
                    if reply.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                        break
                    refused += 1
    return refused, sockets


async def main(messages: int, inflated_mb: int) -> None:
    proc, url, secret = await _serve(Path(tempfile.mkdtemp()))
    try:
        await _http(url, secret, 5)  # warm
        before = cpu_seconds(proc.pid)
        await _http(url, secret, messages)
        http_ms = (cpu_seconds(proc.pid) - before) / messages * 1000
        before = cpu_seconds(proc.pid)
        refused, sockets = await _flood(url, secret, messages, inflated_mb)
        ws_ms = (cpu_seconds(proc.pid) - before) / refused * 1000
        print(f"refused HTTP request: {http_ms:.2f} ms CPU each ({messages})")
        print(f"refused deflate-flood message ({inflated_mb} MB inflated, ~8 KB sent): {ws_ms:.2f} ms CPU each "
              f"({refused} over {sockets} handshakes)")
        print(f"ratio: {ws_ms / http_ms:.2f}x")
    finally:
        proc.terminate()
        await proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=120)
    parser.add_argument("--inflated-mb", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(main(args.messages, args.inflated_mb))
