"""schemathesis against the live proxy (the full default chain in front of the simulator),
driven by the proxy's own GET /openapi.json: no 5xx, and every answer matches the
description (documented status, content type, schema). Bounded: MAX_EXAMPLES per operation
and generation mode (positive and negative data)."""

from __future__ import annotations

import base64
import os

import orjson
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from proxy.http.openapi import openapi_document
from tests.support.live import LiveStack

MAX_EXAMPLES = 40

schema = schemathesis.openapi.from_dict(openapi_document())

CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    seal = {"reasoning_seal": {"keys": {"k1": base64.urlsafe_b64encode(os.urandom(32)).decode()}}}  # compact's
    with LiveStack(tmp_path_factory.mktemp("schemathesis"), seal) as stack:
        yield stack


def test_served_description_is_the_checked_one(live):
    served = requests.get(live.url + "/openapi.json", timeout=10)
    assert served.status_code == 200 and served.headers["Content-Type"].startswith("application/json")
    doc = served.json()
    assert doc == orjson.loads(orjson.dumps(openapi_document()))
    assert doc["openapi"].startswith("3.1")
    statuses = set(doc["paths"]["/v1/responses"]["post"]["responses"])
    assert {"200", "400", "401", "402", "404", "413", "429", "502", "503", "504"} <= statuses
    served_routes = {(r.method, r.resource.canonical) for r in live.app.router.routes() if r.method != "HEAD"}
    for path, ops in doc["paths"].items():
        for method in ops:
            if not method.startswith("x-"):  # x-openresponses-websocket: the spec's extension, not a method
                assert (method.upper(), path) in served_routes


def test_every_route_of_the_route_table_is_described(live):
    """The other way round: every route the app serves from its route table (proxy.http.routes),
    and every other route of the running app but /metrics (its path is config, metrics.path, and
    it is Prometheus text, not the API), is in /openapi.json with its method."""
    from proxy.http.routes import ROUTES

    described = {(method.upper(), path) for path, ops in openapi_document()["paths"].items()
                 for method in ops if not method.startswith("x-")}
    table = {(r.method, r.path) for r in ROUTES}
    assert table - described == set()
    served = {(r.method, r.resource.canonical) for r in live.app.router.routes()
              if r.method != "HEAD" and r.resource.canonical != "/metrics"}
    assert table <= served
    assert served - described == set()


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
def test_live_proxy_matches_its_description(case, live):
    case.call_and_validate(base_url=live.url, headers={"Authorization": f"Bearer {live.api_key}"},
                           checks=CHECKS, timeout=30)


def test_unauthenticated_calls_match_too(live):
    for method, path in (("POST", "/v1/responses"), ("POST", "/v1/responses/input_tokens"), ("GET", "/v1/models")):
        r = requests.request(method, live.url + path, json={"model": "tiny-org/tiny-model", "input": "x"}, timeout=10)
        assert r.status_code == 401
        documented = openapi_document()["paths"][path][method.lower()]["responses"]
        assert "401" in documented and set(r.json()["error"]) == {"message", "type", "param", "code"}
