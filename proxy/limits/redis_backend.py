"""The Redis limits backend (`limits.backend: redis`): every replica and `--workers` child
counts in one Redis, so the global and per-key limits hold over all of them.

One EVALSHA per admission (proxy/limits/scripts.py ADMIT: both concurrency scopes, the rate
bucket and the tokens-per-minute bucket checked and the slot taken, atomically, on Redis's
clock) and one per release (the slot removed, the tokens debited). A slot is a ZSET member
whose score is its expiry, and it is a lease: only its live request renews it (the heartbeat
renews this process's live slots every slot_ttl_s / 3, in one pipelined call), so the slots of
a replica that dies expire after slot_ttl_s and the limit frees up.

Redis down or slow (socket_timeout_ms): `on_error: open` admits, counting in this process's
memory meanwhile (each replica then enforces the limits on its own); `on_error: closed`
refuses (LimitsUnavailable: the policy answers 503 limits_unavailable with Retry-After). Once
a call failed, requests take the fallback at once (none waits on a socket) and the heartbeat
tries Redis every PROBE_S; the first call that gets through ends the outage, with no restart.

What a call that timed out did is unknown: a frozen Redis (SIGSTOP, a stalled host) or a
partitioned network runs the command once it resumes, after the client gave up. An ADMIT run
that late would take a slot nobody renews nor releases (a phantom, held for slot_ttl_s), and a
release skipped or lost in an outage leaves its slot the same way. So this process keeps the
ids of such slots, "doubtful" (an admission that failed, timed out or was cancelled; a release
that failed, was cancelled or skipped while Redis was down; at most _MAX_DOUBTFUL of them,
the oldest dropped to expire by their TTL), and the first round trip Redis answers (the
heartbeat's: at once when a doubtful slot appears, every PROBE_S while Redis is down) forgets
them all in one pipelined call with the live slots' renewal: FORGET removes each from its
ZSETs and tombstones it in this replica's fence ZSET for slot_ttl_s. An ADMIT still on its way
then finds the tombstone and takes nothing (code 5, "fenced": never an answer this process
waits for); one that ran before FORGET is undone by it; a late RENEW only renews members still
there (XX). Either order ends with the ZSETs holding exactly the live requests' slots, one
probe interval after Redis answers. The hot path is unchanged: one EVALSHA per admission and
per release (ADMIT reads the fence with one ZSCORE). Limits of this: a late ADMIT arriving more
than slot_ttl_s after its FORGET (its tombstone gone) is a phantom for slot_ttl_s again; live
requests whose slots expired in an outage longer than slot_ttl_s are not counted in Redis
again (renewal never brings back a member); tokens-per-minute debits of an outage are lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable, Mapping
from itertools import count
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from aiohttp import web
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from proxy.config import settings as config_settings
from proxy.limits.base import GLOBAL, KEY, RATE, TOKENS, Ask, LimitsUnavailable, Refused
from proxy.limits.memory import MemoryCounter
from proxy.limits.scripts import ADMIT, FORGET, RELEASE, RENEW
from proxy.logs import log

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import LimitsRedis

ERRORS = (RedisError, OSError, asyncio.TimeoutError)
_SCOPES = {1: GLOBAL, 2: KEY, 3: RATE, 4: TOKENS}
_FENCED = 5  # ADMIT of a slot this replica already forgot
_CHUNK = 512  # members per RENEW / FORGET call (its arguments stay small); all chunks in one pipeline
_MAX_DOUBTFUL = 8192  # doubtful slot ids kept; past this the oldest is left to expire by its TTL
PROBE_S = 0.5  # while Redis is down the heartbeat tries it this often


class RedisTicket:
    __slots__ = ("slot", "keys", "tokens_key", "tokens_per_min")

    def __init__(self, slot: str, keys: list[str], tokens_key: str | None, tokens_per_min: int | None) -> None:
        self.slot = slot
        self.keys = keys  # the zsets the slot is in: the global one [, the key's]
        self.tokens_key = tokens_key
        self.tokens_per_min = tokens_per_min


def _grouped(slots: dict[str, list[str]], head: list[str], ttl_ms: int) -> list[tuple[list[str], list[Any]]]:
    """RENEW / FORGET calls for `slots` (slot id -> its zsets): KEYS = head + zsets, ARGV = ttl,
    then per zset its member count and members; at most _CHUNK members per call."""
    by_key: dict[str, list[str]] = {}
    for slot, keys in slots.items():
        for key in keys:
            by_key.setdefault(key, []).append(slot)
    calls: list[tuple[list[str], list[Any]]] = []
    keys_now: list[str] = list(head)
    args_now: list[Any] = [ttl_ms]
    size = 0
    for key, members in by_key.items():
        for start in range(0, len(members), _CHUNK):
            part = members[start:start + _CHUNK]
            if size and size + len(part) > _CHUNK:
                calls.append((keys_now, args_now))
                keys_now, args_now, size = list(head), [ttl_ms], 0
            keys_now.append(key)
            args_now += [len(part), *part]
            size += len(part)
    if size:
        calls.append((keys_now, args_now))
    return calls


class RedisCounter:
    def __init__(self, section: LimitsRedis | Mapping[str, Any],
                 report: Callable[[str], None] | None = None) -> None:
        """config.yaml `limits.redis` (config.limits.redis); a mapping of its keys (a tool's, a
        test's) is read as that section, the rest at the schema's defaults."""
        settings: LimitsRedis = (config_settings.of("limits.redis", dict(section)) if isinstance(section, Mapping)
                                 else section)
        timeout = settings.socket_timeout_ms / 1000.0
        self.client = aioredis.Redis.from_url(
            settings.url, socket_timeout=timeout,
            socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self.prefix = settings.key_prefix
        self.ttl_ms = max(1, int(settings.slot_ttl_s * 1000))
        self.closed = settings.on_error == "closed"
        self.report = report or (lambda _event: None)
        self.admit_script = self.client.register_script(ADMIT)
        self.release_script = self.client.register_script(RELEASE)
        self.renew_script = self.client.register_script(RENEW)
        self.forget_script = self.client.register_script(FORGET)
        self.replica = secrets.token_hex(6)  # slot ids of this process: "<replica>:<n>"
        self.numbers = count()
        self.live: dict[str, list[str]] = {}  # slot id -> the zsets it is in (renewed by the heartbeat)
        self.doubtful: dict[str, list[str]] = {}  # slot id -> the zsets it may be in (forgotten by the heartbeat)
        self.fallback = MemoryCounter()  # on_error: open, while Redis is down
        self.down = False
        self.global_key = self.prefix + "conc:global"
        self.fence_key = f"{self.prefix}fence:{self.replica}"
        self._wake = asyncio.Event()  # the heartbeat has work now (doubtful slots, an outage began)

    # ------------------------------------------------------------------ admission

    async def admit(self, ask: Ask) -> RedisTicket | Any:
        if self.down:  # the heartbeat probes Redis: no request waits on a socket meanwhile
            return self._unavailable(ask)
        slot = f"{self.replica}:{next(self.numbers)}"
        keys = [self.fence_key, self.global_key]
        tokens_key = None
        if ask.key_id is not None:
            base = f"{self.prefix}key:{ask.key_id}:"
            tokens_key = base + "tpm"
            keys += [base + "conc", base + "rate", tokens_key]
        args: list[str | int] = [slot, self.ttl_ms, ask.global_limit or 0, ask.key_limit or 0,
                ask.rate_per_min or 0, ask.tokens_per_min or 0]
        try:
            code, wait_ms = await self.admit_script(keys=keys, args=args)
        except ERRORS as exc:  # the ADMIT may still run in Redis: the slot is doubtful
            self._doubt(slot, keys[1:3])
            self._failed("admit", exc)
            return self._unavailable(ask)
        except asyncio.CancelledError:
            self._doubt(slot, keys[1:3])
            raise
        code = int(code)
        if code == _FENCED:  # pragma: no cover - slot ids are never reused: no caller waits on a fenced ADMIT
            return self._unavailable(ask)
        if code:
            return Refused(_SCOPES[code], int(wait_ms) / 1000.0)
        ticket = RedisTicket(slot, keys[1:3], tokens_key, ask.tokens_per_min)
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
            self._wake.set()  # the heartbeat starts probing
            log.warning("limits: Redis unreachable; " + ("refusing requests (on_error: closed)" if self.closed
                        else "admitting on this process's own counts (on_error: open)"),
                        backend="redis", during=what, error=f"{type(exc).__name__}: {exc}")

    def _recovered(self) -> None:
        self.down = False
        log.warning("limits: Redis is reachable again; limits are shared again", backend="redis")
        self.report("recovered")

    def _doubt(self, slot: str, keys: list[str]) -> None:
        """A slot Redis may hold that no live request owns: the heartbeat forgets it."""
        self.doubtful[slot] = keys
        if len(self.doubtful) > _MAX_DOUBTFUL:
            del self.doubtful[next(iter(self.doubtful))]  # the oldest expires by its TTL
        if not self.down:  # else the heartbeat is probing already
            self._wake.set()

    # ------------------------------------------------------------------ release

    async def release(self, ticket: Any, used_tokens: int | None) -> None:
        if not isinstance(ticket, RedisTicket):
            self.fallback.release_now(ticket, used_tokens)
            return
        self.live.pop(ticket.slot, None)
        if self.down:  # not worth a socket wait: forgotten once Redis answers
            self._doubt(ticket.slot, ticket.keys)
            return
        keys = list(ticket.keys)
        tpm = ticket.tokens_per_min or 0
        if tpm and ticket.tokens_key is not None and len(keys) > 1:
            keys.append(ticket.tokens_key)
        args: list[str | int] = [ticket.slot, tpm, -1 if used_tokens is None else used_tokens]
        try:
            await self.release_script(keys=keys, args=args)
        except ERRORS as exc:
            self._doubt(ticket.slot, ticket.keys)
            self._failed("release", exc)
        except asyncio.CancelledError:
            self._doubt(ticket.slot, ticket.keys)
            raise

    # ------------------------------------------------------------------ renewal, forgetting

    async def sync(self, renew: bool = True) -> bool:
        """One pipelined round trip: the doubtful slots forgotten (FORGET), the live ones
        renewed (when `renew`); a PING when there is neither. True when Redis answered: that
        ends an outage."""
        forget = dict(self.doubtful)
        pipe = self.client.pipeline(transaction=False)
        for keys, args in _grouped(forget, [self.fence_key], self.ttl_ms):
            await self.forget_script(keys=keys, args=args, client=pipe)
        for keys, args in _grouped(self.live, [], self.ttl_ms) if renew else ():
            await self.renew_script(keys=keys, args=args, client=pipe)
        if not pipe.command_stack:
            pipe.ping()
        try:
            await pipe.execute()
        except ERRORS as exc:
            self._failed("renew" if renew else "forget", exc)
            return False
        for slot in forget:
            self.doubtful.pop(slot, None)
        if self.down:
            self._recovered()
        return True

    async def renew(self) -> None:
        """Every live slot's expiry pushed slot_ttl_s on (and the doubtful ones forgotten)."""
        await self.sync(True)

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        period = self.ttl_ms / 3000.0
        due = loop.time() + period
        while True:
            if self.down:  # probing: the live slots renewed and the doubtful ones forgotten, or a PING
                await asyncio.sleep(PROBE_S)
            elif not self.doubtful:  # until the renewal is due, or woken (a doubtful slot, an outage)
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, due - loop.time()))
            renew = self.down or loop.time() >= due
            try:
                if await self.sync(renew) and renew:
                    due = loop.time() + period
            except Exception:  # pragma: no cover - the heartbeat must outlive any one failure
                log.exception("limits: renewing the Redis slots failed")
                await asyncio.sleep(PROBE_S)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RedisCounter]:
        """The heartbeat runs inside; the doubtful slots are forgotten (one try) and the
        client closed after."""
        beat = asyncio.get_running_loop().create_task(self._heartbeat())
        try:
            yield self
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            if self.doubtful:
                with contextlib.suppress(Exception):
                    await self.sync(False)
            await self.client.aclose()


SHARED_COUNTER = web.AppKey("limits_shared_counter", RedisCounter)  # limits.backend: redis (alerts read .down)
