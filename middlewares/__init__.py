"""The request phases, in a fixed order, built once at start-up from config.yaml.

    envelope -> auth -> limits -> prepare -> balance -> handler

  envelope  (proxy.app) the request id, the one `RequestContext` (proxy.state), the error
            envelope, the access line; it runs the request's unit's chain, `Phases.chain(ctx.unit)`:
            built once per unit of work (proxy.units) from the phases that unit declares.
  auth      the key from the headers alone (ctx.key); nothing of the body is read before it.
  limits    concurrency and rate, still before any byte of the body.
  prepare   (proxy.http.request.prepare) reads the body once (ctx.body), runs the stateless checks
            and the tool policy on it, then translates it once into a frozen Translation
            (ctx.translation).
  balance   holds the cost on the ledger (ctx.hold) and keeps the translation capped to it
            (ctx.capped, Translation.with_cap: lowered when the balance covers less; the handler
            answers ctx.to_answer()); settles from the handler's report (ctx.report) after it.
  handler   the route's handler (proxy.http.responses_handler for /v1/responses).

config.yaml chooses WHICH policies run, never their order: each built-in policy's section has
`enabled` (stateless, auth, limits, tools, balance, notices), so no configuration can put the
balance before the tool policy or read a body before the key is checked. An operator's own
middlewares go at named points, `middlewares: {after_auth: [...], ...}`; each point promises
what is known there (POINTS), and runs in the chains of the units that run the phase making
that promise (after_auth: auth; after_prepare: translate; before_handler: balance). A custom
entry is "package.module:factory", configured by the
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
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Protocol

from aiohttp import web

from proxy.config import custom
from proxy.config.load import Config
from proxy.config.schema import POINTS, POLICIES
from proxy.errors import APIError
from proxy.http.passthrough_handler import SWITCHES
from proxy.http.request import Next, prepare_phase
from proxy.runtime.tracing import traced_next, traced_phase
from proxy.state import RequestContext
from proxy.units import AUTH, BALANCE, BODY, LIMITS, PASSTHROUGH, TRANSLATE, UNITS, Unit


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


def _turned_off(switch: str) -> Next:
    """A pass-through endpoint config.yaml turned off (`endpoints.<switch>: false`): after auth
    (whether a path exists is not told without a key), a 404, before any limit or byte of body."""
    async def endpoint_disabled(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        raise APIError(404, f"{ctx.path} is turned off on this proxy (endpoints.{switch}).", code="endpoint_disabled")

    return endpoint_disabled


def _chain(steps: list[Phase], end: Next) -> Next:
    run = end
    for step in reversed(steps):
        # A partial: calling it is the step's own coroutine, no frame of ours around it.
        run = partial(step, call_next=run)
    return run


# Which phase of a unit each custom point belongs to: a point runs for the units that run the
# phase whose result it promises (POINTS).
_POINT_PHASE = {"after_auth": AUTH, "after_prepare": TRANSLATE, "before_handler": BALANCE}


class Phases:
    """The phases after the envelope: one chain per unit of work (proxy.units), built once
    at start-up from the phases that unit declares, custom points included. A phase a unit does
    not declare is not in its chain, so no phase asks which unit it runs for; `chain(unit)`
    is what the envelope runs.

    `head` are the phases before the body, `prepare(unit, rest)` the body phase of a unit (its
    `rest`: the chain after it for the unit and each of its declared variants, since the body
    can ask for a variant), `tail` the phases after it. Each step is (its phase, the step).

    One turn of another transport (a WebSocket message, the compact endpoint's summary) comes
    through the envelope like any request, so through these phases too (proxy.http.turn)."""

    def __init__(self, head: list[tuple[str, Phase]], prepare: Callable[[Unit, dict[str, Next]], Next],
                 tail: list[tuple[str, Phase]], turned_off: dict[Unit, str] | None = None,
                 handlers: Mapping[str, Next] | None = None) -> None:
        self.head, self.tail, self.prepare = head, tail, prepare
        self.turned_off = turned_off or {}
        self.handlers = handlers or {}  # variant name -> the handler that ends its chain (the route table's)
        self.chains: dict[str, Next] = {}  # by unit name (a string's hash is kept; a tuple's is not)
        for unit in UNITS:
            self.chains[unit.name] = self._build(unit)

    def names(self, unit: Unit) -> list[str]:
        """The steps a unit's chain runs, by name, in order (the body phase: "prepare")."""
        def name(step: Phase) -> str:
            return getattr(step, "__name__", type(step).__name__)

        if unit in self.turned_off:
            return [name(step) for phase, step in self.head if phase == AUTH] + ["endpoint_disabled"]
        head = [name(step) for phase, step in self.head if phase in unit.phases]
        tail = [name(step) for phase, step in self.tail if phase in unit.phases]
        return head + (["prepare"] if BODY in unit.phases else []) + tail

    def _rest(self, unit: Unit) -> Next:
        return _chain([step for phase, step in self.tail if phase in unit.phases],
                      self.handlers.get(unit.name, _endpoint))

    def _build(self, unit: Unit) -> Next:
        head = [step for phase, step in self.head if phase in unit.phases]
        switch = self.turned_off.get(unit)
        if switch is not None:
            return _chain([step for phase, step in self.head if phase == AUTH], _turned_off(switch))
        if BODY not in unit.phases:
            return _chain(head, self._rest(unit))
        rest = {variant.name: self._rest(variant) for variant in (unit, *unit.variants)}
        return _chain(head, self.prepare(unit, rest))

    def chain(self, unit: Unit) -> Next:
        run = self.chains.get(unit.name)
        if run is None:  # a unit outside the table (a test's own): built once, as the others
            run = self.chains[unit.name] = self._build(unit)
        return run


def build_phases(config: Config, app: web.Application, handlers: Mapping[str, Next] | None = None) -> Phases:
    """Every enabled policy and custom middleware, made in phase order (the app signals and
    cleanup contexts their factories add keep that order), chained per unit. Raises
    ConfigError for a bad entry. `handlers`: the route table's handler of each variant that
    has one of its own (proxy.http.routes.VARIANT_HANDLERS)."""
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
    head = [(AUTH, auth), *((_POINT_PHASE["after_auth"], c) for c in after_auth), (LIMITS, limits)]
    tail = [*((_POINT_PHASE["after_prepare"], c) for c in after_prepare), (BALANCE, balance),
            *((_POINT_PHASE["before_handler"], c) for c in before_handler)]
    turned_off = {unit: SWITCHES[unit.family] for unit in PASSTHROUGH
                  if not getattr(config.endpoints, SWITCHES[unit.family])}
    head = [(phase, step) for phase, step in head if step is not None]
    tail = [(phase, step) for phase, step in tail if step is not None]
    if config.tracing.endpoint:  # each phase in a span (built so only with tracing on: off costs nothing)
        head = [(phase, traced_phase(phase, step)) for phase, step in head]
        tail = [(phase, traced_phase(phase, step)) for phase, step in tail]
        untraced = prepare

        def prepare(unit: Unit, rest: dict[str, Next]) -> Next:
            return traced_next("prepare", untraced(unit, rest))
    return Phases(head, prepare, tail, turned_off, handlers)


PHASES = web.AppKey("phases", Phases)  # middlewares.Phases: auth .. handler, for one request or one turn
