"""The request phases, in a fixed order, built once at start-up from config.yaml.

    envelope -> auth -> limits -> prepare -> balance -> handler

  envelope  (proxy.http.app) the request id, the one `RequestContext` (proxy.state), the error
            envelope, the access line; it runs the rest with `Phases.run(request, ctx)`.
  auth      the key from the headers alone (ctx.key); nothing of the body is read before it.
  limits    concurrency and rate, still before any byte of the body.
  prepare   (proxy.http.request.prepare) reads the body once (ctx.body), runs the stateless checks
            and the tool policy on it, then translates it once into a frozen Translation
            (ctx.translation).
  balance   holds the cost on the ledger (ctx.hold) and keeps the translation capped to it
            (ctx.capped, Translation.with_cap: lowered when the balance covers less; the handler
            answers ctx.to_answer()); settles from the handler's report (ctx.report) after it.
  handler   the route's handler (proxy.http.forwarder for /v1/responses).

config.yaml chooses WHICH policies run, never their order: each built-in policy's section has
`enabled` (stateless, auth, limits, tools, balance, notices), so no configuration can put the
balance before the tool policy or read a body before the key is checked. An operator's own
middlewares go at named points, `middlewares: {after_auth: [...], ...}`; each point promises
what is known there (POINTS). A custom entry is "package.module:factory", configured by the
top-level section of that name or written {"package.module:factory": {...}}; the factory is
called as factory(section, app) with that section as written (a plain mapping: its keys are the
factory's to check) and returns an aiohttp middleware (or raises: a bad entry stops start-up
with one line, never at the first request; proxy/config/custom.py).

Built-ins are made by their module's `create(section, app)`, `section` being the policy's typed
settings (config.auth, config.limits, ...; checked at load, so the factories check nothing):
auth, limits and balance return a
phase `(request, ctx, call_next)`; stateless and tools return a body check
`(ctx, body) -> body` that prepare applies; notices installs a response hook and returns None.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

from aiohttp import web

from proxy.config import custom
from proxy.config.load import Config
from proxy.config.schema import POINTS, POLICIES
from proxy.http.request import prepare_phase
from proxy.state import RequestContext

Next = Callable[[web.Request, RequestContext], Awaitable[web.StreamResponse]]


class Phase(Protocol):
    """A phase: called with the rest of the chain as `call_next`, by name (Phases chains them)."""

    def __call__(self, request: web.Request, ctx: RequestContext, call_next: Next) -> Awaitable[web.StreamResponse]:
        ...


__all__ = ["Phases", "build_phases", "POINTS", "POLICIES"]


def _policy(config: Config, app: web.Application, name: str) -> Any:
    """The built-in policy `name` made from its typed section, or None when it is switched off."""
    section = getattr(config, name)
    if not section.enabled:
        return None
    module = importlib.import_module(f"middlewares.{name}")
    return custom.made(name, module.create, section, app)


def _as_phase(middleware: Any) -> Phase:
    """An aiohttp middleware `(request, handler)` as a phase: its handler is the rest of the phases."""
    async def custom(request: web.Request, ctx: RequestContext, call_next: Next) -> web.StreamResponse:
        return await middleware(request, lambda req: call_next(req, ctx))

    return custom


def _customs(config: Config, app: web.Application, point: str) -> list[Phase]:
    return [_as_phase(custom.middleware(point, name, section, app)) for name, section in custom.entries(config, point)]


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
