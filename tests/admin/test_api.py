"""The admin API (proxy/admin) against a real proxy on loopback with a real SQLite ledger
and the simulator: keys over HTTP (create, list, show, top up, limits, revoke, rotate,
expiry), the audit log, usage rows and totals (JSON, CSV, pages), GET /v1/key, and the
security rules (401 / 403, client keys refused, the session cookie, CSRF, no secret in
pages, logs or the audit log)."""

from __future__ import annotations

import csv
import io
import json
import time

import aiohttp
import yarl
import pytest

from proxy.admin.auth import COOKIE, AdminAuth
from proxy.config import settings as config_settings
from proxy.ledger import KeyLimits

ADMIN_KEY = "adm-test-0123456789abcdef"
OTHER_ADMIN = "adm-other-0123456789abcdef"


def _admin_config(**extra):
    return {"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY}, {"name": "audit", "key": OTHER_ADMIN}],
                      "session_secret": "s" * 32, **extra},
            "auth": {"demo_key": True}}


def _h(key: str = ADMIN_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def admin_proxy(make_proxy):
    return await make_proxy(_admin_config())


async def _traffic(proxy, key: str, n: int = 3, model: str = "tiny-org/tiny-model") -> None:
    client = proxy.openai(api_key=key)
    for i in range(n):
        await client.responses.create(model=model, input=f"Say hello {i}.", max_output_tokens=16)
    from middlewares.balance import wait_for_settlements

    await wait_for_settlements(proxy.app)


async def test_key_lifecycle_over_http_is_audited(admin_proxy):
    p = admin_proxy
    async with aiohttp.ClientSession() as s:
        r = await s.post(p.url + "/admin/api/keys", headers=_h(), json={
            "name": "team-a", "balance_micros": 5_000_000, "allowed_models": ["tiny-org/tiny-model"],
            "rate_per_min": 100, "tokens_per_min": 100000, "daily_budget_micros": 4_000_000})
        assert r.status == 201, await r.text()
        created = await r.json()
        secret, key_id = created["secret"], created["key"]["key_id"]
        assert secret.startswith("sk-rp-") and created["key"]["tokens_per_min"] == 100000
        # the secret is in that one answer only
        listing = await (await s.get(p.url + "/admin/api/keys", headers=_h())).text()
        assert key_id in listing and secret not in listing
        shown = await (await s.get(p.url + f"/admin/api/keys/{key_id}", headers=_h())).json()
        assert shown["balance_micros"] == 5_000_000 and shown["spend_today_micros"] == 0
        assert shown["daily_budget_remaining_micros"] == 4_000_000
        r = await s.post(p.url + f"/admin/api/keys/{key_id}/topup", headers=_h(), json={"micros": 1_000_000})
        assert (await r.json())["balance_micros"] == 6_000_000
        r = await s.patch(p.url + f"/admin/api/keys/{key_id}", headers=_h(),
                          json={"concurrency": 3, "allowed_models": None, "expires_at": "2999-01-01T00:00:00Z"})
        key = (await r.json())["key"]
        assert key["concurrency"] == 3 and key["allowed_models"] is None and key["expires"] == "2999-01-01T00:00:00Z"
        # the key works, then a rotation: the old secret stops, the new one works, same balance
        await _traffic(p, secret, 1)
        r = await s.post(p.url + f"/admin/api/keys/{key_id}/rotate", headers=_h())
        rotated = await r.json()
        new_secret = rotated["secret"]
        assert new_secret != secret and rotated["key"]["key_id"] == key_id
        r = await s.get(p.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"})
        assert r.status == 401
        r = await s.get(p.url + "/v1/models", headers={"Authorization": f"Bearer {new_secret}"})
        assert r.status == 200
        # revoke takes effect at once (the key cache is flushed), through the same ledger
        r = await s.post(p.url + f"/admin/api/keys/{key_id}/revoke", headers=_h())
        assert r.status == 200
        r = await s.get(p.url + "/v1/models", headers={"Authorization": f"Bearer {new_secret}"})
        assert r.status == 401
        audit = await (await s.get(p.url + f"/admin/api/audit?key_id={key_id}", headers=_h())).json()
        actions = [e["action"] for e in audit["data"]]
        assert actions == ["key.revoke", "key.rotate", "key.update", "key.topup", "key.create"]
        assert {e["actor"] for e in audit["data"]} == {"admin:ops"}
        text = json.dumps(audit)
        assert secret not in text and new_secret not in text and ADMIN_KEY not in text


async def test_refusals_are_4xx_envelopes(admin_proxy):
    p = admin_proxy
    async with aiohttp.ClientSession() as s:
        cases = [
            ("post", "/admin/api/keys", {"name": ""}, 400),
            ("post", "/admin/api/keys", {"name": "x", "balance_micros": -1}, 400),
            ("post", "/admin/api/keys", {"name": "x", "colour": "red"}, 400),
            ("post", "/admin/api/keys", {"name": "x", "tokens_per_min": 0}, 400),
            ("post", "/admin/api/keys", {"name": "x", "expires_at": "next tuesday"}, 400),
            ("patch", "/admin/api/keys/key_nope", {"concurrency": 2}, 404),
            ("patch", "/admin/api/keys/key_nope", {}, 400),
            ("post", "/admin/api/keys/key_nope/topup", {"micros": 5}, 404),
            ("post", "/admin/api/keys/key_nope/topup", {"micros": "5"}, 400),
            ("post", "/admin/api/keys/key_nope/revoke", None, 404),
            ("get", "/admin/api/usage?since=yesterday", None, 400),
            ("get", "/admin/api/usage?limit=0", None, 400),
            ("get", "/admin/api/usage/totals?group_by=colour", None, 400),
            ("get", "/admin/api/usage/totals?group_by=day,hour", None, 400),
            ("get", "/admin/api/overview?range=1y", None, 400),
        ]
        for method, path, body, status in cases:
            r = await getattr(s, method)(p.url + path, headers=_h(), json=body)
            assert r.status == status, (method, path, await r.text())
            err = (await r.json())["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
        r = await s.post(p.url + "/admin/api/keys", headers={**_h(), "Content-Type": "application/json"},
                         data=b"{not json")
        assert r.status == 400


async def test_usage_rows_totals_csv_and_pages(admin_proxy):
    p = admin_proxy
    ledger = p.ledger
    a_secret, a = await ledger.create_key("a", 50_000_000)
    b_secret, b = await ledger.create_key("b", 50_000_000)
    await _traffic(p, a_secret, 3)
    await _traffic(p, b_secret, 2)
    async with aiohttp.ClientSession() as s:
        page1 = await (await s.get(p.url + "/admin/api/usage?limit=2", headers=_h())).json()
        assert len(page1["data"]) == 2 and page1["has_more"]
        seen = [r["request_id"] for r in page1["data"]]
        cursor = page1["next_cursor"]
        while cursor is not None:
            page = await (await s.get(p.url + f"/admin/api/usage?limit=2&cursor={cursor}", headers=_h())).json()
            seen += [r["request_id"] for r in page["data"]]
            cursor = page["next_cursor"]
        rows = await ledger.usage_rows(limit=100)
        assert seen == [r.request_id for _, r in rows] and len(seen) == 5
        assert {r.worker for _, r in rows} == {"sim"}
        totals = await (await s.get(p.url + "/admin/api/usage/totals?group_by=key", headers=_h())).json()
        by_key = {t["key"]: t for t in totals["data"]}
        for key, n in ((a.key_id, 3), (b.key_id, 2)):
            mine = [r for _, r in rows if r.key_id == key]
            assert by_key[key]["requests"] == n
            assert by_key[key]["cost_micros"] == sum(r.cost_micros for r in mine)
            assert by_key[key]["output_tokens"] == sum(r.output_tokens for r in mine)
        r = await s.get(p.url + "/admin/api/usage/totals?group_by=model,worker,day&format=csv", headers=_h())
        assert r.status == 200 and r.content_type == "text/csv"
        table = list(csv.DictReader(io.StringIO(await r.text())))
        assert len(table) == 1 and table[0]["worker"] == "sim" and int(table[0]["requests"]) == 5
        # a range that ends before the traffic holds nothing
        r = await s.get(p.url + "/admin/api/usage/totals?until=2000-01-01", headers=_h())
        assert (await r.json())["data"][0]["requests"] == 0
        r = await s.get(p.url + f"/admin/api/usage?format=csv&key_id={b.key_id}", headers=_h())
        lines = list(csv.DictReader(io.StringIO(await r.text())))
        assert len(lines) == 2 and {row["key_id"] for row in lines} == {b.key_id}


async def test_v1_key_shows_only_the_callers_key(admin_proxy):
    p = admin_proxy
    a_secret, a = await p.ledger.create_key("holder-a", 9_000_000,
                                            limits=KeyLimits(rate_per_min=50, monthly_budget_micros=8_000_000))
    _b_secret, b = await p.ledger.create_key("holder-b", 1_000_000)
    await _traffic(p, a_secret, 2)
    spent = sum(r.debited_micros for _, r in await p.ledger.usage_rows(key_id=a.key_id))
    async with aiohttp.ClientSession() as s:
        r = await s.get(p.url + "/v1/key", headers={"Authorization": f"Bearer {a_secret}"})
        assert r.status == 200
        text = await r.text()
        data = json.loads(text)["data"]
        assert data["key_id"] == a.key_id and data["label"] == "holder-a"
        assert data["balance_micros"] == 9_000_000 - spent and data["spend_today_micros"] == spent
        assert data["spend_month_micros"] == spent and data["limits"]["rate_per_min"] == 50
        assert data["monthly_budget_remaining_micros"] == 8_000_000 - spent
        assert b.key_id not in text and "holder-b" not in text and a_secret not in text
        assert (await s.get(p.url + "/v1/key")).status == 401


async def test_admin_refuses_client_keys_and_anonymous_calls(make_proxy):
    # 20 wrong keys from one address: past the default budget of failures (10), which
    # tests/integration/test_edge_bounds.py pins; here each refusal's own answer is the point.
    p = await make_proxy(_admin_config(login_failure_burst=100))
    client_secret, _ = await p.ledger.create_key("client", 1_000_000)
    routes = [("get", "/admin/api/keys"), ("post", "/admin/api/keys"), ("get", "/admin/api/usage"),
              ("get", "/admin/api/usage/totals"), ("get", "/admin/api/audit"), ("get", "/admin/api/overview"),
              ("patch", "/admin/api/keys/x"), ("post", "/admin/api/keys/x/revoke"), ("get", "/admin/api/session")]
    async with aiohttp.ClientSession() as s:
        for method, path in routes:
            r = await getattr(s, method)(p.url + path, json={"name": "x"})
            assert r.status == 401, (method, path)
            r = await getattr(s, method)(p.url + path, json={"name": "x"}, headers=_h(client_secret))
            assert r.status == 403, (method, path)
            assert (await r.json())["error"]["code"] == "client_key_not_allowed"
            r = await getattr(s, method)(p.url + path, json={"name": "x"}, headers=_h("adm-wrong-0123456789abcdef"))
            assert r.status == 401, (method, path)
        # the demo (client) key cannot log in either
        r = await s.post(p.url + "/admin/login", json={"key": p.api_key})
        assert r.status == 403
        r = await s.post(p.url + "/admin/login", json={"key": "nope"})
        assert r.status == 401
    # and an admin key is no client key
    async with aiohttp.ClientSession() as s:
        r = await s.get(p.url + "/v1/models", headers=_h())
        assert r.status == 401


async def test_session_cookie_signed_expiring_and_csrf_on_writes(admin_proxy):
    p = admin_proxy
    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar) as s:
        r = await s.post(p.url + "/admin/login", json={"key": ADMIN_KEY})
        assert r.status == 200
        login = await r.json()
        set_cookie = r.headers["Set-Cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie and "Path=/admin" in set_cookie
        assert ADMIN_KEY not in set_cookie
        token = login["csrf_token"]
        # reads work with the cookie alone
        assert (await s.get(p.url + "/admin/api/keys")).status == 200
        # writes need the CSRF token
        r = await s.post(p.url + "/admin/api/keys", json={"name": "via-session"})
        assert r.status == 403 and (await r.json())["error"]["code"] == "csrf_failed"
        r = await s.post(p.url + "/admin/api/keys", json={"name": "via-session"}, headers={"X-CSRF-Token": "x" * 43})
        assert r.status == 403
        r = await s.post(p.url + "/admin/api/keys", json={"name": "via-session"},
                         headers={"X-CSRF-Token": token, "Origin": "https://evil.example"})
        assert r.status == 403  # the right token from another site's page (it could not read it, but still)
        r = await s.post(p.url + "/admin/api/keys", json={"name": "via-session"},
                         headers={"X-CSRF-Token": token, "Origin": p.url})
        assert r.status == 201
        key_id = (await r.json())["key"]["key_id"]
        entry = (await p.ledger.list_audit(key_id=key_id))[0]
        assert entry.actor == "admin:ops"
        cookie = jar.filter_cookies(yarl.URL(p.url + "/admin/"))[COOKIE].value
        r = await s.post(p.url + "/admin/api/logout", headers={"X-CSRF-Token": token})
        assert r.status == 200
        assert (await s.get(p.url + "/admin/api/keys")).status == 401
    async with aiohttp.ClientSession() as s:  # the cookie kept by someone else is refused too
        r = await s.get(p.url + "/admin/api/keys", headers={"Cookie": f"{COOKIE}={cookie}"})
        assert r.status == 401
    # a forged or tampered cookie, an expired one, one signed with another secret
    auth = AdminAuth(config_settings.of("admin", {"keys": [{"name": "ops", "key": ADMIN_KEY}], "session_secret": "s" * 32}))
    good, _ = auth.issue("ops")
    expired, _ = auth.issue("ops", now=time.time() - 10 * 86400)
    other, _ = AdminAuth(config_settings.of("admin", {"keys": [{"name": "ops", "key": ADMIN_KEY}],
                                                      "session_secret": "t" * 32})).issue("ops")
    body, _, mac = good.partition(".")
    tampered = body[:-2] + ("AA" if body[-2:] != "AA" else "BB") + "." + mac
    async with aiohttp.ClientSession() as s:
        r = await s.get(p.url + "/admin/api/keys", headers={"Cookie": f"{COOKIE}={good}"})
        assert r.status == 200
        for bad in (expired, other, tampered, "x.y", ""):
            r = await s.get(p.url + "/admin/api/keys", headers={"Cookie": f"{COOKIE}={bad}"})
            assert r.status == 401, bad


async def test_secrets_never_in_pages_logs_or_audit(make_proxy, capsys):
    p = await make_proxy(_admin_config())
    async with aiohttp.ClientSession() as s:
        r = await s.post(p.url + "/admin/api/keys", headers=_h(), json={"name": "secretive", "balance_micros": 10})
        secret = (await r.json())["secret"]
        key_id = (await r.json())["key"]["key_id"]
        r = await s.post(p.url + f"/admin/api/keys/{key_id}/rotate", headers=_h())
        rotated = (await r.json())["secret"]
        await s.post(p.url + "/admin/login", json={"key": ADMIN_KEY})
        pages = [await (await s.get(p.url + path, headers=_h())).text() for path in (
            "/admin/", "/admin/api/keys", f"/admin/api/keys/{key_id}", "/admin/api/audit", "/admin/api/overview",
            "/admin/openapi.json", "/admin/static/dashboard.js")]
    for text in pages:
        for value in (secret, rotated, ADMIN_KEY):
            assert value not in text
    audit = json.dumps([e.details for e in await p.ledger.list_audit()])
    assert secret not in audit and rotated not in audit
    logs = capsys.readouterr()
    for value in (secret, rotated, ADMIN_KEY):
        assert value not in logs.out and value not in logs.err


async def test_expired_key_is_refused(admin_proxy):
    p = admin_proxy
    secret, record = await p.ledger.create_key("short-lived", 1_000_000,
                                               limits=KeyLimits(expires_at=time.time() + 3600))
    async with aiohttp.ClientSession() as s:
        h = {"Authorization": f"Bearer {secret}"}
        assert (await s.get(p.url + "/v1/models", headers=h)).status == 200
        r = await s.patch(p.url + f"/admin/api/keys/{record.key_id}", headers=_h(),
                          json={"expires_at": time.time() - 1})
        assert r.status == 200 and (await r.json())["key"]["expired"] is True
        assert (await s.get(p.url + "/v1/models", headers=h)).status == 401


async def test_admin_openapi_describes_every_route(admin_proxy):
    p = admin_proxy
    async with aiohttp.ClientSession() as s:
        doc = await (await s.get(p.url + "/admin/openapi.json")).json()
    assert doc["servers"] == [{"url": "/admin"}]
    from proxy.admin import install  # noqa: F401  (the sub-app's routes, as mounted)

    sub = next(r for r in p.app.router.resources() if getattr(r, "_app", None) is not None)._app
    served = set()
    for resource in sub.router.resources():
        info = resource.get_info()
        path = (info.get("path") or info.get("formatter") or "").removeprefix("/admin")
        if path.startswith("/static") or path in ("", "/", "/openapi.json"):
            continue
        for route in resource:
            if route.method != "HEAD":
                served.add((path, route.method.lower()))
    documented = {(path, method) for path, item in doc["paths"].items() for method in item if method != "parameters"}
    assert served == documented


@pytest.mark.parametrize("section, message", [
    ({"keys": [{"name": "ops", "key": "short"}]}, "at least 16"),
    ({"keys": [{"name": "ops", "key": ADMIN_KEY}, {"name": "ops", "key": OTHER_ADMIN}]}, "duplicate"),
    ({"keys": [{"name": "ops", "key": ADMIN_KEY, "sha256": "0" * 64}]}, "exactly one"),
    ({"keys": [{"name": "ops", "sha256": "xyz"}]}, "64 hex"),
    ({"keys": [{"name": "ops", "key": ADMIN_KEY}], "prefix": "/v1/admin"}, "prefix"),
    ({"keys": [{"name": "ops", "key": ADMIN_KEY}], "session_secret": "tiny"}, "session_secret"),
])
def test_bad_admin_sections_stop_start_up(section, message):
    from proxy.config.load import Config, ConfigError
    from proxy.app import build_app

    with pytest.raises(ConfigError, match=message):
        build_app(Config.from_dict({"admin": section}))


async def test_admin_key_given_as_sha256_and_another_prefix(make_proxy):
    import hashlib

    p = await make_proxy({"admin": {"keys": [{"name": "hashed", "sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}],
                                    "prefix": "/console"}})
    async with aiohttp.ClientSession() as s:
        assert (await s.get(p.url + "/console/api/keys", headers=_h())).status == 200
        assert (await s.get(p.url + "/admin/api/keys", headers=_h())).status == 404
        doc = await (await s.get(p.url + "/console/openapi.json")).json()
        assert doc["servers"] == [{"url": "/console"}]
        r = await s.get(p.url + "/console", allow_redirects=False)
        assert r.status == 302 and r.headers["Location"] == "/console/"


async def test_dashboard_page_loads_only_its_own_files(admin_proxy):
    import re

    p = admin_proxy
    async with aiohttp.ClientSession() as s:
        r = await s.get(p.url + "/admin/")
        html = await r.text()
        csp = r.headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe" not in csp
        assert r.headers["Cache-Control"] == "no-store"
        sources = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert sources and all(not re.match(r"^[a-z]+://|^//", src) for src in sources), sources
        for src in sources:
            if src.startswith("static/"):
                assert (await s.get(p.url + "/admin/" + src)).status == 200, src
        assert (await s.get(p.url + "/admin/static/..%2fauth.py")).status == 404
        assert (await s.get(p.url + "/admin/static/../auth.py")).status in (401, 404)  # the client resolves ..
        assert (await s.get(p.url + "/admin/static/VENDOR.md")).status == 404  # only the page's own kinds


VIEWER_KEY = "adm-viewer-0123456789abcdef"
_WRITES = [("POST", "/admin/api/keys", {"name": "x"}), ("PATCH", "/admin/api/keys/{id}", {"name": "y"}),
           ("POST", "/admin/api/keys/{id}/topup", {"amount_micros": 5}), ("POST", "/admin/api/keys/{id}/revoke", {}),
           ("POST", "/admin/api/keys/{id}/rotate", {})]


async def test_a_viewer_reads_and_every_write_of_its_is_a_403_that_changes_nothing(make_proxy):
    cfg = _admin_config()
    cfg["admin"]["keys"].append({"name": "finance", "key": VIEWER_KEY, "role": "viewer"})
    p = await make_proxy(cfg)
    async with aiohttp.ClientSession() as s:
        r = await s.post(p.url + "/admin/api/keys", json={"name": "kept", "balance_micros": 100}, headers=_h())
        assert r.status == 201  # an admin key (no role: admin) writes
        key_id = (await r.json())["key"]["key_id"]
        before = await (await s.get(p.url + f"/admin/api/keys/{key_id}", headers=_h())).json()
        audit = await p.ledger.list_audit(key_id=key_id)
        for method, path, body in _WRITES:  # with the key itself
            r = await s.request(method, p.url + path.format(id=key_id), json=body, headers=_h(VIEWER_KEY))
            error = (await r.json())["error"]
            assert r.status == 403 and error["code"] == "insufficient_role", (path, error)
        for read in ("/admin/api/keys", f"/admin/api/keys/{key_id}", "/admin/api/usage", "/admin/api/audit"):
            assert (await s.get(p.url + read, headers=_h(VIEWER_KEY))).status == 200, read
    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar) as s:  # with a session made by it
        login = await (await s.post(p.url + "/admin/login", json={"key": VIEWER_KEY})).json()
        assert login["role"] == "viewer"
        csrf = {"X-CSRF-Token": login["csrf_token"], "Origin": p.url}
        assert (await (await s.get(p.url + "/admin/api/session")).json())["role"] == "viewer"
        for method, path, body in _WRITES:
            r = await s.request(method, p.url + path.format(id=key_id), json=body, headers=csrf)
            assert r.status == 403 and (await r.json())["error"]["code"] == "insufficient_role", path
        assert (await s.post(p.url + "/admin/api/logout", headers=csrf)).status == 200  # its own session ends
    async with aiohttp.ClientSession() as s:
        after = await (await s.get(p.url + f"/admin/api/keys/{key_id}", headers=_h())).json()
    assert after == before and await p.ledger.list_audit(key_id=key_id) == audit
    assert [k.name for k in await p.ledger.list_keys() if k.name == "x"] == []  # the viewer's create made none


def test_an_admin_key_role_is_admin_or_viewer():
    from proxy.app import build_app
    from proxy.config.load import Config, ConfigError

    with pytest.raises(ConfigError, match=r"admin.keys\[0\].role must be one of admin, viewer"):
        build_app(Config.from_dict({"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY, "role": "owner"}]}}))


async def test_money_in_dollars_and_expiry_from_now(admin_proxy):
    p = admin_proxy
    async with aiohttp.ClientSession() as s:
        r = await s.post(p.url + "/admin/api/keys", headers=_h(), json={
            "name": "dollars", "balance_usd": "12.50", "daily_budget_usd": "1,000.25", "expires_at": "30d"})
        assert r.status == 201, await r.text()
        key = (await r.json())["key"]
        assert key["balance_micros"] == 12_500_000 and key["daily_budget_micros"] == 1_000_250_000
        assert abs(key["expires_at"] - (time.time() + 30 * 86400)) < 120
        r = await s.post(p.url + f"/admin/api/keys/{key['key_id']}/topup", headers=_h(), json={"usd": "-0.5"})
        assert r.status == 200 and (await r.json())["balance_micros"] == 12_000_000
        r = await s.patch(p.url + f"/admin/api/keys/{key['key_id']}", headers=_h(),
                          json={"monthly_budget_usd": 30, "daily_budget_usd": None, "expires_at": "2w"})
        key = (await r.json())["key"]
        assert key["monthly_budget_micros"] == 30_000_000 and key["daily_budget_micros"] is None
        assert abs(key["expires_at"] - (time.time() + 14 * 86400)) < 120
        for bad in ({"name": "x", "balance_usd": "1,50"}, {"name": "x", "balance_usd": "0.0000001"},
                    {"name": "x", "balance_usd": "-1"}, {"name": "x", "balance_usd": "1", "balance_micros": 5},
                    {"name": "x", "expires_at": "30y"}, {"name": "x", "expires_at": "999999w"},
                    {"name": "x", "expires_at": "30"}):
            r = await s.post(p.url + "/admin/api/keys", headers=_h(), json=bad)
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_value", bad
        r = await s.post(p.url + f"/admin/api/keys/{key['key_id']}/topup", headers=_h(), json={"usd": "abc"})
        assert r.status == 400
        await s.post(p.url + f"/admin/api/keys/{key['key_id']}/revoke", headers=_h())
        r = await s.post(p.url + f"/admin/api/keys/{key['key_id']}/topup", headers=_h(), json={"usd": "5"})
        assert r.status == 409 and "revoked" in (await r.json())["error"]["message"]


async def test_allowed_models_naming_a_model_no_worker_serves_says_so(admin_proxy):
    p = admin_proxy
    async with aiohttp.ClientSession() as s:
        r = await s.post(p.url + "/admin/api/keys", headers=_h(),
                         json={"name": "typo", "allowed_models": ["tiny-org/tiny-model", "tiny-org/tiny-modle"]})
        answer = await r.json()
        assert r.status == 201 and answer["warnings"] == ["allowed_models: no worker serves 'tiny-org/tiny-modle' now"]
        r = await s.patch(p.url + f"/admin/api/keys/{answer['key']['key_id']}", headers=_h(),
                          json={"allowed_models": ["vendor/tiny-org/tiny-model"]})  # a vendor prefix resolves
        assert r.status == 200 and "warnings" not in await r.json()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_the_request_browser_lists_exactly_the_ledgers_rows_for_a_filter(make_proxy, request, tmp_path, backend):
    from tests.conftest import ledger_section

    p = await make_proxy({**_admin_config(), "ledger": ledger_section(backend, request, tmp_path)})
    one, first = await p.ledger.create_key("one", 10_000_000)
    two, _ = await p.ledger.create_key("two", 10_000_000)
    async with aiohttp.ClientSession() as s:
        for secret, path, body in ((one, "/v1/responses", {"model": "tiny-org/tiny-model", "input": "hi",
                                                           "max_output_tokens": 8}),
                                   (one, "/v1/chat/completions", {"model": "tiny-org/tiny-model", "max_tokens": 8,
                                                                  "messages": [{"role": "user", "content": "hi"}]}),
                                   (two, "/v1/responses", {"model": "tiny-org/tiny-model", "input": "yo",
                                                           "max_output_tokens": 8}),
                                   (one, "/v1/chat/completions", {"model": "tiny-org/tiny-model", "max_tokens": 8,
                                                                  "messages": [{"role": "user", "content": "again"}]})):
            r = await s.post(p.url + path, json=body, headers={"Authorization": f"Bearer {secret}"})
            assert r.status == 200, await r.text()
        from middlewares.balance import wait_for_settlements

        await wait_for_settlements(p.app)
        want = [row for _, row in await p.ledger.usage_rows(key_id=first.key_id, limit=100)
                if (row.endpoint or "/v1/responses") == "/v1/chat/completions"]
        assert len(want) == 2
        got, cursor = [], None
        while True:  # a page of one at a time: the cursor walks them all
            query = {"key_id": first.key_id, "endpoint": "/v1/chat/completions", "status": "completed", "limit": "1"}
            if cursor is not None:
                query["cursor"] = str(cursor)
            r = await s.get(p.url + "/admin/api/requests", params=query, headers=_h())
            assert r.status == 200, await r.text()
            page = await r.json()
            got += page["data"]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert [g["request_id"] for g in got] == [w.request_id for w in want]
        assert all(g["endpoint"] == "/v1/chat/completions" and g["key_name"] == "one" for g in got)
        assert [g["cost_micros"] for g in got] == [w.cost_micros for w in want]
        everything = await (await s.get(p.url + "/admin/api/requests", headers=_h())).json()
        assert len(everything["data"]) == 4 and everything["next_cursor"] is None
        for bad in ({"status": "done"}, {"limit": "0"}, {"since": "yesterday"}):
            r = await s.get(p.url + "/admin/api/requests", params=bad, headers=_h())
            assert r.status == 400, bad
