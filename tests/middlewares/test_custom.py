"""The phases from config: an operator's own middleware by dotted path at a named point, and
every start-up failure as a one-line ConfigError (build_app) / exit status 2 (the CLI)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from proxy.app import build_app
from proxy.config.load import Config, ConfigError
from tests.support.paths import REPO as ROOT

CUSTOM = "tests.support.custom_mw:create"


async def _post(proxy, body, key=None):
    import aiohttp

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", data=orjson.dumps(body), headers=headers) as r:
            return r.status, r.headers, orjson.loads(await r.read())


@pytest.mark.parametrize("form", ["mapping", "named-section"])
async def test_custom_middleware_by_dotted_path(make_proxy, form):
    section = {"header": "x-custom", "value": "hello", "refuse_model": "banned-model"}
    if form == "mapping":
        overrides = {"middlewares": {"after_auth": [{CUSTOM: section}]}}
    else:
        overrides = {"middlewares": {"after_auth": [CUSTOM]}, CUSTOM: section}
    p = await make_proxy(overrides)
    status, headers, body = await _post(p, {"model": "tiny-org/tiny-model", "input": "hi"}, p.api_key)
    assert status == 200, body
    assert headers["x-custom"] == "hello"
    status, headers, body = await _post(p, {"model": "banned-model", "input": "hi"}, p.api_key)
    assert status == 403
    assert body["error"]["code"] == "model_refused"
    assert headers["x-custom"] == "hello"  # set at prepare: error responses carry it too
    # auth runs before the custom middleware: no key, no custom refusal
    status, _, body = await _post(p, {"model": "banned-model", "input": "hi"})
    assert status == 401


def _build(overrides) -> None:
    build_app(Config.from_dict(overrides))


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"middlewares": {"after_auth": ["nope"]}}, "'nope' is not \"package.module:factory\""),
        ({"middlewares": {"after_auth": ["tests.no_such_module:create"]}}, "cannot import 'tests.no_such_module'"),
        ({"middlewares": {"after_prepare": ["tests.support.custom_mw:nope"]}}, "has no callable 'nope'"),
        ({"middlewares": {"before_handler": ["tests.support.custom_mw:NOT_CALLABLE"]}}, "has no callable 'NOT_CALLABLE'"),
        ({"middlewares": {"after_auth": ["tests.support.custom_mw:not_a_factory"]}, "tests.support.custom_mw:not_a_factory": {}},
         "did not return a middleware"),
        ({"middlewares": {"after_auth": [CUSTOM]}}, "custom_mw.header must be a non-empty string"),
        ({"middlewares": {"after_auth": [{CUSTOM: {"header": "x", "explode": True}}]}},
         "rejected its config section: RuntimeError: the factory blew up on purpose"),
        ({"middlewares": {"after_auth": [{CUSTOM: ["not", "a", "mapping"]}]}}, "must be a mapping"),
        ({"middlewares": {"after_auth": "auth"}}, "middlewares.after_auth must be a list"),
        ({"middlewares": {"before_auth": []}}, "unknown key 'middlewares.before_auth'"),
        ({"pipeline": ["auth"]}, "pipeline is no longer a setting"),
        ({"auth": {"enabled": "no"}}, "auth.enabled must be true or false"),
        ({"limits": {"global_concurrency": 0}}, "limits.global_concurrency must be an integer >= 1 or null, not 0"),
        ({"limits": {"retry_after_s": "soon"}}, "limits.retry_after_s must be a number >= 0, not 'soon'"),
        ({"limits": {"burst": 3}}, "unknown key 'limits.burst'"),
        ({"auth": {"demo_key": "yes"}}, "auth.demo_key must be true or false"),
        ({"auth": {"static_keys": [{"name": "a", "sha256": "xyz"}]}}, "sha256 must be 64 hex digits"),
        ({"auth": {"static_keys": [{"name": "a", "key": "${RP_TEST_UNSET_VARIABLE}"}]}},
         "${RP_TEST_UNSET_VARIABLE} is not set (auth.static_keys[0].key)"),
        ({"auth": {"static_keys": [{"name": "a"}]}}, "needs exactly one of sha256 or key"),
        ({"tools": {"drop": "web_search"}}, "tools.drop must be a list of strings or null, not 'web_search'"),
        ({"tools": {"drop": ["web_search"], "refuse": ["web_search"]}}, "web_search is both dropped and refused"),
        ({"tools": {"refuse": ["function"]}}, "tools.refuse cannot name function"),
        ({"balance": {"hold_ttl_s": 0}}, "balance.hold_ttl_s must be a number > 0, not 0"),
        ({"balance": {"demo_balance_micros": -1}}, "balance.demo_balance_micros must be an integer >= 0, not -1"),
        ({"prices": {"big-model": {"input": 1}}}, "prices.big-model needs 'output'"),
        ({"notices": {"header": "x bad header"}}, "notices.header must be a valid HTTP header name"),
        ({"notices": {"max_bytes": 10}}, "notices.max_bytes must be an integer from 64 to 16384"),
        ({"stateless": {"previous_response_id": "maybe"}}, "stateless.previous_response_id must be"),
    ],
)
def test_startup_failures_are_config_errors(overrides, expected, monkeypatch):
    monkeypatch.delenv("RP_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(ConfigError) as info:
        _build(overrides)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_default_config_builds():
    from middlewares import PHASES
    from proxy.units import KEYED, RESPONSES

    app = build_app(Config.from_dict({}))
    assert len(app.middlewares) == 1  # the envelope; it runs the phases
    # auth, limits, prepare, balance (stateless and tools are prepare's body checks, notices a hook)
    assert app[PHASES].names(RESPONSES) == ["auth", "limits", "prepare", "balance"]
    assert app[PHASES].names(KEYED) == ["auth"]


@pytest.mark.parametrize("form", ["top-level", "after-serve"])
def test_cli_serve_bad_config_exits_2_with_one_line(tmp_path, form):
    bad = tmp_path / "bad.yaml"
    bad.write_text("middlewares: {after_auth: [nope]}\nledger: {path: %s}\n" % (tmp_path / "l.db"))
    args = ["--config", str(bad), "serve"] if form == "top-level" else ["serve", "--config", str(bad)]
    proc = subprocess.run([sys.executable, "-m", "proxy", *args, "--port", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "configuration error" in lines[0] and "'nope' is not" in lines[0]
