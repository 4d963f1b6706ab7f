"""The request phases, in a fixed order, built once at start-up from config.yaml.

    envelope -> auth -> limits -> prepare -> balance -> handler

  envelope  (proxy.http.app) the request id, the one `RequestContext` (proxy.state), the error
            envelope, the access line; it runs the rest with `Phases.run(request, ctx)`.
  auth      the key from the headers alone (ctx.key); nothing of the body is read before it.
  limits    concurrency and rate, still before any byte of the body.
  prepare   (proxy.http.request.prepare) reads the body once (ctx.body), runs the stateless checks
            and the tool policy on it, then translates it once into a frozen Translation
            (ctx.translation).
  balance   holds the cost on the ledger (ctx.hold) and, when the balance covers less, replaces
            ctx.translation with a capped copy (Translation.with_cap); settles after the handler.
  handler   the route's handler (proxy.http.forwarder for /v1/responses).

config.yaml chooses WHICH policies run, never their order: each built-in policy's section has
`enabled` (stateless, auth, limits, tools, balance, notices), so no configuration can put the
balance before the tool policy or read a body before the key is checked. An operator's own
middlewares go at named points, `middlewares: {after_auth: [...], ...}`; each point promises
what is known there (POINTS). A custom entry is "package.module:factory", configured by the
top-level section of that name or written {"package.module:factory": {...}}; the factory is
called as factory(section, app) and returns an aiohttp middleware (or raises: a bad entry stops
start-up with one line, never at the first request).

Built-ins are made by their module's `create(section, app)`: auth, limits and balance return a
phase `(request, ctx, call_next)`; stateless and tools return a body check
`(ctx, body) -> body` that prepare applies; notices installs a response hook and returns None.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

from aiohttp import web

from proxy.config.load import Config, ConfigError
from proxy.config.schema import POINTS, POLICIES
from proxy.http.request import prepare_phase
from proxy.state import RequestContext

Factory = Callable[[dict[str, Any], web.Application], Any]
Next = Callable[[web.Request, RequestContext], Awaitable[web.StreamResponse]]


class Phase(Protocol):
    """A phase: called with the rest of the chain as `call_next`, by name (Phases chains them)."""

    def __call__(self, request: web.Request, ctx: RequestContext, call_next: Next) -> Awaitable[web.StreamResponse]:
        ...


__all__ = ["Phases", "build_phases", "POINTS", "POLICIES"]


def _import(entry: str) -> Factory:
    module_name, _, attr = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an operator's module may fail in any way; report it in one line
        raise ConfigError(f"middlewares: cannot import {module_name!r} for {entry!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"middlewares: {module_name!r} has no callable {attr!r} for {entry!r}")
    return factory


def _made(name: str, factory: Factory, section: dict[str, Any], app: web.Application) -> Any:
    try:
        return factory(section, app)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{name!r} rejected its config section: {type(exc).__name__}: {exc}") from exc


def _policy(config: Config, app: web.Application, name: str) -> Any:
    """The built-in policy `name` made from its section, or None when it is switched off."""
    section = dict(config.section(name))
    if section.pop("enabled", True) is False:
        return None
    module = importlib.import_module(f"middlewares.{name}")
    return _made(name, module.create, section, app)


def _custom_entries(config: Config, point: str) -> list[tuple[str, dict[str, Any]]]:
    entries = []
    for item in (config.get("middlewares") or {}).get(point) or []:
        if isinstance(item, str):
            name, section = item, config.get(item) or {}
        else:
            ((name, section),) = item.items()
            section = section or {}
        if not isinstance(section, dict):
            raise ConfigError(f"middlewares.{point}: the config section of {name!r} must be a mapping")
        entries.append((name, section))
    return entries


def _as_phase(middleware: Any) -> Phase:
    """An aiohttp middleware `(request, handler)` as a phase: its handler is the rest of the phases."""
    async def custom(request: web.Request, ctx: RequestContext, call_next: Next) -> web.StreamResponse:
        return await middleware(request, lambda req: call_next(req, ctx))

    return custom


def _customs(config: Config, app: web.Application, point: str) -> list[Phase]:
    phases = []
    for name, section in _custom_entries(config, point):
        middleware = _made(name, _import(name), section, app)
        if not callable(middleware):
            raise ConfigError(f"middlewares.{point}: the factory of {name!r} did not return a middleware")
        phases.append(_as_phase(middleware))
    return phases


async def _endpoint(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    """After the last phase: the route's handler (ctx.endpoint: what the envelope was given)."""
    return await ctx.endpoint(request)


class Phases:
    """The phases after the envelope, chained once: `run(request, ctx)` runs them and the handler.

    One turn of another transport (a WebSocket message, the compact endpoint's summary) comes
    through the envelope like any request, so through these phases too (proxy.http.turn)."""

    def __init__(self, steps: list[Phase]) -> None:
        self.steps = tuple(steps)
        run: Next = _endpoint
        for step in reversed(self.steps):
            # A partial: calling it is the step's own coroutine, no frame of ours around it.
            run = partial(step, call_next=run)
        self.run = run


def build_phases(config: Config, app: web.Application) -> Phases:
    """Every enabled policy and custom middleware, made in phase order (the app signals and
    cleanup contexts their factories add keep that order). Raises ConfigError for a bad entry."""
    body_checks = [check for check in (_policy(config, app, "stateless"),) if check is not None]
    auth = _policy(config, app, "auth")
    after_auth = _customs(config, app, "after_auth")
    limits = _policy(config, app, "limits")
    tools = _policy(config, app, "tools")
    if tools is not None:
        body_checks.append(tools)
    prepare = prepare_phase(app, body_checks)
    after_prepare = _customs(config, app, "after_prepare")
    balance = _policy(config, app, "balance")
    before_handler = _customs(config, app, "before_handler")
    _policy(config, app, "notices")  # a response hook only
    steps = [auth, *after_auth, limits, prepare, *after_prepare, balance, *before_handler]
    return Phases([step for step in steps if step is not None])
