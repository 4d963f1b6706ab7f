"""What a socket turn refused by the limits phase costs, in-process (client and proxy share the
process, so the figure is an upper bound of the proxy's share).

    python -m bench.ws_refusals [--items 2000] [--turns 200]

A key limited to one request a minute spends its token on a first turn, then sends --turns
`response.create` messages of --items input items each; every one must come back as a 429 error
event. Prints the message size and the wall and CPU time per refused turn. Run it from another
checkout (PYTHONPATH=that tree) to compare trees.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from proxy.config.load import Config
from proxy.app import LEDGER, build_app
from proxy.http.parse_errors import ProxyRunner
from proxy.ledger import KeyLimits
from proxy.simulator.server import Simulator

MODEL = "tiny-org/tiny-model"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until_end(ws) -> dict:
    while True:
        event = orjson.loads((await ws.receive()).data)
        if event["type"] in ("response.completed", "response.failed", "error"):
            return event


async def main(items: int, turns: int) -> None:
    async with Simulator() as sim:
        folder = Path(tempfile.mkdtemp())
        config = Config.from_dict({"workers": [{"name": "sim", "url": sim.url, "dialect": "vllm", "models": [MODEL]}],
                                   "ledger": {"path": str(folder / "ledger.db")},
                                   "server": {"log_format": "json", "log_level": "warning"}})
        app = build_app(config)
        runner = ProxyRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        port = _port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        secret, _ = await app[LEDGER].create_key("bench", balance_micros=10**9, limits=KeyLimits(rate_per_min=1))
        message = orjson.dumps({"type": "response.create", "model": MODEL,
                                "input": [{"type": "message", "role": "user", "content": "x" * 100}] * items})
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"http://127.0.0.1:{port}/v1/responses", max_msg_size=0,
                                       headers={"Authorization": f"Bearer {secret}"}) as ws:
                await ws.send_bytes(orjson.dumps({"type": "response.create", "model": MODEL, "input": "hi"}))
                await _until_end(ws)
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(turns):
                    await ws.send_bytes(message)
                    event = await _until_end(ws)
                    assert event["type"] == "error" and event["status"] == 429, event
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"{len(message):,} B message, {turns} turns refused with 429: {wall / turns * 1000:.2f} ms wall, "
              f"{cpu / turns * 1000:.2f} ms CPU a turn (client and proxy in one process)")
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.items, args.turns))
