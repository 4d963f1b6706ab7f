"""The Redis limits backend (`limits.backend: redis`): every replica and `--workers` child
counts in one Redis, so the global and per-key limits hold over all of them.

One EVALSHA per admission (proxy/limits/scripts.py ADMIT: both concurrency scopes, the rate
bucket and the tokens-per-minute bucket checked and the slot taken, atomically, on Redis's
clock) and one per release (the slot removed, the tokens debited). A slot is a ZSET member
whose score is its expiry: this process renews its live slots every slot_ttl_s / 3 in one
pipelined call, so the slots of a replica that dies (or whose release never reached Redis)
expire after slot_ttl_s and the limit frees up.

Redis down or slow (socket_timeout_ms): `on_error: open` admits, counting in this process's
memory meanwhile (each replica then enforces the limits on its own); `on_error: closed`
refuses (LimitsUnavailable: the policy answers 503 limits_unavailable with Retry-After). While
Redis is down one request at a time tries it again (the others take the fallback at once,
without waiting on a socket); the first that succeeds ends the outage, with no restart.
Releases and renewals are skipped meanwhile: their slots expire by their TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from itertools import count
from typing import Any, AsyncIterator, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from proxy.limits.base import GLOBAL, KEY, RATE, TOKENS, Ask, LimitsUnavailable, Refused
from proxy.limits.memory import MemoryCounter
from proxy.limits.scripts import ADMIT, RELEASE, RENEW
from proxy.runtime.logs import log

ERRORS = (RedisError, OSError, asyncio.TimeoutError)
_SCOPES = {1: GLOBAL, 2: KEY, 3: RATE, 4: TOKENS}
_RENEW_CHUNK = 512  # members per RENEW call (its arguments stay small); all chunks in one pipeline


class RedisTicket:
    __slots__ = ("slot", "keys", "tokens_key", "tokens_per_min")

    def __init__(self, slot: str, keys: list[str], tokens_key: str | None, tokens_per_min: int | None) -> None:
        self.slot = slot
        self.keys = keys  # the zsets the slot is in: the global one [, the key's]
        self.tokens_key = tokens_key
        self.tokens_per_min = tokens_per_min


class RedisCounter:
    def __init__(self, section: dict[str, Any], report: Callable[[str], None] | None = None) -> None:
        timeout = section.get("socket_timeout_ms", 250) / 1000.0
        self.client = aioredis.Redis.from_url(
            str(section.get("url", "redis://127.0.0.1:6379/0")), socket_timeout=timeout,
            socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self.prefix = str(section.get("key_prefix", "responses-proxy:limits:"))
        self.ttl_ms = max(1, int(float(section.get("slot_ttl_s", 30)) * 1000))
        self.closed = section.get("on_error", "open") == "closed"
        self.report = report or (lambda _event: None)
        self.admit_script = self.client.register_script(ADMIT)
        self.release_script = self.client.register_script(RELEASE)
        self.renew_script = self.client.register_script(RENEW)
        self.replica = secrets.token_hex(6)  # slot ids of this process: "<replica>:<n>"
        self.numbers = count()
        self.live: dict[str, list[str]] = {}  # slot id -> the zsets it is in (renewed by the heartbeat)
        self.fallback = MemoryCounter()  # on_error: open, while Redis is down
        self.down = False
        self.probing = False
        self.global_key = self.prefix + "conc:global"
        self._tasks: set[asyncio.Task] = set()  # releases of cancelled admissions

    # ------------------------------------------------------------------ admission

    async def admit(self, ask: Ask) -> RedisTicket | Any:
        if self.down and self.probing:  # another request is trying Redis: do not wait on it
            return self._unavailable(ask)
        slot = f"{self.replica}:{next(self.numbers)}"
        keys = [self.global_key]
        tokens_key = None
        if ask.key_id is not None:
            base = f"{self.prefix}key:{ask.key_id}:"
            tokens_key = base + "tpm"
            keys += [base + "conc", base + "rate", tokens_key]
        args = [slot, self.ttl_ms, ask.global_limit or 0, ask.key_limit or 0,
                ask.rate_per_min or 0, ask.tokens_per_min or 0]
        probe = self.down
        self.probing = self.probing or probe
        try:
            code, wait_ms = await self.admit_script(keys=keys, args=args)
        except ERRORS as exc:
            self._failed("admit", exc)
            return self._unavailable(ask)
        except asyncio.CancelledError:  # the slot may have been taken: give it back, or it expires
            self._spawn_release(RedisTicket(slot, keys[:2], None, None), None)
            raise
        finally:
            if probe:
                self.probing = False
        if self.down:
            self.down = False
            log.warning("limits: Redis is reachable again; limits are shared again", backend="redis")
            self.report("recovered")
        if code:
            return Refused(_SCOPES[int(code)], int(wait_ms) / 1000.0)
        ticket = RedisTicket(slot, keys[:2], tokens_key, ask.tokens_per_min)
        self.live[slot] = ticket.keys
        return ticket

    def _unavailable(self, ask: Ask) -> Any:
        if self.closed:
            raise LimitsUnavailable("the shared limits counter (Redis) cannot be reached")
        return self.fallback.admit_now(ask)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.report("error")
        if not self.down:
            self.down = True
            log.warning("limits: Redis unreachable; " + ("refusing requests (on_error: closed)" if self.closed
                        else "admitting on this process's own counts (on_error: open)"),
                        backend="redis", during=what, error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ release

    async def release(self, ticket: Any, used_tokens: int | None) -> None:
        if not isinstance(ticket, RedisTicket):
            self.fallback.release_now(ticket, used_tokens)
            return
        self.live.pop(ticket.slot, None)
        if self.down:  # not worth a socket wait: the slot expires by its TTL
            return
        keys = list(ticket.keys)
        tpm = ticket.tokens_per_min or 0
        if tpm and ticket.tokens_key is not None and len(keys) > 1:
            keys.append(ticket.tokens_key)
        args = [ticket.slot, tpm, -1 if used_tokens is None else used_tokens]
        try:
            await self.release_script(keys=keys, args=args)
        except ERRORS as exc:
            self._failed("release", exc)

    def _spawn_release(self, ticket: RedisTicket, used_tokens: int | None) -> None:
        task = asyncio.get_running_loop().create_task(self.release(ticket, used_tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ renewal

    def _renew_calls(self) -> list[tuple[list[str], list[Any]]]:
        """The live slots grouped by zset, in calls of at most _RENEW_CHUNK members."""
        by_key: dict[str, list[str]] = {}
        for slot, keys in self.live.items():
            for key in keys:
                by_key.setdefault(key, []).append(slot)
        calls: list[tuple[list[str], list[Any]]] = []
        keys_now: list[str] = []
        args_now: list[Any] = [self.ttl_ms]
        size = 0
        for key, members in by_key.items():
            for start in range(0, len(members), _RENEW_CHUNK):
                part = members[start:start + _RENEW_CHUNK]
                if size and size + len(part) > _RENEW_CHUNK:
                    calls.append((keys_now, args_now))
                    keys_now, args_now, size = [], [self.ttl_ms], 0
                keys_now.append(key)
                args_now += [len(part), *part]
                size += len(part)
        if keys_now:
            calls.append((keys_now, args_now))
        return calls

    async def renew(self) -> None:
        """Every live slot's expiry pushed slot_ttl_s on: one pipelined round trip."""
        calls = self._renew_calls()
        if not calls:
            return
        pipe = self.client.pipeline(transaction=False)
        for keys, args in calls:
            await self.renew_script(keys=keys, args=args, client=pipe)
        try:
            await pipe.execute()
        except ERRORS as exc:
            self._failed("renew", exc)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000.0)
            try:
                await self.renew()
            except Exception:  # pragma: no cover - the heartbeat must outlive any one failure
                log.exception("limits: renewing the Redis slots failed")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator["RedisCounter"]:
        """The heartbeat runs inside; the client is closed after."""
        beat = asyncio.get_running_loop().create_task(self._heartbeat())
        try:
            yield self
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            for task in list(self._tasks):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, 1.0)
            await self.client.aclose()
