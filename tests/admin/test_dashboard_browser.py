"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright (no
browser download: executable_path=/usr/bin/chromium; make test-deps installs the package).

A proxy with admin keys in front of the simulator gets real traffic (two keys, a streamed
answer that fails midway, repeated prompts the simulator's prefix cache serves); the
browser logs in with the admin key, opens each view, and the numbers it shows must equal
the ledger's. Screenshots (PNG) go to test-artifacts/ (git-ignored); with
DASHBOARD_SCREENSHOT_DOCS=1 the spend view is also written to docs/dashboard.png (README).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from proxy.ledger import KeyLimits
from tests.support.paths import REPO

playwright_api = pytest.importorskip("playwright.async_api")

CHROMIUM = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or "/usr/bin/chromium"
ARTEFACTS = REPO / "test-artifacts"
DOCS = REPO / "docs"
ADMIN_KEY = "adm-browser-0123456789abcdef"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason="needs Debian's chromium (make test-deps installs it)")

SYSTEM = "You are a careful assistant. " * 40  # long and repeated: the prefix cache serves it


async def _traffic(proxy) -> dict:
    ledger = proxy.ledger
    alpha_secret, alpha = await ledger.create_key("alpha", 50_000_000)
    beta_secret, beta = await ledger.create_key("beta", 50_000_000)
    for secret, n in ((alpha_secret, 4), (beta_secret, 2)):
        client = proxy.openai(api_key=secret)
        for i in range(n):
            await client.responses.create(model="tiny-org/tiny-model", instructions=SYSTEM,
                                          input=f"Question {i}?", max_output_tokens=24)
    client = proxy.openai(api_key=beta_secret)
    events = []
    async with client.responses.stream(model="tiny-org/tiny-model", max_output_tokens=40,
                                       input='SIM:{"text_words": 30, "error_after": 3}') as stream:
        async for event in stream:
            events.append(event.type)
    assert "response.failed" in events
    from middlewares.balance import wait_for_settlements

    await wait_for_settlements(proxy.app)
    return {"alpha": alpha, "beta": beta}


async def _refusals(proxy, alpha_secret: str) -> dict[int, int]:
    """Requests the service refuses: unknown routes (404), a key with no balance (402), a
    key at its rate (429), unknown keys (401). -> how many of each."""
    import aiohttp

    broke_secret, _ = await proxy.ledger.create_key("broke", 0)
    slow_secret, _ = await proxy.ledger.create_key("slow", 50_000_000, limits=KeyLimits(rate_per_min=1))
    body = {"model": "tiny-org/tiny-model", "input": "hi", "max_output_tokens": 4}
    plan = [("GET", "/v1/nothing", alpha_secret, None, 404)] * 3 + [("POST", "/v1/responses", broke_secret, body, 402)] * 4
    plan += [("POST", "/v1/responses", slow_secret, body, None)] * 3  # the first passes, then 429s
    plan += [("POST", "/v1/responses", "sk-rp-" + "n" * 40, body, 401)] * 2
    counts: dict[int, int] = {}
    async with aiohttp.ClientSession() as http:
        for method, path, secret, payload, expected in plan:
            async with http.request(method, proxy.url + path, json=payload,
                                    headers={"Authorization": f"Bearer {secret}"}) as r:
                await r.read()
                assert expected is None or r.status == expected, (path, r.status)
                if r.status >= 400:
                    counts[r.status] = counts.get(r.status, 0) + 1
    assert counts[429] == 2
    return counts


def _money(micros: int) -> str:
    from proxy.ledger.service import usd

    return usd(micros)


async def _cells(page, table: str) -> list[list[str]]:
    return await page.eval_on_selector_all(
        f"#{table} tbody tr", "rows => rows.map(r => [...r.children].map(td => td.textContent))")


async def _history(ledger, keys: dict) -> None:
    """For the README's screenshot only: a day's shape before the live traffic, as usage rows
    settled with earlier times (the live assertions hold for them too: all are in the window)."""
    import random
    import time

    from proxy.ledger import UsageRecord

    rng = random.Random(18)
    now = time.time()
    for hour in range(23, 0, -1):
        for key in keys.values():
            for n in range(rng.randint(1, 4)):
                inp = rng.randint(200, 2000)
                usage = UsageRecord(
                    request_id=f"hist_{key.key_id}_{hour}_{n}", key_id=key.key_id,
                    model=rng.choice(["tiny-org/tiny-model", "org/other-model"]), input_tokens=inp,
                    cached_tokens=rng.randint(0, inp), output_tokens=rng.randint(20, 400), reasoning_tokens=0,
                    cost_micros=rng.randint(200, 1500), status="completed", created_at=now - hour * 3600 - 60,
                    worker="sim")
                await ledger.settle(usage.request_id, usage)


async def test_dashboard_views_match_the_ledger(make_proxy):
    proxy = await make_proxy({"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY}]}, "auth": {"demo_key": True}})
    keys = await _traffic(proxy)
    refused = await _refusals(proxy, proxy.api_key)
    docs_shot = os.environ.get("DASHBOARD_SCREENSHOT_DOCS") == "1"
    if docs_shot:
        await _history(proxy.ledger, keys)
    ledger = proxy.ledger
    total = (await ledger.usage_totals(()))[0]
    by_key = {t.group["key"]: t for t in await ledger.usage_totals(("key",))}
    by_worker = {t.group["worker"]: t for t in await ledger.usage_totals(("worker",))}
    errors = await ledger.usage_rows(statuses=("failed", "error"))
    assert (total.requests == 8 or docs_shot) and len(errors) == 1 and by_worker["sim"].cached_tokens > 0
    ARTEFACTS.mkdir(exist_ok=True)

    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            outside = []
            page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(proxy.url) else None)
            script_errors = []  # exceptions in the page's scripts (the expected 401s are no such thing)
            page.on("pageerror", lambda exc: script_errors.append(str(exc)))
            await page.goto(proxy.url + "/admin")
            await page.wait_for_selector("#login-form", state="visible")
            await page.screenshot(path=str(ARTEFACTS / "dashboard-login.png"))
            # a wrong key is refused on the page
            await page.fill("#admin-key", "adm-wrong-0123456789abcdef")
            await page.click("#login-button")
            # A locator wait, not wait_for_function: that one compiles its predicate with eval in
            # the page, which the dashboard's CSP (script-src 'self') refuses, depending on timing.
            await playwright_api.expect(page.locator("#login-error")).not_to_be_empty()
            await page.fill("#admin-key", ADMIN_KEY)
            await page.click("#login-button")
            await page.wait_for_selector("body[data-loaded]")

            assert await page.text_content("#total-requests") == str(total.requests)
            assert await page.text_content("#total-cost") == _money(total.cost_micros)
            assert (await page.text_content("#total-cost")).startswith("$")
            assert await page.text_content("#total-input") == str(total.input_tokens)
            assert await page.text_content("#total-cached") == str(total.cached_tokens)
            assert await page.text_content("#total-output") == str(total.output_tokens)
            await page.screenshot(path=str(ARTEFACTS / "dashboard-spend.png"), full_page=True)
            if docs_shot:
                await page.screenshot(path=str(DOCS / "dashboard.png"), full_page=True)
            # the charts were drawn by Chart.js, one dataset per key
            datasets = await page.evaluate("Chart.getChart('chart-spend-key').data.datasets.length")
            assert datasets == 3  # alpha, beta, and the rate-limited key's one answered request

            await page.click("nav button[data-view=tokens]")
            await page.wait_for_selector("#view-tokens:not([hidden])")
            await page.screenshot(path=str(ARTEFACTS / "dashboard-tokens.png"), full_page=True)
            shown = await page.evaluate(
                "Chart.getChart('chart-tokens-model').data.datasets.map(d => d.data.reduce((a, b) => a + b, 0))")
            assert sum(shown) == total.input_tokens + total.output_tokens

            await page.click("nav button[data-view=workers]")
            await page.wait_for_selector("#view-workers:not([hidden])")
            await page.screenshot(path=str(ARTEFACTS / "dashboard-workers.png"), full_page=True)
            (worker,) = await _cells(page, "workers-table")
            sim = by_worker["sim"]
            assert worker[0] == "sim" and worker[1] == "healthy"
            assert worker[5:8] == [str(sim.requests), str(sim.input_tokens), str(sim.cached_tokens)]
            # one decimal of the share the API rounds to four places: within rounding of the ledger's
            assert worker[8].endswith("%") and abs(float(worker[8][:-1]) - sim.cached_tokens / sim.input_tokens * 100) <= 0.06

            await page.click("nav button[data-view=keys]")
            await page.wait_for_selector("#view-keys:not([hidden])")
            await page.screenshot(path=str(ARTEFACTS / "dashboard-keys.png"), full_page=True)
            rows = await _cells(page, "keys-table")
            expected = sorted(by_key.values(), key=lambda t: (-t.cost_micros, t.group["key"]))
            assert [r[0] for r in rows] == [t.group["key"] for t in expected]
            for row, t in zip(rows, expected):
                assert row[2] == str(t.requests) and row[6] == _money(t.cost_micros)
            assert {r[1] for r in rows} == {"alpha", "beta", "slow"}
            assert all(r[6].startswith("$") for r in rows)

            await page.click("nav button[data-view=errors]")
            await page.wait_for_selector("#view-errors:not([hidden])")
            await page.screenshot(path=str(ARTEFACTS / "dashboard-errors.png"), full_page=True)
            # The refusals, from the access records, beside the failed answer, from the ledger.
            summary = await page.text_content("#errors-summary")
            for status, n in refused.items():
                assert f"{status} \u00d7{n}" in summary, summary
            assert await page.is_hidden("#errors-empty")
            rows = await _cells(page, "errors-table")
            assert len(rows) == sum(refused.values()) + 1
            assert sorted(r[2] for r in rows) == sorted([str(s) for s, n in refused.items() for _ in range(n)] + ["failed"])
            (failed_row,) = [r for r in rows if r[2] == "failed"]
            assert failed_row[1] == errors[0][1].request_id and failed_row[4] == keys["beta"].key_id
            assert failed_row[9] == _money(errors[0][1].cost_micros) and failed_row[9].startswith("$")
            codes = {r[2]: r[3] for r in rows}
            assert (codes["401"], codes["402"], codes["404"], codes["429"]) == (
                "invalid_api_key", "insufficient_quota", "not_found", "rate_limit_exceeded")
            assert all(r[7] == "http" for r in rows if r[2] != "failed")

            html = await page.content()
            assert ADMIN_KEY not in html
            assert outside == [], f"the page loaded something from elsewhere: {outside[:3]}"
            assert script_errors == []

            # log out: the session is gone, the API answers 401 again
            await page.click("#logout")
            await page.wait_for_selector("#login-form", state="visible")
            status = await page.evaluate("fetch('/admin/api/overview').then(r => r.status)")
            assert status == 401
        finally:
            await browser.close()


async def test_the_errors_view_says_no_errors_when_there_are_none(make_proxy):
    """Only answered requests (and the console's own refusals: a logged-out page, a wrong admin
    key, which are not the service's errors): the Errors view says so in words."""
    proxy = await make_proxy({"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY}]}, "auth": {"demo_key": True}})
    client = proxy.openai()
    await client.responses.create(model="tiny-org/tiny-model", input="hello", max_output_tokens=8)
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            await page.goto(proxy.url + "/admin")
            await page.wait_for_selector("#login-form", state="visible")
            await page.fill("#admin-key", "adm-wrong-0123456789abcdef")
            await page.click("#login-button")
            await playwright_api.expect(page.locator("#login-error")).not_to_be_empty()
            await page.fill("#admin-key", ADMIN_KEY)
            await page.click("#login-button")
            await page.wait_for_selector("body[data-loaded]")
            await page.click("nav button[data-view=errors]")
            await page.wait_for_selector("#view-errors:not([hidden])")
            await page.screenshot(path=str(ARTEFACTS / "dashboard-no-errors.png"), full_page=True)
            assert "no errors" in (await page.text_content("#errors-empty")).lower()
            assert await page.is_visible("#errors-empty") and await page.is_hidden("#errors-table")
            assert await page.text_content("#errors-summary") == ""
        finally:
            await browser.close()


@pytest.mark.parametrize("width", [420, 1400])
async def test_the_login_page_shows_only_the_form_and_no_view_overflows_a_phone(make_proxy, width):
    proxy = await make_proxy({"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY}]}, "auth": {"demo_key": True}})
    await proxy.openai().responses.create(model="tiny-org/tiny-model", input="hello", max_output_tokens=8)
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = await browser.new_page(viewport={"width": width, "height": 900})
            await page.goto(proxy.url + "/admin")
            await page.wait_for_selector("#login-form", state="visible")
            # logged out: the range selector and Log out are not shown ([hidden] wins over #controls' flex)
            assert await page.is_hidden("#controls") and await page.is_hidden("#nav")
            await page.fill("#admin-key", ADMIN_KEY)
            await page.click("#login-button")
            await page.wait_for_selector("body[data-loaded]")
            assert await page.is_visible("#controls")
            for view in ("spend", "tokens", "workers", "keys", "errors", "requests", "manage", "teams"):
                button = page.locator(f"nav button[data-view={view}]")
                if await button.count():
                    await button.click()
                    await page.wait_for_selector(f"#view-{view}:not([hidden])")
                widest = await page.evaluate("document.documentElement.scrollWidth")
                await page.screenshot(path=str(ARTEFACTS / f"dashboard-{view}-{width}.png"), full_page=True)
                assert widest <= width, (view, widest)  # nothing pushes the page wider than the screen
        finally:
            await browser.close()


VIEWER_KEY = "adm-browser-viewer-0123456789"


async def test_a_key_made_in_the_console_is_in_keys_list_and_managed_there(make_proxy, tmp_path):
    """Create (dollars, models, budget, expiry from now), top up, rotate and revoke from the
    console's Manage keys view; the CLI's `keys list` sees each change; a viewer gets no control."""
    import json
    import subprocess
    import sys

    proxy = await make_proxy({"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY},
                                                 {"name": "finance", "key": VIEWER_KEY, "role": "viewer"}]},
                              "auth": {"demo_key": True}})
    db = str(tmp_path / "ledger.db")

    def keys_list() -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "proxy", "keys", "--db", db, "list", "--json"],
                             capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = await browser.new_page(viewport={"width": 1300, "height": 900})
            page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
            await page.goto(proxy.url + "/admin")
            await page.fill("#admin-key", ADMIN_KEY)
            await page.click("#login-button")
            await page.wait_for_selector("body[data-loaded]")
            await page.click("nav button[data-view=manage]")
            await page.wait_for_selector("body[data-keys-loaded]")
            await page.fill("#new-name", "made-in-the-console")
            await page.fill("#new-balance", "12.50")
            await page.fill("#new-models", "tiny-org/tiny-model")
            await page.fill("#new-daily", "2")
            await page.fill("#new-expires", "30d")
            await page.click("#create-button")
            await playwright_api.expect(page.locator("#manage-message")).to_contain_text("Created made-in-the-console")
            secret = await page.text_content("#secret")
            assert secret.startswith("sk-rp-")
            (made,) = [k for k in keys_list() if k["name"] == "made-in-the-console"]
            assert made["balance_micros"] == 12_500_000 and made["daily_budget_micros"] == 2_000_000
            assert made["allowed_models"] == ["tiny-org/tiny-model"] and made["expires"] is not None
            assert (await proxy.ledger.lookup_key(secret)).key_id == made["key_id"]
            row = page.locator(f"tr[data-key-id={made['key_id']}]")
            await row.locator("input").fill("7.5")
            await row.locator("button[data-action=top-up]").click()
            await playwright_api.expect(page.locator("#manage-message")).to_contain_text("balance $20.00")
            await page.locator(f"tr[data-key-id={made['key_id']}] button[data-action=rotate]").click()
            await playwright_api.expect(page.locator("#manage-message")).to_contain_text("new secret made")
            rotated = await page.text_content("#secret")
            assert rotated != secret and (await proxy.ledger.lookup_key(rotated)).key_id == made["key_id"]
            await page.locator(f"tr[data-key-id={made['key_id']}] button[data-action=revoke]").click()
            await playwright_api.expect(page.locator("#manage-message")).to_contain_text("revoked")
            (after,) = [k for k in keys_list() if k["key_id"] == made["key_id"]]
            assert after["revoked"] is True and after["balance_micros"] == 20_000_000
            await page.screenshot(path=str(ARTEFACTS / "dashboard-manage-1300.png"), full_page=True)
            audit = [(e.action, e.actor) for e in await proxy.ledger.list_audit(key_id=made["key_id"])]
            assert audit == [("key.revoke", "admin:ops"), ("key.rotate", "admin:ops"), ("key.topup", "admin:ops"),
                             ("key.create", "admin:ops")]

            viewer = await browser.new_page(viewport={"width": 420, "height": 900})
            await viewer.goto(proxy.url + "/admin")
            await viewer.fill("#admin-key", VIEWER_KEY)
            await viewer.click("#login-button")
            await viewer.wait_for_selector("body[data-loaded]")
            await viewer.click("nav button[data-view=manage]")
            await viewer.wait_for_selector("body[data-keys-loaded]")
            assert await viewer.is_hidden("#create-form")
            assert await viewer.locator("td.actions:visible").count() == 0
            assert await viewer.evaluate("document.documentElement.scrollWidth") <= 420
            await viewer.screenshot(path=str(ARTEFACTS / "dashboard-manage-viewer-420.png"), full_page=True)
        finally:
            await browser.close()


async def test_the_request_browser_view_shows_the_ledgers_rows_for_its_filters(make_proxy):
    proxy = await make_proxy({"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY}]}, "auth": {"demo_key": True}})
    client = proxy.openai()
    for i in range(3):
        await client.responses.create(model="tiny-org/tiny-model", input=f"hello {i}", max_output_tokens=8)
    await client.chat.completions.create(model="tiny-org/tiny-model", max_tokens=8,
                                         messages=[{"role": "user", "content": "hi"}])
    from middlewares.balance import wait_for_settlements

    await wait_for_settlements(proxy.app)
    rows = [r for _, r in await proxy.ledger.usage_rows(limit=100)]
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = await browser.new_page(viewport={"width": 1300, "height": 900})
            await page.goto(proxy.url + "/admin")
            await page.fill("#admin-key", ADMIN_KEY)
            await page.click("#login-button")
            await page.wait_for_selector("body[data-loaded]")
            await page.click("nav button[data-view=requests]")
            await page.wait_for_selector("body[data-requests-loaded]")
            assert [c[1] for c in await _cells(page, "requests-table")] == [r.request_id for r in rows]
            await page.select_option("#req-endpoint", "/v1/chat/completions")
            loaded = await page.get_attribute("body", "data-requests-loaded")
            await page.click("#req-apply")
            await playwright_api.expect(page.locator("body")).not_to_have_attribute("data-requests-loaded", loaded)
            chat = [r.request_id for r in rows if r.endpoint == "/v1/chat/completions"]
            assert [c[1] for c in await _cells(page, "requests-table")] == chat and len(chat) == 1
            await page.screenshot(path=str(ARTEFACTS / "dashboard-requests-1300.png"), full_page=True)
        finally:
            await browser.close()


LEAD_KEY = "adm-browser-lead-0123456789"


async def test_a_team_made_in_the_console_pays_for_a_key_made_there_and_its_lead_sees_only_it(make_proxy, tmp_path):
    """The Teams view: the owner makes an organisation's team with a purse and a budget, then a
    key under it in Manage keys; the CLI's `teams list` and `keys list` see both; the team's
    lead (a team_admin) sees their team only, no control that moves money, and makes a user.
    Screenshots at desktop and phone widths, nothing wider than the screen."""
    import json
    import subprocess
    import sys

    proxy = await make_proxy({"admin": {"keys": [
        {"name": "ops", "key": ADMIN_KEY},
        {"name": "lead", "key": LEAD_KEY, "role": "team_admin", "teams": ["team_console"]}]},
        "auth": {"demo_key": True}})
    await proxy.ledger.create_level("org", {"level_id": "org_acme", "name": "Acme", "balance_micros": 10**9})
    await proxy.ledger.create_level("team", {"level_id": "team_other", "name": "other", "parent_id": "org_acme"})
    db = str(tmp_path / "ledger.db")

    def cli(*args: str) -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "proxy", args[0], "--db", db, *args[1:], "--json"],
                             capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    async def log_in(page, key: str) -> None:
        await page.goto(proxy.url + "/admin")
        await page.fill("#admin-key", key)
        await page.click("#login-button")
        await page.wait_for_selector("body[data-loaded]")

    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = await browser.new_page(viewport={"width": 1300, "height": 900})
            page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
            await log_in(page, ADMIN_KEY)
            await page.click("nav button[data-view=teams]")
            await page.wait_for_selector("body[data-teams-loaded]")
            await page.fill("#team-name", "console team")
            await page.fill("#team-id", "team_console")
            await page.select_option("#team-org", "org_acme")
            await page.fill("#team-balance", "40")
            await page.fill("#team-budget", "25")
            await page.select_option("#team-period", "weekly")
            await page.click("#team-create")
            await playwright_api.expect(page.locator("#teams-message")).to_contain_text("Created console team")
            (team,) = [t for t in cli("teams", "list") if t["level_id"] == "team_console"]
            assert (team["parent_id"], team["balance_micros"], team["budget_micros"], team["budget_period"]) == (
                "org_acme", 40_000_000, 25_000_000, "weekly")
            await page.click("nav button[data-view=manage]")
            await page.wait_for_selector("body[data-keys-loaded]")
            await page.fill("#new-name", "team-key")
            await page.select_option("#new-team", "team_console")
            await page.click("#create-button")
            await playwright_api.expect(page.locator("#manage-message")).to_contain_text("Created team-key")
            secret = await page.text_content("#secret")
            (made,) = [k for k in cli("keys", "list") if k["name"] == "team-key"]
            assert made["team_id"] == "team_console" and made["own_balance"] is False
            await proxy.openai(api_key=secret).responses.create(model="tiny-org/tiny-model", input="hi",
                                                               max_output_tokens=8)
            key_row = page.locator(f"tr[data-key-id={made['key_id']}]")
            await key_row.locator("button[data-action=edit]").click()
            await page.fill("#ke-rate", "120")
            await page.fill("#ke-tags", "laptop,ann")
            await page.click("#key-edit-save")
            await playwright_api.expect(page.locator("#manage-message")).to_contain_text("team-key: changed")
            (changed,) = [k for k in cli("keys", "list") if k["key_id"] == made["key_id"]]
            assert changed["rate_per_min"] == 120 and changed["tags"] == ["ann", "laptop"]
            await page.click("nav button[data-view=teams]")
            await page.wait_for_selector("body[data-teams-loaded]")
            row = await page.locator("tr[data-level-id=team_console]").text_content()
            assert "$40.00" not in row  # the request's debit came off the team's purse
            await page.locator("tr[data-level-id=team_console] button[data-action=edit]").click()
            await page.fill("#le-tpm", "50000")
            await page.fill("#le-models", "tiny-org/*")
            await page.click("#level-edit-save")
            await playwright_api.expect(page.locator("#teams-message")).to_contain_text("console team: done")
            (team,) = [t for t in cli("teams", "list") if t["level_id"] == "team_console"]
            assert team["tokens_per_min"] == 50000 and team["allowed_models"] == ["tiny-org/*"]
            assert team["budget_micros"] == 25_000_000 and team["budget_period"] == "weekly"  # untouched
            await page.screenshot(path=str(ARTEFACTS / "dashboard-teams-1300.png"), full_page=True)

            lead = await browser.new_page(viewport={"width": 420, "height": 900})
            await log_in(lead, LEAD_KEY)
            await lead.click("nav button[data-view=teams]")
            await lead.wait_for_selector("body[data-teams-loaded]")
            assert [r[0] for r in await _cells(lead, "teams-table")] == ["team_console"]
            assert await lead.is_hidden("#team-form") and await lead.locator("td.actions:visible").count() == 0
            assert await lead.is_visible("#user-form")
            await lead.fill("#user-name", "ann")
            await lead.click("#user-create")
            await playwright_api.expect(lead.locator("#teams-message")).to_contain_text("Created ann")
            assert [u["parent_id"] for u in cli("users", "list")] == ["team_console"]
            await lead.click("nav button[data-view=manage]")
            await lead.wait_for_selector("body[data-keys-loaded]")
            assert [r[0] for r in await _cells(lead, "manage-table")] == [made["key_id"]]
            assert await lead.is_hidden("#new-balance")
            for view in ("teams", "manage"):
                await lead.click(f"nav button[data-view={view}]")
                assert await lead.evaluate("document.documentElement.scrollWidth") <= 420, view
                await lead.screenshot(path=str(ARTEFACTS / f"dashboard-{view}-team-admin-420.png"), full_page=True)
        finally:
            await browser.close()
