"""The upstream model servers (vLLM or SGLang) and the choice among them.

A worker is one chat-completions server. The pool holds what routing needs to answer "which worker takes this
request" (proxy.upstream.routing.choose does the provider-requirement filtering and the least-loaded
choice), keeps the in-flight counts that choice and capacity need, and keeps each
worker's health: the active checks' verdict (proxy.upstream.health) and passive outlier ejection
(N consecutive connection failures / 5xx -> ejected for a time that doubles with each
repeated ejection, re-admitted by the next passing active check once that time is over).

Ejection is bounded (Envoy's max_ejection_percent, with a floor): it never takes out more
than `max_ejection_percent` of a model's workers, nor, below 100, the last available worker
of a model. And a model whose every checked-healthy worker is ejected routes to those
ejected workers anyway (Envoy's panic routing, at a threshold of none left): a request that
fails the same way on every retry must not turn into an outage for every client.

Per request, the pool hands routing a cached Route of the model (who serves it, who is
available, the affinity rings over them), rebuilt only after a worker's health, ejection,
dialect or models change, so the common request builds no list, set or ring.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import aiohttp
from multidict import CIMultiDict

from proxy.config import settings as config_settings
from proxy.logs import log

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import HealthOutlier, Workers, WorkersTimeouts

_UNSET = object()


class RoutingEpoch:
    """One pool's epoch: moves whenever a field its cached routes depend on changes on one of
    its workers (see _RoutingField); routes built at another epoch are rebuilt on the next
    request. Per pool, so one app's health changes never make another app rebuild."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


_T = TypeVar("_T")


class _RoutingField(Generic[_T]):
    """A Worker field the pools' cached routes depend on (health, ejection, dialect, models).

    Setting it to a different value moves the epoch of every pool holding the worker, whoever
    sets it (proxy.upstream.health, the pool's outlier ejection, start-up discovery, a test), so
    a route can never outlive the state it was built from. Reads cost a Python call; the
    per-request path reads the cached route instead. The value lives in the instance under
    "_<name>". What routing reads live on every request (in_flight, capacity, labels,
    ewma_ttfb) needs no tracking.
    """

    def __init__(self, default: _T) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> _T:
        if obj is None:
            return self.default  # what dataclass takes as the field's default
        return obj.__dict__[self.slot]

    def __set__(self, obj: Any, value: _T) -> None:
        values = obj.__dict__
        if values.get(self.slot, _UNSET) != value:
            for epoch in values.get("_routing_epochs", ()):  # none before the worker joins a pool
                epoch.value += 1
        values[self.slot] = value


# A worker entry's defaults, from the schema (a test's or a tool's Worker(...) takes them too).
_ENTRY: Workers = config_settings.of("workers[]", {"name": "-", "url": "embedded"})


def ejection_time(outlier: HealthOutlier, multiplier: int) -> float:
    """health.outlier: the ejection of the multiplier-th repeat, doubled each time up to the cap."""
    return min(outlier.base_ejection_s * (2 ** max(multiplier - 1, 0)), outlier.max_ejection_s)


@dataclass(eq=False)
class Worker:
    name: str
    url: str
    dialect: _RoutingField[str] = _RoutingField(_ENTRY.dialect)  # "detect" until start-up has asked the server
    models: _RoutingField[tuple[str, ...]] = _RoutingField(())
    api_key: str | None = None
    labels: dict[str, Any] = field(default_factory=dict)
    capacity: int = _ENTRY.capacity
    timeouts: WorkersTimeouts = _ENTRY.timeouts  # workers[].timeouts: connect, first_byte, idle, total (frozen)
    thinking_switch: str = _ENTRY.thinking_switch  # the chat-template kwarg its model reads (proxy.protocol.dialects)
    max_model_len: dict[str, int] = field(default_factory=dict)
    models_known: bool = True  # False while `models` was omitted and /v1/models has not answered yet
    listed_models: tuple[str, ...] | None = None  # the entry's own `models` (None: discovered); a reload compares it
    in_flight: int = 0
    # Active health (proxy.upstream.health): the checker's verdict.
    healthy: _RoutingField[bool] = _RoutingField(True)
    # Down until proven up: with active checks a worker starts unhealthy and its first
    # passing check (whatever healthy_threshold says) lets it in.
    awaiting_first_check: bool = False
    check_failures: int = 0
    check_successes: int = 0
    last_check_error: str | None = None
    # Passive health: outlier ejection.
    consecutive_failures: int = 0
    ejected: _RoutingField[bool] = _RoutingField(False)
    ejected_until: float = 0.0
    ejection_multiplier: int = 0
    ejections_total: int = 0
    last_ejected_at: float = 0.0
    # Time to first byte, exponentially weighted (seconds); None until the first answer.
    ewma_ttfb: float | None = None

    @property
    def chat_url(self) -> str:
        return f"{self.url.rstrip('/')}/v1/chat/completions"

    def endpoint(self, path: str) -> str:
        return self.url.rstrip("/") + path

    @property
    def tokenize_path(self) -> str:
        """The worker's tokenizer endpoint (SGLang serves it under /v1)."""
        return "/v1/tokenize" if self.dialect == "sglang" else "/tokenize"

    def auth_headers(self) -> dict[str, str]:
        # Each worker has its own credential; the client's Authorization never travels upstream.
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @functools.cached_property
    def chat_headers(self) -> CIMultiDict:
        """The headers of every chat request, built once (aiohttp takes a CIMultiDict as is)."""
        return CIMultiDict({"Content-Type": "application/json", **self.auth_headers()})

    @functools.cached_property
    def client_timeout(self) -> aiohttp.ClientTimeout:
        # Only the connect phase is bounded here; first byte, idle and total are the
        # forwarder's own timers (each one answers differently).
        return aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect, sock_connect=self.timeouts.connect)

    # serves() and available are asked per request (metrics, health): they read the
    # _RoutingField slots as plain attributes, without the descriptor call.

    def serves(self, model: str) -> bool:
        return model in self._models  # type: ignore[attr-defined]  # the slot _RoutingField.__set__ fills

    @property
    def load(self) -> float:
        return self.in_flight / max(self.capacity, 1)

    @property
    def available(self) -> bool:
        """Healthy by the active checks and not ejected by the passive ones."""
        return self._healthy and not self._ejected and self._dialect != "detect"  # type: ignore[attr-defined]  # as serves


def _entry_of(worker: Worker) -> tuple:
    """What a worker's config entry says of it (its state left out): a reload keeps a worker
    whose entry is the same."""
    return (worker.url, worker.api_key, tuple(sorted(worker.labels.items())), worker.capacity, worker.timeouts,
            worker.thinking_switch, worker.listed_models)


def parse_workers(entries: Iterable[Workers]) -> list[Worker]:
    """The workers of config.yaml's `workers` (typed settings, checked at load)."""
    return [Worker(name=entry.name, url=entry.url, dialect=entry.dialect, models=tuple(entry.models or ()),
                   api_key=entry.api_key, labels=dict(entry.labels), capacity=entry.capacity,
                   timeouts=entry.timeouts, thinking_switch=entry.thinking_switch,
                   models_known=bool(entry.models) or entry.url == "embedded",
                   listed_models=tuple(entry.models) if entry.models else None)
            for entry in entries]


class Route:
    """What routing needs of one model, built once per epoch: the workers serving it, the
    available ones among them (in pool order), and proxy.upstream.affinity's rings over those two
    sets by vnodes. Lists are never mutated once built: a change builds a new Route."""

    __slots__ = ("serving", "available", "available_ids", "rings")

    def __init__(self, serving: list[Worker]) -> None:
        self.serving = serving
        self.available = [w for w in serving if w.available]
        if not self.available and any(w.ejected for w in serving):
            # Panic routing: every worker of the model that passes its checks is ejected.
            # Ejection is a guess from failed requests, a passing check a fact: they take the traffic.
            self.available = [w for w in serving if w._healthy and w._dialect != "detect"]  # type: ignore[attr-defined]  # as serves
        self.available_ids = frozenset(map(id, self.available))
        self.rings: dict[int, tuple[Any, Any]] = {}  # vnodes -> (ring of available, ring of serving)


class WorkerPool:
    """The workers (a list replaced whole by a reload, never changed in place), their
    in-flight counts and health, and per-model routes cached until a worker's routing
    fields change."""

    def __init__(self, workers: Iterable[Worker], *, outlier: HealthOutlier | None = None,
                 ewma_alpha: float = 0.3) -> None:
        self.workers = list(workers)
        self.outlier: HealthOutlier = outlier or config_settings.of("health.outlier")  # health.outlier's settings
        self.ewma_alpha = ewma_alpha
        self.active_checks = False  # proxy.upstream.health turns this on when its loop runs
        # Set by proxy.upstream.health: when its next round starts (monotonic), how far apart rounds
        # are, and the passes that bring a worker back; Retry-After is computed from them.
        self.next_check_at = 0.0
        self.check_interval_s = 0.0
        self.healthy_threshold = 1
        self.failovers: Counter[tuple[str, str]] = Counter()  # (from worker, reason) -> count
        # proxy.upstream.affinity's ring cache and hit / miss counters, made by proxy.upstream.affinity.state() on
        # first use: this module sits below routing and affinity and imports neither.
        self.affinity_state: Any = None
        # (url, models, max_model_len) of the built-in simulator once it runs (proxy.app): what a
        # reloaded worker's `url: embedded` means.
        self.embedded: tuple[str, tuple[str, ...], int] | None = None
        self._rotation = 0
        self.routing_epoch = RoutingEpoch()
        for worker in self.workers:
            worker.__dict__.setdefault("_routing_epochs", []).append(self.routing_epoch)
        self._epoch = -1  # the epoch _routes and _ejected were built at
        self._routes: dict[str, Route] = {}
        self._ejected: list[Worker] = []

    def reconfigure(self, workers: Iterable[Worker]) -> tuple[list[str], list[str]]:
        """A reload's workers (proxy/runtime/reload.py): a worker whose entry did not change is
        kept as it is (its health, in flight, time to first byte); a new or changed one joins
        as a new worker does at start (with active checks, down until its first check passes);
        one no longer listed leaves the list, while the requests on it finish (they hold it).
        The list is replaced in one assignment. Returns (the names added or changed, removed)."""
        old = {w.name: w for w in self.workers}
        kept: list[Worker] = []
        added: list[str] = []
        for worker in workers:
            same = old.get(worker.name)
            if same is not None and _entry_of(same) == _entry_of(worker):
                kept.append(same)
                continue
            worker.__dict__.setdefault("_routing_epochs", []).append(self.routing_epoch)
            if self.active_checks:
                worker.healthy = False
                worker.awaiting_first_check = True
            kept.append(worker)
            added.append(worker.name)
        removed = [name for name in old if name not in {w.name for w in kept}]
        self.workers = kept
        self.routing_epoch.value += 1  # every cached route is rebuilt on the next request
        return added, removed

    def serving(self, model: str) -> list[Worker]:
        return [w for w in self.workers if w.serves(model)]

    def serves(self, model: str) -> bool:
        """Some worker serves `model` under exactly this name (proxy.protocol.models.resolve_model asks)."""
        return bool(self.route(model).serving)

    def _refresh(self) -> None:
        """A worker's routing fields changed: drop the routes, list the ejected workers again."""
        self._epoch = self.routing_epoch.value
        self._routes = {}
        self._ejected = [w for w in self.workers if w.ejected]

    def route(self, model: str) -> Route:
        """The model's cached Route, rebuilt after any change to a worker's routing fields."""
        if self._epoch != self.routing_epoch.value:
            self._refresh()
        route = self._routes.get(model)
        if route is None:
            route = Route(self.serving(model))
            if route.serving:  # only served models: made-up names from clients must not grow the cache
                self._routes[model] = route
        return route

    def models(self) -> dict[str, int | None]:
        """Every served model with its context window where a worker told us (the smallest, if they differ)."""
        found: dict[str, int | None] = {}
        for worker in self.workers:
            for model in worker.models:
                window = worker.max_model_len.get(model)
                known = found.get(model)
                found[model] = window if known is None else (known if window is None else min(known, window))
        return found

    def next_rotation(self) -> int:
        """A moving start index, so equally good workers take turns."""
        self._rotation += 1
        return self._rotation

    def readmit_due(self) -> None:
        """Before a choice (proxy.upstream.routing.choose): re-admit ejected workers whose time is over."""
        if self._ejected or self._epoch != self.routing_epoch.value:  # else nothing is ejected: nothing to re-admit
            self.readmit_expired()

    # ---------------------------------------------------------------- passive health

    def record_success(self, worker: Worker, ttfb_s: float | None = None) -> None:
        worker.consecutive_failures = 0
        if ttfb_s is not None:
            worker.ewma_ttfb = ttfb_s if worker.ewma_ttfb is None else (
                self.ewma_alpha * ttfb_s + (1 - self.ewma_alpha) * worker.ewma_ttfb)
        if worker.ejection_multiplier and time.monotonic() - worker.last_ejected_at > self.outlier.max_ejection_s * 2:
            worker.ejection_multiplier = 0  # long well-behaved: the next ejection starts short again

    def _ejection_bound(self, worker: Worker) -> str | None:
        """Why ejecting `worker` now would go past the bound (None: it may be ejected)."""
        percent = self.outlier.max_ejection_percent
        for model in worker.models:
            serving = self.route(model).serving
            ejected = sum(1 for w in serving if w.ejected) + 1
            if ejected * 100 > percent * len(serving):
                return f"max_ejection_percent={percent:g} ({model}: {ejected} of {len(serving)} workers)"
            if percent < 100 and not any(w.available for w in serving if w is not worker):
                return f"the last available worker of {model}"
        return None

    def record_failure(self, worker: Worker, reason: str) -> bool:
        """A connection failure, a 5xx or a first-byte timeout. True when it ejected the worker."""
        worker.consecutive_failures += 1
        if worker.ejected or worker.consecutive_failures < self.outlier.consecutive_failures:
            return False
        bound = self._ejection_bound(worker)
        if bound is not None:
            if worker.consecutive_failures == self.outlier.consecutive_failures:  # once per streak
                log.warning("worker not ejected", worker=worker.name, reason=reason, bound=bound,
                            failures=worker.consecutive_failures)
            return False
        now = time.monotonic()
        worker.ejection_multiplier += 1
        worker.ejected = True
        worker.ejected_until = now + ejection_time(self.outlier, worker.ejection_multiplier)
        worker.last_ejected_at = now
        worker.ejections_total += 1
        log.warning("worker ejected", worker=worker.name, reason=reason,
                    failures=worker.consecutive_failures,
                    seconds=round(worker.ejected_until - now, 3), ejections=worker.ejections_total)
        return True

    def readmit(self, worker: Worker) -> bool:
        """An active check passed: an ejected worker whose ejection time is over comes back."""
        if worker.ejected and time.monotonic() >= worker.ejected_until:
            worker.ejected = False
            worker.consecutive_failures = 0
            log.info("worker re-admitted", worker=worker.name)
            return True
        return False

    def readmit_expired(self) -> None:
        # Without active checks nothing would ever re-admit; then the ejection time alone does.
        if self.active_checks:
            return
        if self._epoch != self.routing_epoch.value:
            self._refresh()
        for worker in self._ejected:  # every ejection moves the epoch: this list is current
            self.readmit(worker)

    # ---------------------------------------------------------------- Retry-After

    def _next_check_at(self, after: float) -> float:
        """The start of the first active-check round at or after `after` (monotonic)."""
        first, interval = self.next_check_at, self.check_interval_s
        if first >= after or interval <= 0:
            return max(first, after)
        return first + math.ceil((after - first) / interval) * interval

    def back_in(self, worker: Worker, now: float) -> float | None:
        """Seconds until `worker` could take traffic again; None: nothing scheduled would bring it back."""
        at = now
        if worker.ejected:
            at = max(at, worker.ejected_until)
        if worker.available:
            return 0.0
        if not self.active_checks:
            # No checks: the ejection time alone re-admits; discovery is still retried every round.
            if not worker.models_known or worker.dialect == "detect":
                at = self._next_check_at(at)
            return at - now if worker.healthy else None
        at = self._next_check_at(at)
        if not worker.healthy and not worker.awaiting_first_check:
            needed = max(self.healthy_threshold - worker.check_successes, 1)
            at += (needed - 1) * self.check_interval_s
        return at - now

    def retry_after(self, workers: Iterable[Worker]) -> str:
        """Retry-After (whole seconds, at least 1): until the earliest of `workers` can return."""
        now = time.monotonic()
        times = [t for t in (self.back_in(w, now) for w in workers) if t is not None]
        return str(max(1, math.ceil(min(times)))) if times else "1"

    def note_failover(self, worker: Worker, reason: str) -> None:
        self.failovers[(worker.name, reason)] += 1
