"""Prometheus metrics: GET /metrics in the text exposition format.

Each app has its own CollectorRegistry (tests run many apps in one process). Request
metrics are updated in one place, `observe()`, called by the outermost middleware once a
request has finished (from its AnswerReport and Bill); they are kept in plain dicts and lists (no
prometheus_client lock per update) and turned into metric families by _RequestCollector
when scraped. Worker gauges and the failover / ejection counters are read from the
WorkerPool at scrape time, so nothing else has to know about Prometheus.

With `--workers N` (or whenever PROMETHEUS_MULTIPROC_DIR names a directory) the figures
are shared the way prometheus_client's multiprocess mode shares them: each process also
writes its request metrics into its own mmap'd files in that directory as it counts them,
and its worker-pool figures every POOL_PUBLISH_S seconds and at each scrape; /metrics, in
whichever process answers, merges every process's files (MultiProcessCollector). Counters
and histograms are summed over all processes, dead ones included; the per-worker gauges
are those of the live processes: in-flight summed, capacity and ejected the maximum,
healthy the minimum (healthy only when every process finds it so), the TTFB average the
maximum. As in prometheus_client's multiprocess mode there are no _created series, and the
ledger's holds gauge is read from the (shared) ledger by the process scraped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from bisect import bisect_left
from collections.abc import Callable
from functools import partial
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest, metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from proxy import state
from proxy.logs import log
from proxy.protocol.answer_report import NO_TOKENS
from proxy.runtime.key_metrics import KEY_METRICS, KeyMetrics
from proxy.state import LEDGER, RequestContext
from proxy.upstream import affinity
from proxy.upstream.workers import WorkerPool

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Metrics as MetricsSettings

PREFIX = "responses_proxy"
# The endpoints whose requests generate (and count toward the token totals).
_BILLED = frozenset({"responses", "chat_completions", "completions", "embeddings", "messages"})
_ENDPOINTS = {
    "/v1/responses": "responses",
    "/v1/responses/input_tokens": "input_tokens",
    "/v1/models": "models",
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "messages_count_tokens",
    "/healthz": "healthz",
    "/livez": "livez",
    "/readyz": "readyz",
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
        # Prompt-cache affinity (proxy/upstream/affinity.py): hit = the key's primary ring owner took the
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


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
POOL_PUBLISH_S = 1.0


def multiprocess_dir() -> str | None:
    """The directory shared by the serving processes, or None: one process, its own figures."""
    path = os.environ.get(MULTIPROC_ENV)
    return path if path and os.path.isdir(path) else None


class _Shared:
    """This process's mmap'd files in prometheus_client's multiprocess format (one file per
    type, named by pid, read by MultiProcessCollector). Written directly, not through
    prometheus_client's value objects: the totals are kept in memory here already (one
    asyncio thread, no lock needed), so an update is one packed write."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pid = os.getpid()  # fixed: Metrics is built in the serving process, after any fork
        self.files: dict[str, Any] = {}
        self.slots: dict[tuple, tuple[Any, str]] = {}

    def slot(self, typ: str, metric: str, sample: str, labelnames: tuple[str, ...], labelvalues: tuple[str, ...],
             help: str, mode: str = "") -> tuple[Any, str]:
        """(file, key) of one sample of one series, made on first use."""
        found = self.slots.get((sample, labelvalues, mode))
        if found is None:
            from prometheus_client.mmap_dict import MmapedDict, mmap_key

            prefix = f"{typ}_{mode}" if typ == "gauge" else typ
            file = self.files.get(prefix)
            if file is None:
                file = self.files[prefix] = MmapedDict(os.path.join(self.path, f"{prefix}_{self.pid}.db"))
            found = self.slots[(sample, labelvalues, mode)] = (file, mmap_key(
                metric, sample, labelnames, labelvalues, help))  # type: ignore[arg-type]  # it zips them: tuples do
        return found

    def write(self, slot: tuple[Any, str], value: float) -> None:
        slot[0].write_value(slot[1], value, 0.0)


class _Counter:
    """A labelled counter as a plain dict (label values -> total), exposed by _RequestCollector.

    prometheus_client's Counter takes a lock per inc() and its labels() another; each serving
    process runs its requests on one asyncio thread (the ledger's writer thread never touches
    metrics, and a scrape reads them on that same thread), so plain updates are safe.
    """

    __slots__ = ("name", "help", "labels", "values", "created")

    def __init__(self, name: str, help: str, labels: tuple[str, ...]) -> None:
        self.name, self.help, self.labels = name, help, labels
        self.values: dict[tuple[str, ...], float] = {}  # insertion order = exposition order
        self.created: dict[tuple[str, ...], float] = {}  # the series' _created timestamp

    def inc(self, key: tuple[str, ...], amount: float = 1) -> None:
        values = self.values
        value = values.get(key)
        if value is None:  # a new series, at 0 from here on (as labels() makes it), even if refused below
            self.created[key] = time.time()
            value = values[key] = 0.0
        if amount < 0:  # refused, as prometheus_client's Counter.inc() refuses it
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        values[key] = value + amount

    def family(self, with_created: bool) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.help, labels=self.labels)
        created = self.created
        for key, value in self.values.items():
            family.add_metric(key, value, created[key] if with_created else None)
        return family


class _Histogram:
    """A labelled histogram with fixed buckets: per series a list of per-bucket counts (the last
    one +Inf) followed by the sum, updated with one bisect; made cumulative only when scraped."""

    __slots__ = ("name", "help", "labels", "bounds", "les", "series", "created")

    def __init__(self, name: str, help: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.labels = name, help, labels
        self.bounds = tuple(float(b) for b in buckets)  # finite, sorted: an index past them is +Inf
        self.les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self.series: dict[tuple[str, ...], list[float]] = {}
        self.created: dict[tuple[str, ...], float] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        counts = self.series.get(key)
        if counts is None:
            self.created[key] = time.time()
            counts = self.series[key] = [0] * (len(self.bounds) + 1) + [0.0]
        # bisect_left: the first bucket whose upper bound is >= value (le is inclusive).
        counts[bisect_left(self.bounds, value)] += 1
        counts[-1] += value

    def family(self, with_created: bool) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.help, labels=self.labels)
        for key, counts in self.series.items():
            family.add_metric(key, list(zip(self.les, accumulate(counts[:-1]))), counts[-1])
            if with_created:
                family.add_sample(self.name + "_created", dict(zip(self.labels, key)), self.created[key])
        return family


class _SharedCounter(_Counter):
    """A _Counter whose totals are also written to the shared files (multiprocess mode)."""

    __slots__ = ("shared", "sample")

    def __init__(self, shared: _Shared, name: str, help: str, labels: tuple[str, ...]) -> None:
        super().__init__(name, help, labels)
        self.shared, self.sample = shared, name + "_total"

    def inc(self, key: tuple[str, ...], amount: float = 1) -> None:
        super().inc(key, amount)
        shared = self.shared
        shared.write(shared.slot("counter", self.name, self.sample, self.labels, key, self.help), self.values[key])


class _SharedHistogram(_Histogram):
    """A _Histogram whose counts are also written to the shared files (per-bucket counts and
    the sum, as prometheus_client's Histogram writes them)."""

    __slots__ = ("shared", "bucket_labels")

    def __init__(self, shared: _Shared, name: str, help: str, labels: tuple[str, ...],
                 buckets: tuple[float, ...]) -> None:
        super().__init__(name, help, labels, buckets)
        self.shared, self.bucket_labels = shared, labels + ("le",)

    def observe(self, key: tuple[str, ...], value: float) -> None:
        shared, name = self.shared, self.name
        if key not in self.series:  # every bucket exists from the first observation, as in prometheus_client
            for le in self.les:
                shared.write(shared.slot("histogram", name, name + "_bucket", self.bucket_labels, key + (le,),
                                         self.help), 0.0)
        super().observe(key, value)
        counts = self.series[key]
        index = bisect_left(self.bounds, value)
        shared.write(shared.slot("histogram", name, name + "_bucket", self.bucket_labels, key + (self.les[index],),
                                 self.help), counts[index])
        shared.write(shared.slot("histogram", name, name + "_sum", self.labels, key, self.help), counts[-1])


class _Holds:
    """The ledger's unsettled holds, set once per scrape (refresh_ledger)."""

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def describe(self):
        return []

    def collect(self):
        family = GaugeMetricFamily(f"{PREFIX}_ledger_holds", "Balance holds not yet settled.")
        family.add_metric([], self.value)
        yield family


# Per-worker gauges in multiprocess mode: how the live processes' values combine.
_POOL_GAUGE_MODES = {
    f"{PREFIX}_worker_in_flight": "livesum",
    f"{PREFIX}_worker_capacity": "livemax",
    f"{PREFIX}_worker_healthy": "livemin",
    f"{PREFIX}_worker_ejected": "livemax",
    f"{PREFIX}_worker_ttfb_ewma_seconds": "livemax",
}


def _publish(shared: _Shared, families) -> None:
    """Write this process's current figures of `families` into its shared files."""
    for family in families:
        if family.type not in ("gauge", "counter"):
            continue
        typ = family.type
        mode = _POOL_GAUGE_MODES.get(family.name, "livesum") if typ == "gauge" else ""
        for sample in family.samples:
            if typ == "counter" and not sample.name.endswith("_total"):
                continue  # _created: not kept in multiprocess mode
            labelnames = tuple(sample.labels)
            shared.write(shared.slot(typ, family.name, sample.name, labelnames,
                                     tuple(sample.labels[n] for n in labelnames), family.documentation, mode),
                         sample.value)


def _sample_order(sample: Any) -> tuple:
    labels = sorted((k, v) for k, v in sample.labels.items() if k != "le")
    le = sample.labels.get("le")
    return labels, sample.name.endswith(("_count", "_sum")), sample.name, float(le) if le is not None else 0.0


class _MergedCollector:
    """Multiprocess mode: every process's files merged, the cached-token ratio computed from
    the merged counters, this process's holds gauge; in a stable order."""

    def __init__(self, metrics: Metrics, path: str) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self.metrics = metrics
        self.files = MultiProcessCollector(None, path)

    def describe(self):
        return []

    def collect(self):
        merged = {family.name: family for family in self.files.collect()}
        for family in merged.values():  # files are read in no set order: series by labels, buckets by bound
            family.samples.sort(key=_sample_order)
        prompt = merged.get(f"{PREFIX}_worker_prompt_tokens")
        cached = merged.get(f"{PREFIX}_worker_cached_tokens")
        ratio = GaugeMetricFamily(f"{PREFIX}_worker_cached_token_ratio",
                                  "Cached / prompt tokens of each worker since start.", labels=["worker"])
        if prompt is not None:
            cached_by = {s.labels.get("worker"): s.value for s in (cached.samples if cached else [])}
            for sample in prompt.samples:
                if sample.value > 0:
                    worker = sample.labels.get("worker", "")
                    ratio.add_metric([worker], cached_by.get(worker, 0.0) / sample.value)
        merged[ratio.name] = ratio
        yield from (merged[name] for name in sorted(merged))
        yield from self.metrics.holds.collect()


class _RequestCollector:
    """Exposes the request metrics kept in plain Python by Metrics, when scraped."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):  # no describe-time collect
        return []

    def collect(self):
        m = self.metrics
        # Read per scrape, so prometheus_client.disable_created_metrics() and
        # PROMETHEUS_DISABLE_CREATED_SERIES keep working as they do for its own metrics.
        with_created = getattr(prometheus_metrics, "_use_created", True)
        yield m.requests.family(with_created)
        yield m.latency.family(with_created)
        yield m.ttfb.family(with_created)
        yield m.input_tokens.family(with_created)
        yield m.cached_tokens.family(with_created)
        yield m.output_tokens.family(with_created)
        yield m.worker_prompt_tokens.family(with_created)
        yield m.worker_cached_tokens.family(with_created)
        ratio = GaugeMetricFamily(f"{PREFIX}_worker_cached_token_ratio",
                                  "Cached / prompt tokens of each worker since start.", labels=["worker"])
        cached = m.worker_cached_tokens.values
        for key, prompt in m.worker_prompt_tokens.values.items():  # both counted together, prompt > 0
            ratio.add_metric(list(key), cached[key] / prompt)
        yield ratio
        if m.usage_corrections.values:  # labelled by reason: no series before the first one
            yield m.usage_corrections.family(with_created)
        if m.limits_redis.values:
            yield m.limits_redis.family(with_created)


class Metrics:
    def __init__(self, pool: WorkerPool, shared_dir: str | None = None) -> None:
        """shared_dir: multiprocess_dir(), the directory PROMETHEUS_MULTIPROC_DIR names (where
        prometheus_client writes), or None for this process's figures only."""
        self.pool = pool
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.shared_dir = shared_dir
        self.shared = shared = _Shared(shared_dir) if shared_dir else None
        counter: Callable[..., _Counter] = partial(_SharedCounter, shared) if shared else _Counter
        histogram: Callable[..., _Histogram] = partial(_SharedHistogram, shared) if shared else _Histogram
        self.requests = counter(f"{PREFIX}_requests", "Requests by endpoint, model, HTTP status and outcome.",
                                ("endpoint", "model", "status", "outcome"))
        self.latency = histogram(f"{PREFIX}_request_duration_seconds",
                                 "Whole request time (a stream until its last event).",
                                 ("endpoint", "model"), LATENCY_BUCKETS)
        self.ttfb = histogram(f"{PREFIX}_time_to_first_byte_seconds",
                              "Upstream request sent -> first upstream byte.", ("model", "worker"), TTFB_BUCKETS)
        self.input_tokens = counter(f"{PREFIX}_input_tokens", "Input tokens (cached included).", ("model",))
        self.cached_tokens = counter(f"{PREFIX}_cached_input_tokens", "Input tokens read from the prompt cache.",
                                     ("model",))
        self.output_tokens = counter(f"{PREFIX}_output_tokens", "Output tokens (reasoning included).", ("model",))
        # Per worker, for the prompt-cache hit ratio (what affinity is for): prompt tokens and
        # the part of them the worker reported as read from its prefix cache.
        self.worker_prompt_tokens = counter(f"{PREFIX}_worker_prompt_tokens",
                                            "Prompt tokens of the requests each worker answered.", ("worker",))
        self.worker_cached_tokens = counter(f"{PREFIX}_worker_cached_tokens",
                                            "Prompt tokens each worker read from its prefix cache.", ("worker",))
        # Each value of an upstream's usage report the ledger did not believe (proxy.ledger.usage).
        self.usage_corrections = counter(f"{PREFIX}_usage_corrections",
                                         "Upstream usage values replaced before billing, by reason.", ("reason",))
        # The Redis limits backend (proxy/limits/redis_backend.py): failed calls, recoveries.
        self.limits_redis = counter(f"{PREFIX}_limits_redis_events",
                                    "Redis limits backend: calls that failed (error), outages ended (recovered).",
                                    ("event",))
        self.holds = _Holds()
        self.holds_available = True
        self.pool_collector = _PoolCollector(pool)
        if shared_dir is None:
            r.register(_RequestCollector(self))
            r.register(self.holds)
            r.register(self.pool_collector)
        else:
            r.register(_MergedCollector(self, shared_dir))

    def publish_pool(self) -> None:
        """Multiprocess mode: this process's worker-pool figures into its shared files."""
        if self.shared is not None:
            _publish(self.shared, self.pool_collector.collect())

    def model_label(self, ctx: RequestContext) -> str:
        t = ctx.translation
        if t is None:
            return ""
        # Bounded: only models some worker serves become a label value. Asked per request (a
        # worker's models can change at run time); a plain loop, not any() over a generator,
        # which costs several times more for a handful of workers.
        model = t.upstream_model
        for w in self.pool.workers:
            if w.serves(model):
                return model
        return "other"

    def observe(self, ctx: RequestContext, status: int, elapsed_s: float, ended: str | None = None) -> None:
        endpoint = _ENDPOINTS.get(ctx.path, "other")
        model = self.model_label(ctx)
        billed = endpoint in _BILLED
        self.requests.inc((endpoint, model, str(status), ended or ""))
        self.latency.observe((endpoint, model), elapsed_s)
        report = ctx.report
        if report is None or not billed:
            return  # input_tokens counts nothing toward usage
        if report.ttfb_ms is not None:
            self.ttfb.observe((model, report.upstream or ""), report.ttfb_ms / 1000)
        tokens = ctx.tokens() or NO_TOKENS
        by_model = (model,)
        if tokens.input:
            self.input_tokens.inc(by_model, tokens.input)
        if tokens.cached:
            self.cached_tokens.inc(by_model, tokens.cached)
        if tokens.output:
            self.output_tokens.inc(by_model, tokens.output)
        upstream = report.upstream
        if upstream and tokens.input and self._is_worker(upstream):
            cached = min(tokens.cached, tokens.input)
            by_worker = (upstream,)
            self.worker_prompt_tokens.inc(by_worker, tokens.input)
            self.worker_cached_tokens.inc(by_worker, cached)

    def _is_worker(self, name: str) -> bool:
        # Worker names never change: one already counted needs no walk over the pool.
        if (name,) in self.worker_prompt_tokens.values:
            return True
        for w in self.pool.workers:
            if w.name == name:
                return True
        return False

    async def refresh_ledger(self, app: web.Application) -> None:
        ledger = app.get(LEDGER)
        counter = getattr(ledger, "count_holds", None) or getattr(ledger, "holds", None)
        if ledger is None or counter is None:
            return
        try:
            found = await counter()
        except Exception:  # a scrape never fails because the ledger is busy
            return
        self.holds.set(found if isinstance(found, int) else len(found))


def observe(request: web.Request, ctx: RequestContext, status: int, elapsed_s: float, ended: str | None) -> None:
    """The one hook: called by the envelope when a request is done (`ended`: its outcome, how
    its answer ended or "error" / "completed" for one no answer reported on). Never raises."""
    metrics = request.app.get(METRICS)
    if metrics is None:
        return
    try:
        metrics.observe(ctx, status, elapsed_s, ended)
    except Exception:  # metrics must never break a request
        log.exception("metrics update failed")


async def metrics_handler(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    await metrics.refresh_ledger(request.app)
    keys = request.app.get(KEY_METRICS)
    if keys is not None:
        await keys.refresh(request.app.get(state.LEDGER))
    metrics.publish_pool()
    body = generate_latest(metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def install(app: web.Application, pool: WorkerPool, section: MetricsSettings) -> None:
    """config.yaml `metrics` (config.metrics)."""
    if not section.enabled:
        return
    app[METRICS] = found = Metrics(pool, multiprocess_dir())
    app.router.add_get(section.path, metrics_handler)
    if section.key_ids or section.top_keys:
        app[KEY_METRICS] = keys = KeyMetrics(list(section.key_ids), section.top_keys, section.key_refresh_s)
        found.registry.register(keys)
    if found.shared is not None:
        app.cleanup_ctx.append(_pool_publisher(found))


def _pool_publisher(metrics: Metrics) -> Callable[[web.Application], Any]:
    async def publisher(_app: web.Application):
        async def loop() -> None:
            while True:
                try:
                    metrics.publish_pool()
                except Exception:  # metrics must never stop the process
                    log.exception("metrics: publishing the worker figures failed")
                await asyncio.sleep(POOL_PUBLISH_S)

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return publisher


METRICS = web.AppKey("metrics", Metrics)  # proxy.runtime.metrics
