"""Prometheus metrics: GET /metrics in the text exposition format.

Each app has its own CollectorRegistry (tests run many apps in one process). Request
metrics are updated in one place, `observe()`, called by the outermost middleware once a
request has finished (from its Outcome); worker gauges and the failover / ejection
counters are read from the WorkerPool at scrape time, so nothing else has to know
about Prometheus.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from proxy import affinity, state
from proxy.workers import WorkerPool

PREFIX = "responses_proxy"
_ENDPOINTS = {
    "/v1/responses": "responses",
    "/v1/responses/input_tokens": "input_tokens",
    "/v1/models": "models",
    "/healthz": "healthz",
    "/metrics": "metrics",
}
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
TTFB_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _PoolCollector:
    """Per-worker gauges and the pool's counters, read when scraped."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def describe(self):  # no describe-time collect
        return []

    def collect(self):
        labels = ["worker"]
        in_flight = GaugeMetricFamily(f"{PREFIX}_worker_in_flight", "Requests in flight on each worker.", labels=labels)
        capacity = GaugeMetricFamily(f"{PREFIX}_worker_capacity", "Configured concurrency capacity of each worker.",
                                     labels=labels)
        healthy = GaugeMetricFamily(f"{PREFIX}_worker_healthy",
                                    "1 when the worker takes requests (active checks pass, not ejected).",
                                    labels=labels)
        ejected = GaugeMetricFamily(f"{PREFIX}_worker_ejected", "1 while the worker is passively ejected.",
                                    labels=labels)
        ewma = GaugeMetricFamily(f"{PREFIX}_worker_ttfb_ewma_seconds",
                                 "Exponentially weighted time to first byte of each worker.", labels=labels)
        ejections = CounterMetricFamily(f"{PREFIX}_worker_ejections", "Passive ejections of each worker.",
                                        labels=labels)
        for w in self.pool.workers:
            in_flight.add_metric([w.name], w.in_flight)
            capacity.add_metric([w.name], w.capacity)
            healthy.add_metric([w.name], 1 if w.available else 0)
            ejected.add_metric([w.name], 1 if w.ejected else 0)
            if w.ewma_ttfb is not None:
                ewma.add_metric([w.name], w.ewma_ttfb)
            ejections.add_metric([w.name], w.ejections_total)
        failovers = CounterMetricFamily(f"{PREFIX}_failovers",
                                        "Requests moved to another worker before the first byte.",
                                        labels=["worker", "reason"])
        for (worker, reason), count in sorted(self.pool.failovers.items()):
            failovers.add_metric([worker, reason], count)
        # Prompt-cache affinity (proxy/affinity.py): hit = the key's primary ring owner took the
        # request; miss = load (bounded load or capacity moved it), ineligible (its owner is
        # unhealthy, ejected or excluded by the provider object) or failover.
        st = affinity.state(self.pool)
        routed = CounterMetricFamily(f"{PREFIX}_affinity_routing",
                                     "Requests routed by prompt-cache affinity, by hit or miss and why.",
                                     labels=["result", "reason"])
        for result, reason in (("hit", ""), ("miss", "load"), ("miss", "ineligible"), ("miss", "failover")):
            routed.add_metric([result, reason], st.outcomes.get((result, reason), 0))
        builds = CounterMetricFamily(f"{PREFIX}_affinity_ring_builds",
                                     "Consistent-hash rings built (one per eligible-set signature).")
        builds.add_metric([], st.ring_builds)
        yield from (in_flight, capacity, healthy, ejected, ewma, ejections, failovers, routed, builds)


class Metrics:
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests by endpoint, model, HTTP status and outcome.",
                                ["endpoint", "model", "status", "outcome"], registry=r)
        self.latency = Histogram(f"{PREFIX}_request_duration_seconds",
                                 "Whole request time (a stream until its last event).",
                                 ["endpoint", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram(f"{PREFIX}_time_to_first_byte_seconds",
                              "Upstream request sent -> first upstream byte.", ["model", "worker"],
                              buckets=TTFB_BUCKETS, registry=r)
        self.input_tokens = Counter(f"{PREFIX}_input_tokens", "Input tokens (cached included).", ["model"], registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_cached_input_tokens", "Input tokens read from the prompt cache.",
                                     ["model"], registry=r)
        self.output_tokens = Counter(f"{PREFIX}_output_tokens", "Output tokens (reasoning included).", ["model"],
                                     registry=r)
        # Per worker, for the prompt-cache hit ratio (what affinity is for): prompt tokens and
        # the part of them the worker reported as read from its prefix cache.
        self.worker_prompt_tokens = Counter(f"{PREFIX}_worker_prompt_tokens",
                                            "Prompt tokens of the requests each worker answered.", ["worker"],
                                            registry=r)
        self.worker_cached_tokens = Counter(f"{PREFIX}_worker_cached_tokens",
                                            "Prompt tokens each worker read from its prefix cache.", ["worker"],
                                            registry=r)
        self.worker_cached_ratio = Gauge(f"{PREFIX}_worker_cached_token_ratio",
                                         "Cached / prompt tokens of each worker since start.", ["worker"], registry=r)
        self._worker_tokens: dict[str, list[int]] = {}
        self._children: dict[tuple, Any] = {}  # (id(metric), label values) -> labelled child
        self.holds = Gauge(f"{PREFIX}_ledger_holds", "Balance holds not yet settled.", registry=r)
        self.holds_available = True
        r.register(_PoolCollector(pool))

    def model_label(self, request: web.Request) -> str:
        t = request.get(state.TRANSLATION)
        if t is None:
            return ""
        # Bounded: only models some worker serves become a label value.
        model = t.upstream_model
        return model if any(w.serves(model) for w in self.pool.workers) else "other"

    def _child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), cached: the label values are bounded (served models, statuses,
        outcomes, workers), and labels() takes a lock and builds a tuple every time."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe(self, request: web.Request, status: int, elapsed_s: float) -> None:
        endpoint = _ENDPOINTS.get(request.path, "other")
        model = self.model_label(request)
        out = request.get(state.OUTCOME)
        outcome = out.status if out is not None and endpoint == "responses" else ""
        child = self._child
        child(self.requests, endpoint, model, str(status), outcome).inc()
        child(self.latency, endpoint, model).observe(elapsed_s)
        if out is None or endpoint != "responses":
            return  # input_tokens counts nothing toward usage
        if out.ttfb_ms is not None:
            child(self.ttfb, model, out.upstream or "").observe(out.ttfb_ms / 1000)
        if out.input_tokens:
            child(self.input_tokens, model).inc(out.input_tokens)
        if out.cached_tokens:
            child(self.cached_tokens, model).inc(out.cached_tokens)
        if out.output_tokens:
            child(self.output_tokens, model).inc(out.output_tokens)
        if out.upstream and out.input_tokens and any(w.name == out.upstream for w in self.pool.workers):
            cached = min(out.cached_tokens, out.input_tokens)
            child(self.worker_prompt_tokens, out.upstream).inc(out.input_tokens)
            child(self.worker_cached_tokens, out.upstream).inc(cached)
            totals = self._worker_tokens.setdefault(out.upstream, [0, 0])
            totals[0] += out.input_tokens
            totals[1] += cached
            child(self.worker_cached_ratio, out.upstream).set(totals[1] / totals[0])

    async def refresh_ledger(self, app: web.Application) -> None:
        from proxy.app import LEDGER

        ledger = app.get(LEDGER)
        counter = getattr(ledger, "count_holds", None) or getattr(ledger, "holds", None)
        if ledger is None or counter is None:
            return
        try:
            found = await counter()
        except Exception:  # a scrape never fails because the ledger is busy
            return
        self.holds.set(found if isinstance(found, int) else len(found))


METRICS = web.AppKey("metrics", Metrics)


def observe(request: web.Request, status: int, elapsed_s: float) -> None:
    """The one hook: called by the outermost middleware when a request is done. Never raises."""
    metrics = request.app.get(METRICS)
    if metrics is None:
        return
    try:
        metrics.observe(request, status, elapsed_s)
    except Exception:  # metrics must never break a request
        from proxy.logs import log

        log.exception("metrics update failed")


async def metrics_handler(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    await metrics.refresh_ledger(request.app)
    body = generate_latest(metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def install(app: web.Application, pool: WorkerPool, section: dict[str, Any]) -> None:
    if section.get("enabled", True) is False:
        return
    app[METRICS] = Metrics(pool)
    app.router.add_get(str(section.get("path", "/metrics")), metrics_handler)

