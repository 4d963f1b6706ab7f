"""GET /metrics: Prometheus text, one registry per app, counters that move with traffic."""

from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace
from typing import Any

import aiohttp
import prometheus_client.metrics
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy import state
from proxy.app import outcome_of
from proxy.config.load import Config
from proxy.runtime import metrics as proxy_metrics
from proxy.runtime.metrics import METRICS
from proxy.state import POOL
from proxy.protocol.answer_report import AnswerReport, Tokens
from proxy.upstream.workers import WorkerPool, parse_workers
from tests.upstream.test_workers import NO_AUTH, ask, call, dead_url, settings, start_sim, wait_for, worker  # noqa: F401
from tests.support.paths import FIXTURES


async def scrape(proxy) -> tuple[str, dict[tuple[str, tuple], float]]:
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.url + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = await resp.text()
    return _parse(text)


def _parse(text: str) -> tuple[str, dict[tuple[str, tuple], float]]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


NAMES = [
    "responses_proxy_requests_total", "responses_proxy_request_duration_seconds",
    "responses_proxy_time_to_first_byte_seconds", "responses_proxy_input_tokens_total",
    "responses_proxy_output_tokens_total", "responses_proxy_worker_in_flight", "responses_proxy_worker_healthy",
    "responses_proxy_worker_ejections_total", "responses_proxy_failovers_total",
]


async def test_names_present_and_counters_move(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    text, before = await scrape(proxy)
    for name in ("responses_proxy_worker_in_flight", "responses_proxy_worker_healthy",
                 "responses_proxy_worker_ejections_total", "responses_proxy_worker_capacity"):
        assert name in text
    sim.script({"text": "Hello there, friend."}, {"text": "Again."})
    status, _, body = await call(proxy, ask())
    assert status == 200
    status, _, events = await call(proxy, ask(stream=True))
    assert status == 200
    text, after = await scrape(proxy)
    for name in NAMES[:5]:
        assert name in text, name
    assert value(after, "responses_proxy_requests_total", endpoint="responses", model="tiny-org/tiny-model", status="200",
                 outcome="completed") == 2
    assert value(after, "responses_proxy_input_tokens_total", model="tiny-org/tiny-model") == (
        body["usage"]["input_tokens"] + events[-1]["response"]["usage"]["input_tokens"])
    assert value(after, "responses_proxy_output_tokens_total", model="tiny-org/tiny-model") == (
        body["usage"]["output_tokens"] + events[-1]["response"]["usage"]["output_tokens"])
    assert value(after, "responses_proxy_time_to_first_byte_seconds_count", model="tiny-org/tiny-model", worker="sim") == 2
    assert value(after, "responses_proxy_request_duration_seconds_count", endpoint="responses",
                 model="tiny-org/tiny-model") == 2
    assert value(after, "responses_proxy_worker_healthy", worker="sim") == 1
    assert value(after, "responses_proxy_worker_capacity", worker="sim") == 256


async def test_errors_are_counted_by_status_and_unknown_models_are_bounded(make_proxy):
    proxy = await make_proxy(NO_AUTH)
    for i in range(3):
        status, _, _ = await call(proxy, {"model": f"made-up-{i}", "input": "hi"})
        assert status == 404
    _, samples = await scrape(proxy)
    assert value(samples, "responses_proxy_requests_total", endpoint="responses", model="other", status="404",
                 outcome="error") == 3  # refused: never "pending"
    assert not any("made-up" in str(labels) for _, labels in samples)


async def test_input_tokens_count_nothing_toward_usage(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    status, _, body = await call(proxy, ask(), "/v1/responses/input_tokens")
    assert status == 200 and body["input_tokens"] > 0
    _, samples = await scrape(proxy)
    assert value(samples, "responses_proxy_requests_total", endpoint="input_tokens", model="tiny-org/tiny-model",
                 status="200", outcome="completed") == 1
    assert total(samples, "responses_proxy_input_tokens_total") == 0


async def test_in_flight_gauge_during_a_stream(sim, make_proxy):
    proxy = await make_proxy(NO_AUTH)
    sim.script({"text": "slow", "first_byte_delay": 1.0})
    busy = asyncio.create_task(call(proxy, ask(stream=True)))
    await wait_for(lambda: sim.in_flight == 1)
    _, samples = await scrape(proxy)
    assert value(samples, "responses_proxy_worker_in_flight", worker="sim") == 1
    assert (await busy)[0] == 200
    _, samples = await scrape(proxy)
    assert value(samples, "responses_proxy_worker_in_flight", worker="sim") == 0


async def test_failovers_and_ejections_and_health(start_sim, make_proxy):
    live = await start_sim()
    proxy = await make_proxy({**NO_AUTH, "health": {"enabled": False, "outlier": {"consecutive_failures": 2}}},
                             workers=[worker("dead", dead_url()), worker("live", live.url)])
    for _ in range(2):
        assert (await call(proxy, ask({"order": ["dead"]})))[0] == 200
    _, samples = await scrape(proxy)
    assert total(samples, "responses_proxy_failovers_total", worker="dead") == 2
    assert value(samples, "responses_proxy_worker_ejections_total", worker="dead") == 1
    assert value(samples, "responses_proxy_worker_ejected", worker="dead") == 1
    assert value(samples, "responses_proxy_worker_healthy", worker="dead") == 0
    assert value(samples, "responses_proxy_worker_healthy", worker="live") == 1


async def test_health_gauge_follows_active_checks(make_proxy):
    proxy = await make_proxy(settings(interval_s=0.05, unhealthy_threshold=1), workers=[worker("x", dead_url())])
    await wait_for(lambda: not proxy.app[POOL].workers[0].healthy)
    _, samples = await scrape(proxy)
    assert value(samples, "responses_proxy_worker_healthy", worker="x") == 0


async def test_ledger_holds_gauge_with_a_ledger(sim, make_proxy):
    proxy = await make_proxy()  # the default policies: auth + balance over the SQLite ledger
    text, samples = await scrape(proxy)
    assert "responses_proxy_ledger_holds" in text
    assert value(samples, "responses_proxy_ledger_holds") == 0


async def test_each_app_has_its_own_registry(sim, make_proxy):
    one = await make_proxy(NO_AUTH)
    two = await make_proxy(NO_AUTH)
    assert one.app[METRICS].registry is not two.app[METRICS].registry
    assert (await call(one, ask()))[0] == 200
    _, first = await scrape(one)
    _, second = await scrape(two)
    assert total(first, "responses_proxy_requests_total", endpoint="responses") == 1
    assert total(second, "responses_proxy_requests_total", endpoint="responses") == 0


async def test_metrics_can_be_turned_off(make_proxy):
    proxy = await make_proxy({**NO_AUTH, "metrics": {"enabled": False}})
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.url + "/metrics") as resp:
            assert resp.status == 404
    assert (await call(proxy, ask()))[0] == 200  # the hook copes with no metrics


# --------------------------------------------------------------------------- exposition bytes
# The exposition for a fixed sequence of requests, captured from the prometheus_client Counter /
# Histogram / Gauge implementation (before request metrics became plain Python behind a
# collector): names, HELP, TYPE, label sets and order, buckets and values must not move.
# Only the _created timestamps vary from run to run; they are masked.
EXPOSITION = FIXTURES / "metrics_exposition.txt"
_CREATED = re.compile(r"(?m)^(\w+_created(?:\{[^}]*\})?) (\S+)$")

# (path, upstream model or None for no translation, HTTP status, seconds, AnswerReport fields or None)
SEQUENCE = [
    ("/v1/responses", "tiny-model", 200, 0.031,
     {"status": "completed", "upstream": "a", "input_tokens": 120, "cached_tokens": 64, "output_tokens": 33,
      "ttfb_ms": 12.5}),
    ("/v1/responses", "tiny-model", 200, 1.0,  # on a bucket bound: le is inclusive
     {"status": "completed", "upstream": "b", "input_tokens": 50, "output_tokens": 7, "ttfb_ms": 250.0}),
    ("/v1/responses", "big", 200, 2000.0,  # past the last bound: +Inf only; cached > input for the worker
     {"status": "incomplete", "upstream": "a", "input_tokens": 10, "cached_tokens": 20, "output_tokens": 1,
      "ttfb_ms": 0.01}),
    ("/v1/responses", "tiny-model", 499, 0.05, {"status": "cancelled", "upstream": "a"}),
    ("/v1/responses", "made-up", 404, 0.001, {"status": "error"}),  # an unknown model is labelled "other"
    ("/v1/responses", "tiny-model", 502, 0.1,  # an upstream that is no worker: no per-worker tokens
     {"status": "failed", "upstream": "ghost", "input_tokens": 5, "ttfb_ms": 100.0}),
    ("/v1/responses/input_tokens", "tiny-model", 200, 0.002, {"status": "completed", "upstream": "a",
                                                              "input_tokens": 9}),
    ("/v1/models", None, 200, 0.0001, None),
    ("/healthz", None, 200, 0.5, None),
    ("/nope", None, 404, 10.0, None),
    ("/v1/responses", None, 400, 0.25, {"status": "error"}),
    ("/v1/responses", "tiny-model", 200, 0.031,  # a second request on an existing series
     {"status": "completed", "upstream": "a", "input_tokens": 1, "output_tokens": 2, "ttfb_ms": 12.5}),
]


def observed_context(path: str, model: str | None, fields: dict | None) -> state.RequestContext:
    """A finished request's context: its translation's model and the handler's report (`fields`)."""
    report = None
    if fields is not None:
        tokens = Tokens(fields.get("input_tokens", 0), fields.get("cached_tokens", 0),
                              fields.get("output_tokens", 0))
        report = AnswerReport(fields["status"], fields.get("upstream"), fields.get("ttfb_ms"), shown=tokens)
    return state.RequestContext("req_test", "POST", path,
                                translation=SimpleNamespace(upstream_model=model) if model is not None else None,
                                report=report)


def _observed_app(module) -> tuple[web.Application, Any]:
    """An app with `module`'s Metrics over two workers, after SEQUENCE went through module.observe()."""
    app = web.Application()
    app[module.METRICS] = found = module.Metrics(WorkerPool(parse_workers(Config.from_dict({"workers": [
        {"name": "a", "url": "http://a", "models": ["tiny-model", "big"]},
        {"name": "b", "url": "http://b", "models": ["tiny-model"], "capacity": 8}]}).workers)))
    for path, model, status, seconds, outcome in SEQUENCE:
        request = make_mocked_request("POST", path, app=app)
        ctx = observed_context(path, model, outcome)
        # the outcome as the envelope gives it (proxy.app): the report's, else error / completed by the status
        module.observe(request, ctx, status, seconds, ctx.report.status if ctx.report is not None else outcome_of(status))
    found.holds.set(3)
    return app, found


def _exposition(module) -> str:
    return generate_latest(_observed_app(module)[1].registry).decode()


def test_exposition_is_unchanged():
    before = time.time()
    text = _exposition(proxy_metrics)
    created = [float(m.group(2)) for m in _CREATED.finditer(text)]
    assert created and all(before - 1 <= c <= time.time() + 1 for c in created)
    assert _CREATED.sub(r"\1 <created>", text) == EXPOSITION.read_text()


def test_exposition_without_created_series(monkeypatch):
    monkeypatch.setattr(prometheus_client.metrics, "_use_created", False)  # disable_created_metrics(), undone
    expected = re.sub(r"(?m)^(# (HELP|TYPE) \w+_created .*|\w+_created(\{[^}]*\})? <created>)\n", "",
                      EXPOSITION.read_text())
    assert "_created" not in expected
    assert _exposition(proxy_metrics) == expected


def test_the_worker_ratio_follows_the_totals():
    _, found = _observed_app(proxy_metrics)
    _, samples = _parse(generate_latest(found.registry).decode())
    # worker a: prompt 120 + 10 + 1, cached 64 + min(20, 10) + 0
    assert value(samples, "responses_proxy_worker_cached_token_ratio", worker="a") == 74 / 131
    assert value(samples, "responses_proxy_worker_cached_token_ratio", worker="b") == 0


def test_a_negative_token_count_is_refused_as_before():
    app = web.Application()
    app[proxy_metrics.METRICS] = found = proxy_metrics.Metrics(WorkerPool(parse_workers(Config.from_dict({"workers": [
        {"name": "a", "url": "http://a", "models": ["tiny-model"]}]}).workers)))
    request = make_mocked_request("POST", "/v1/responses", app=app)
    ctx = observed_context("/v1/responses", "tiny-model", {"status": "completed", "input_tokens": -1})
    with pytest.raises(ValueError):
        found.observe(ctx, 200, 0.1, "completed")
    proxy_metrics.observe(request, ctx, 200, 0.1, "completed")  # the hook logs it and never raises
    _, samples = _parse(generate_latest(found.registry).decode())
    # As with prometheus_client's labels().inc(): the series is made, at 0, before the refusal.
    assert ("responses_proxy_input_tokens_total", (("model", "tiny-model"),)) in samples
    assert value(samples, "responses_proxy_input_tokens_total", model="tiny-model") == 0
    assert value(samples, "responses_proxy_requests_total", endpoint="responses", model="tiny-model", status="200",
                 outcome="completed") == 2
