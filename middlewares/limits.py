"""Concurrency and rate limits on the API routes (POST /v1/responses[/input_tokens]): the policy.

    limits:
      backend: memory               # memory: per process | redis: shared by every replica
      global_concurrency: 1024      # requests in flight over all keys (null: unlimited)
      default_key_concurrency: 64   # per key, unless the key has its own `concurrency`
      retry_after_s: 1              # Retry-After on a concurrency 429
      redis: {url, key_prefix, slot_ttl_s, socket_timeout_ms, on_error, retry_after_s}

Over a concurrency limit -> 429 `concurrency_limit` with Retry-After. A key with
`rate_per_min` gets a token bucket holding one minute's allowance and
refilling continuously; empty -> 429 `rate_limit_exceeded` with Retry-After set to the
seconds until the next token. A key with `tokens_per_min` has a second bucket, of tokens:
it holds one minute's allowance, refills continuously, and is debited after each request
by the tokens it used (input + output, as billed); while it is empty (at or below zero)
the key's requests get 429 `tokens_per_min_exceeded` with Retry-After set to the seconds
until it is positive again. A request's size is only known once it ran, so the last
request admitted may take the bucket below zero: the next ones wait that much longer.
A slot is held for the whole request, a stream included
(the handler returns once the stream has ended), and is given back in a finally, so a
client that disconnects frees it too. The key's limits are read from its record at each
request, so a changed limit applies to the next one.

The counting is a backend's (proxy/limits/): `memory` counts per process (`serve --workers N`
divides the global limits by N); `redis` counts in one Redis for every process and replica
(proxy/limits/redis_backend.py). With Redis unreachable, `redis.on_error: open` admits
(counting in this process meanwhile) and `closed` answers 503 `limits_unavailable` with
Retry-After `redis.retry_after_s`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.errors import APIError
from proxy.limits.base import GLOBAL, KEY, RATE, Ask, LimitsUnavailable, Refused
from proxy.limits.memory import MemoryCounter
from proxy.runtime.metrics import METRICS
from proxy.runtime.reload import RELOADERS, ReloadRefused
from proxy.state import RequestContext

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.load import Config
    from proxy.config.sections import Limits, LimitsRedis


def _seconds_header(retry_after_s: float) -> str:
    return str(max(0, math.ceil(retry_after_s)))


def _redis_counter(section: LimitsRedis, app: web.Application, *, the_shared_one: bool = True):
    from proxy.limits.redis_backend import SHARED_COUNTER, RedisCounter

    def report(event: str) -> None:
        metrics = app.get(METRICS)
        if metrics is not None:
            metrics.limits_redis.inc((event,))

    counter = RedisCounter(section, report)
    if the_shared_one:  # the keys' (the alerts and /readyz read its state); the levels' is another
        app[SHARED_COUNTER] = counter

    async def running(_app: web.Application):
        async with counter.running():
            yield

    app.cleanup_ctx.append(running)
    return counter


class LevelLimits:
    """The limits of the levels above a key (proxy/ledger/levels.py: a team's rate, tokens per
    minute, concurrency), each level counted as a key is, in a counter of its own: this process's
    with the memory backend; with Redis, a second Redis counter under `<key_prefix>levels:`, so a
    team's limits hold across every replica as a key's do, and its slots never count against the
    global limit (the keys' counter's). Only requests of keys under a level with limits come here."""

    def __init__(self, shared: Any = None) -> None:
        self.local = MemoryCounter()
        self.shared = shared  # a RedisCounter, or None

    async def admit(self, levels: tuple) -> tuple[list[Any], APIError | None]:
        """The tickets taken, or none and the refusal of the first level that refuses."""
        taken: list[Any] = []
        for level in levels:
            if not level.has_limits():
                continue
            ask = Ask(level.level_id, None, level.concurrency, level.rate_per_min, level.tokens_per_min)
            ticket = self.local.admit_now(ask) if self.shared is None else await self.shared.admit(ask)
            if ticket.__class__ is Refused:
                await self.release(taken, None)
                refusal = _refusal(ticket, ask, "1")
                refusal.message = refusal.message.replace("this API key", f"this key's {level.kind}").replace(
                    "This API key", f"This key's {level.kind}")
                return [], refusal
            taken.append(ticket)
        return taken, None

    async def release(self, tickets: list[Any], used_tokens: int | None) -> None:
        for ticket in tickets:
            if self.shared is None:
                self.local.release_now(ticket, used_tokens)
            else:
                await self.shared.release(ticket, used_tokens)


def _refusal(refused: Refused, ask: Ask, retry_header: str) -> APIError:
    if refused.scope == GLOBAL:
        return APIError(429, "The proxy is at its concurrency limit; retry shortly.",
                        code="concurrency_limit", headers={"Retry-After": retry_header})
    if refused.scope == KEY:
        return APIError(429, f"This API key already has {ask.key_limit} requests in flight; retry when one finishes.",
                        code="concurrency_limit", headers={"Retry-After": retry_header})
    wait = {"Retry-After": str(max(1, math.ceil(refused.wait_s)))}
    if refused.scope == RATE:
        return APIError(429, f"Rate limit of {ask.rate_per_min} requests per minute reached for this API key.",
                        code="rate_limit_exceeded", headers=wait)
    return APIError(429, f"Limit of {ask.tokens_per_min} tokens per minute reached for this API key.",
                    code="tokens_per_min_exceeded", headers=wait)


class LiveLimits:
    """The limits a reload changes (proxy/runtime/reload.py): read at each request's admission."""

    __slots__ = ("global_limit", "key_default", "retry_header")

    def __init__(self, section: Limits) -> None:
        self.set(section)

    def set(self, section: Limits) -> None:
        self.global_limit = section.global_concurrency
        self.key_default = section.default_key_concurrency
        self.retry_header = _seconds_header(section.retry_after_s)


def _reloader(live: LiveLimits, section: Limits):
    """The numbers change live; the counter (its backend, Redis) is the process's: a restart."""
    def reload(new: Config) -> Callable[[], None]:
        fresh = new.limits
        if (fresh.backend, fresh.redis, fresh.enabled) != (section.backend, section.redis, section.enabled):
            key = next(k for k in ("backend", "redis", "enabled") if getattr(fresh, k) != getattr(section, k))
            raise ReloadRefused(f"limits.{key} cannot change while serving: restart for it", f"limits.{key}")
        return partial(live.set, fresh)
    return reload


def create(section: Limits, app: web.Application):
    """config.yaml `limits` (config.limits)."""
    live = LiveLimits(section)
    reloaders = app.get(RELOADERS)
    if reloaders is not None:
        reloaders.on("limits", _reloader(live, section))
    if section.backend == "memory":
        return _in_process(MemoryCounter(), live)
    counter = _redis_counter(section.redis, app)
    unavailable_header = _seconds_header(section.redis.retry_after_s)
    admit, release = counter.admit, counter.release
    levels = LevelLimits(_redis_counter(dataclasses.replace(section.redis, key_prefix=section.redis.key_prefix
                                                            + "levels:"), app, the_shared_one=False))

    async def limits(request: web.Request, ctx: RequestContext, call_next) -> web.StreamResponse:
        ask = _ask(ctx, live.global_limit, live.key_default)
        try:
            ticket = await admit(ask)
        except LimitsUnavailable:
            raise _unavailable(unavailable_header) from None
        if ticket.__class__ is Refused:
            raise _refusal(ticket, ask, live.retry_header)
        if ctx.levels:
            return await _with_levels(request, ctx, call_next, levels, release, ticket, unavailable_header)
        return await _with_early_release(request, ctx, call_next, release, ticket)

    return limits


async def _with_levels_here(request: web.Request, ctx: RequestContext, call_next, levels: LevelLimits, release,
                            ticket) -> web.StreamResponse:
    """_with_levels over this process's counters (the memory backend)."""
    taken, refusal = await levels.admit(ctx.levels)
    if refusal is not None:
        release(ticket, None)
        raise refusal
    try:
        return await call_next(request, ctx)
    finally:
        release(ticket, _spent(ctx))
        await levels.release(taken, _spent(ctx))


def _unavailable(retry_header: str) -> APIError:
    return APIError(503, "Limits cannot be checked right now (the shared counter is unreachable); retry shortly.",
                    code="limits_unavailable", headers={"Retry-After": retry_header})


async def _with_levels(request: web.Request, ctx: RequestContext, call_next, levels: LevelLimits, release,
                       ticket, unavailable_header: str) -> web.StreamResponse:
    """The key admitted: its levels' limits next; every ticket given back when the handler returns."""
    try:
        taken, refusal = await levels.admit(ctx.levels)
    except LimitsUnavailable:
        await release(ticket, None)
        raise _unavailable(unavailable_header) from None
    if refusal is not None:
        await release(ticket, None)
        raise refusal
    try:
        return await _with_early_release(request, ctx, call_next, release, ticket)
    finally:
        await levels.release(taken, _spent(ctx))


def _ask(ctx: RequestContext, global_limit: int | None, key_default: int | None) -> Ask:
    record = ctx.key
    if record is None:
        return Ask(None, global_limit, None, None, None)
    return Ask(record.key_id, global_limit, record.concurrency or key_default, record.rate_per_min,
               record.tokens_per_min)


def _in_process(counter: MemoryCounter, live: LiveLimits):
    """The phase over this process's own counters: no I/O, so admit and release are plain
    calls, made before the handler and when it returns."""
    admit, release = counter.admit_now, counter.release_now
    levels = LevelLimits()

    async def limits(request: web.Request, ctx: RequestContext, call_next) -> web.StreamResponse:
        ask = _ask(ctx, live.global_limit, live.key_default)
        ticket = admit(ask)
        if isinstance(ticket, Refused):
            raise _refusal(ticket, ask, live.retry_header)
        if ctx.levels:
            return await _with_levels_here(request, ctx, call_next, levels, release, ticket)
        try:
            return await call_next(request, ctx)
        finally:
            release(ticket, _spent(ctx))

    return limits


async def _with_early_release(request: web.Request, ctx: RequestContext, call_next, release, ticket):
    """A shared counter's release is a round trip, awaited when the handler returns: before the
    last bytes of a stream (its Tail, which the envelope writes after the phases), else the
    client could ask again before its slot is free in every replica."""
    try:
        return await call_next(request, ctx)
    finally:
        await release(ticket, _spent(ctx))


def _spent(ctx: RequestContext) -> int | None:
    """The tokens the answer ends with (as billed, else as shown); None: there was no answer."""
    tokens = ctx.tokens()
    return tokens.input + tokens.output if tokens is not None else None
