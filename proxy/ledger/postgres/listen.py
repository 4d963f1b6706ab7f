"""Key changes from every replica: LISTEN on a dedicated connection, bump key_generation.

The PostgreSQL ledger NOTIFYs `CHANNEL` (payload: the key id) in the same transaction as
every change a cached lookup could miss (revoke, limits, rotate), so the notification is
delivered at its commit, to every listening replica. `KeyListener` keeps one connection
(not from the pool) LISTENing and calls `on_change()` for each notification; the ledger's
on_change bumps its key_generation, and middlewares/auth.py's key cache drops every entry
filled under an older one.

A missed notification must not leave a stale cache: on_change() is also called each time
the connection is (re)established (whatever was sent while it was down is unknown) and
when it is lost. The connection is pinged every `ping_s` so a silent loss (a network cut
that sends no FIN) is noticed within about 2 x ping_s; reconnects back off up to 5 s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import asyncpg

log = logging.getLogger("proxy.ledger")

CHANNEL = "rp_ledger_keys"


class KeyListener:
    def __init__(self, dsn: str, on_change: Callable[[], None], *, connect_timeout_s: float,
                 ping_s: float = 2.0, server_settings: dict[str, str] | None = None) -> None:
        self.dsn = dsn
        self.on_change = on_change
        self.connect_timeout_s = connect_timeout_s
        self.ping_s = ping_s
        self.server_settings = server_settings or {}
        self.connected = asyncio.Event()
        self.stats = {"notifications": 0, "connects": 0, "losses": 0}
        self._task: asyncio.Task | None = None
        self._closed = False

    async def start(self, wait_s: float | None = None) -> None:
        """Start listening; waits (up to wait_s, default the connect timeout) for the first
        connection, but a listener that cannot connect yet keeps trying in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="ledger-key-listener")
        try:
            await asyncio.wait_for(self.connected.wait(), wait_s if wait_s is not None else self.connect_timeout_s)
        except TimeoutError:
            log.warning("ledger key listener not connected yet; key changes fall back to the cache TTL meanwhile")

    async def close(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    def _notified(self, *_args: object) -> None:
        self.stats["notifications"] += 1
        self.on_change()

    async def _run(self) -> None:
        backoff = 0.1
        while not self._closed:
            try:
                conn = await asyncpg.connect(self.dsn, timeout=self.connect_timeout_s,
                                             server_settings=self.server_settings)
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                self.on_change()  # unknown what changed meanwhile
                log.debug("ledger key listener cannot connect: %s", exc)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)
                continue
            backoff = 0.1
            try:
                await self._listen(conn)
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.debug("ledger key listener lost its connection: %s", exc)
            finally:
                self.connected.clear()
                self.stats["losses"] += 1
                self.on_change()
                if not conn.is_closed():
                    conn.terminate()

    async def _listen(self, conn: asyncpg.Connection) -> None:
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        await conn.add_listener(CHANNEL, self._notified)
        self.stats["connects"] += 1
        self.on_change()  # whatever was sent while nobody listened
        self.connected.set()
        while not lost.is_set() and not self._closed:
            try:
                await asyncio.wait_for(lost.wait(), self.ping_s)
            except TimeoutError:
                await conn.fetchval("SELECT 1", timeout=self.ping_s)
