"""schemathesis against the live admin API (proxy/admin), driven by its own
<prefix>/openapi.json: no 5xx, and every answer matches the description (documented
status, content type, schema), with an admin key. Bounded like tests/http/test_schemathesis.py."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from proxy.admin.admin_openapi import openapi_document
from tests.support.live import LiveStack

MAX_EXAMPLES = 25
ADMIN_KEY = "adm-schemathesis-0123456789"

schema = schemathesis.openapi.from_dict(openapi_document("/admin"))

CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    overrides = {"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY}]}}
    with LiveStack(tmp_path_factory.mktemp("admin-schemathesis"), overrides) as stack:
        yield stack


def test_served_admin_description_is_the_checked_one(live):
    served = requests.get(live.url + "/admin/openapi.json", timeout=10)
    assert served.status_code == 200 and served.json() == requests.get(
        live.url + "/admin/openapi.json", timeout=10).json()
    assert served.json()["paths"].keys() == openapi_document()["paths"].keys()


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
def test_live_admin_api_matches_its_description(case, live):
    case.call_and_validate(base_url=live.url + "/admin", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                           checks=CHECKS, timeout=30)
