"""A simulator and a proxy (the full default chain) on a private event loop in a background
thread, for synchronous drivers: hypothesis' @given and schemathesis.

    with LiveStack(tmp_path) as live:
        live.url, live.api_key, live.sim, live.call(coro)
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveStack:
    def __init__(self, tmp_path: Path, overrides: dict[str, Any] | None = None) -> None:
        self.tmp_path = tmp_path
        self.overrides = overrides or {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="live-stack", daemon=True)
        self.url = ""
        self.api_key = ""
        self.sim = None
        self.app = None
        self._runner = None

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        from aiohttp import web

        from proxy import state
        from proxy.app import build_app
        from proxy.http.parse_errors import ProxyRunner
        from proxy.config.load import Config
        from proxy.simulator.server import Simulator

        self.sim = Simulator()
        await self.sim.start()
        base: dict[str, Any] = {
            "workers": [{"name": "sim", "url": self.sim.url, "dialect": "vllm", "models": ["tiny-org/tiny-model"],
                         "timeouts": {"connect": 2, "first_byte": 10, "idle": 10, "total": 60}}],
            "ledger": {"path": str(self.tmp_path / "ledger.db")},
            "server": {"log_format": "json", "log_level": "warning"},
        }
        base.update(self.overrides)
        self.app = build_app(Config.from_dict(base))
        self._runner = ProxyRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        self.api_key = self.app.get(state.DEMO_KEY) or ""

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.sim is not None:
            await self.sim.stop()

    def __enter__(self) -> "LiveStack":
        self.thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    async def _ledger_state(self):
        from middlewares.balance import wait_for_settlements
        from proxy.app import LEDGER

        await wait_for_settlements(self.app)  # settlement runs after the answer, in its own task
        ledger = self.app[LEDGER]
        return await ledger.holds(), await ledger.audit()

    def ledger_state(self):
        """(open holds, audit rows) of the live ledger."""
        return self.call(self._ledger_state())
