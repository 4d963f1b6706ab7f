"""Single sign-on for the console against a real OpenID Connect provider: panva's oidc-provider
(npm), started on loopback by the test, driven by Debian's Chromium through Playwright. The
provider's development login takes any user name; alice is in proxy-admins, bob in finance,
carol in no group (tests/admin/oidc_provider.mjs)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.clients.npm import npm_install
from tests.conftest import eventually, free_port
from tests.support.paths import REPO

playwright_api = pytest.importorskip("playwright.async_api")

CACHE = Path(os.environ.get("OIDC_PROVIDER_CACHE_DIR", REPO / ".cache" / "oidc-provider"))
CHROMIUM = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or "/usr/bin/chromium"
ADMIN_KEY = "adm-sso-0123456789abcdef"
CLIENT_ID, CLIENT_SECRET = "proxy-console", "a-test-client-secret"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists() or shutil.which("node") is None,
                                reason="needs Debian's chromium and node (make test-deps installs them)")


class ProviderUnavailable(Exception):
    pass


@pytest.fixture(scope="module")
def provider_dir() -> Path:
    if not (CACHE / "node_modules" / "oidc-provider").is_dir():
        try:
            npm_install(CACHE, "oidc-provider@9", 300, ProviderUnavailable)
        except ProviderUnavailable as exc:
            pytest.skip(str(exc))
    shutil.copy(Path(__file__).resolve().parent / "oidc_provider.mjs", CACHE / "provider.mjs")
    return CACHE


@pytest.fixture
async def console(make_proxy, provider_dir):
    """(the proxy, the provider's URL): the console with an admin key and single sign-on."""
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    proxy = await make_proxy({"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY}], "oidc": {
        "issuer": issuer, "client_id": CLIENT_ID, "client_secret": CLIENT_SECRET,
        "roles": {"proxy-admins": "admin", "finance": "viewer", "ml-leads": "team_admin"}}}})
    node = subprocess.Popen(["node", "provider.mjs", str(port), proxy.url + "/admin/oidc/callback", CLIENT_ID,
                             CLIENT_SECRET], cwd=provider_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with aiohttp.ClientSession() as s:
            async def up() -> bool:
                try:
                    async with s.get(issuer + "/.well-known/openid-configuration") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return node.poll() is None and False
            await eventually(up, 30, what="the OpenID provider answering")
        yield proxy, issuer
    finally:
        node.terminate()
        try:
            node.wait(10)
        except subprocess.TimeoutExpired:
            node.kill()
        if sys.exc_info()[0] is not None and node.stdout is not None:
            print(node.stdout.read().decode(errors="replace")[-3000:])


async def _sign_on(page, proxy, login: str) -> None:
    await page.goto(proxy.url + "/admin/")
    await page.wait_for_selector("#sso", state="visible")
    await page.click("#sso")
    await page.wait_for_selector("input[name=login]")  # the provider's own login page
    await page.fill("input[name=login]", login)
    await page.fill("input[name=password]", "any password")
    await page.click("button[type=submit]")


async def test_sign_on_lands_in_the_console_with_the_role_its_claims_map_to(console):
    proxy, _ = console
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            for login, role in (("alice", "admin"), ("bob", "viewer")):
                context = await browser.new_context(viewport={"width": 1200, "height": 800})
                page = await context.new_page()
                await _sign_on(page, proxy, login)
                await page.wait_for_selector("body[data-loaded]")
                assert await page.text_content("#who") == f"{role}: {login}@example.com"
                session = await page.evaluate("fetch('api/session').then(r => r.json())")
                assert session["role"] == role and session["via"] == "oidc"
                # a write from the page, with the session's CSRF token: the role decides
                made = await page.evaluate("""async (csrf) => {
                    const r = await fetch('api/keys', {method: 'POST', headers: {'Content-Type': 'application/json',
                        'X-CSRF-Token': csrf}, body: JSON.stringify({name: 'made-by-sso'})});
                    return [r.status, await r.json()];
                }""", session["csrf_token"])
                if role == "admin":
                    assert made[0] == 201
                    audit = await proxy.ledger.list_audit(key_id=made[1]["key"]["key_id"])
                    assert audit[0].actor == "oidc:alice@example.com"
                else:
                    assert made[0] == 403 and made[1]["error"]["code"] == "insufficient_role"
                await page.screenshot(path=str(REPO / "test-artifacts" / f"console-sso-{login}.png"))
                await context.close()
        finally:
            await browser.close()


async def test_a_team_lead_signs_on_as_the_team_admin_of_the_teams_their_claims_name(console):
    proxy, _ = console
    for team in ("team_ml", "team_ops"):
        await proxy.ledger.create_level("team", {"level_id": team, "name": team[5:], "balance_micros": 10**7})
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = await browser.new_page(viewport={"width": 1200, "height": 800})
            await _sign_on(page, proxy, "dana")
            await page.wait_for_selector("body[data-loaded]")
            session = await page.evaluate("fetch('api/session').then(r => r.json())")
            assert (session["role"], session["teams"], session["via"]) == ("team_admin", ["team_ml"], "oidc")
            write = """async ([csrf, team]) => {
                const r = await fetch('api/keys', {method: 'POST', headers: {'Content-Type': 'application/json',
                    'X-CSRF-Token': csrf}, body: JSON.stringify({name: 'lead-made', team_id: team})});
                return [r.status, await r.json()];
            }"""
            made = await page.evaluate(write, [session["csrf_token"], "team_ml"])
            assert made[0] == 201 and made[1]["key"]["team_id"] == "team_ml"
            refused = await page.evaluate(write, [session["csrf_token"], "team_ops"])
            assert refused[0] == 400
            teams = await page.evaluate("fetch('api/teams').then(r => r.json())")
            assert [t["level_id"] for t in teams["data"]] == ["team_ml"]
            audit = await proxy.ledger.list_audit(key_id=made[1]["key"]["key_id"])
            assert audit[0].actor == "oidc:dana@example.com"
        finally:
            await browser.close()


async def test_a_person_whose_claims_map_to_no_role_is_sent_back_refused(console):
    proxy, _ = console
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = await browser.new_page()
            await _sign_on(page, proxy, "carol")
            await playwright_api.expect(page.locator("#login-error")).to_contain_text("has no role here")
            assert "carol" not in await page.text_content("#login-error") and "carol" not in page.url
            assert (await page.evaluate("fetch('api/session').then(r => r.status)")) == 401
        finally:
            await browser.close()


async def test_a_callback_that_this_browser_did_not_start_is_refused(console):
    proxy, _ = console
    async with aiohttp.ClientSession() as s:  # a forged return: a code and a state, no flow cookie
        r = await s.get(proxy.url + "/admin/oidc/callback?code=abc&state=xyz", allow_redirects=False)
        assert r.status == 302 and "sso_error=" in r.headers["Location"]
        assert "rp_admin_session" not in r.headers.get("Set-Cookie", "")
        r = await s.get(proxy.url + "/admin/api/keys")
        assert r.status == 401
        # the admin key still works beside single sign-on
        r = await s.get(proxy.url + "/admin/api/keys", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status == 200
        r = await s.get(proxy.url + "/admin/login-options")
        assert (await r.json())["oidc"]["url"] == "/admin/oidc/login"


async def test_the_login_page_shows_only_a_code_the_spec_defines_from_the_provider(console):
    proxy, _ = console
    async with aiohttp.ClientSession() as s:
        for sent, shown in (("access_denied", "access_denied"), ("Your account is locked, call +1 555", "an error")):
            r = await s.get(proxy.url + "/admin/oidc/callback", params={"error": sent}, allow_redirects=False)
            location = r.headers["Location"]
            assert r.status == 302 and "locked" not in location
            assert shown.replace(" ", "%20") in location, location


def test_an_issuer_over_plain_http_is_refused_but_on_this_machine():
    from proxy.config.load import Config, ConfigError

    oidc = {"client_id": CLIENT_ID, "roles": {"admins": "admin"}}
    with pytest.raises(ConfigError, match="admin.oidc.issuer must be https://"):
        Config.from_dict({"admin": {"oidc": {**oidc, "issuer": "http://login.example.com"}}})
    for issuer in ("https://login.example.com", "http://127.0.0.1:9999"):
        Config.from_dict({"admin": {"oidc": {**oidc, "issuer": issuer}}})


def test_serve_with_workers_and_sign_on_needs_a_shared_session_secret(pg_dsn, tmp_path):
    # a PostgreSQL ledger makes no session secret on disk: each process would sign its own flows
    config = tmp_path / "config.yaml"
    config.write_text(f"ledger: {{backend: postgres, dsn: '{pg_dsn}', spool_path: {tmp_path / 'spool.jsonl'}}}\n"
                      "admin: {oidc: {issuer: 'https://login.example.com', client_id: c, roles: {a: admin}}}\n")
    proc = subprocess.run([sys.executable, "-m", "proxy", "--config", str(config), "serve", "--port", str(free_port()),
                           "--workers", "2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "single sign-on (admin.oidc) needs one" in proc.stderr, proc.stderr
    assert "listening" not in proc.stdout
