"""The built-in middlewares (auth, limits, tools, balance, notices), alone and as the whole
default chain, through real HTTP: a real proxy on loopback in front of the real simulator,
a real SQLite ledger file."""

from __future__ import annotations

import asyncio
import hashlib
import time

import orjson
import pytest

import middlewares.balance as balance_mw
from middlewares.balance import SETTLEMENTS
from middlewares.notices import header_value, sanitize
from proxy.ledger import KeyLimits
from proxy.ledger.pricing import cost_micros, price_for
from proxy.protocol.prompt import prompt_bound
from proxy.protocol.translate import translate_request
from tests.conftest import eventually as wait_for, only, sim_input, sse_events

# 1 micro per input and output token, 0.1 per cached token: costs are easy to check by hand.
PRICES = {"default": {"input": 1_000_000, "cached_input": 100_000, "output": 1_000_000}}
MODEL = "tiny-org/tiny-model"


async def call(http, proxy, body=None, *, key="default", headers=None, path="/v1/responses", method="POST"):
    """-> (status, headers, parsed JSON or SSE events)"""
    h = dict(headers or {})
    if key == "default":
        key = proxy.api_key
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    if body is None and method == "POST":
        body = {"model": MODEL, "input": "hello"}
    kwargs = {"data": orjson.dumps(body), "headers": {"Content-Type": "application/json", **h}} if body else {"headers": h}
    async with http.request(method, proxy.url + path, **kwargs) as r:
        raw = await r.read()
        if r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return r.status, r.headers, sse_events(raw)
        return r.status, r.headers, orjson.loads(raw) if raw else None


async def usage_of(ledger, request_id: str):
    return await wait_for(lambda: ledger.usage(request_id))


async def balance_of(ledger, key_id: str) -> int:
    return (await ledger.get_key(key_id)).balance_micros


# --------------------------------------------------------------------------- auth


async def test_auth_missing_header_is_401(make_proxy, http):
    p = await make_proxy()
    status, headers, body = await call(http, p, key=None)
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "authentication_error"
    assert headers.get("WWW-Authenticate") == "Bearer"


@pytest.mark.parametrize("header", ["Basic dXNlcjpwYXNz", "Bearer", "Bearer ", "Token sk-rp-abc", "sk-rp-abc"])
async def test_auth_malformed_header_is_401(make_proxy, http, header):
    p = await make_proxy()
    status, _, body = await call(http, p, key=None, headers={"Authorization": header})
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"


async def test_auth_unknown_key_is_401_and_not_echoed(make_proxy, http):
    p = await make_proxy()
    secret = "sk-rp-not-a-real-key-0123456789abcdef"
    status, _, body = await call(http, p, key=secret)
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    assert secret not in orjson.dumps(body).decode()
    assert "0123456789abcdef" not in body["error"]["message"]


async def test_auth_revoked_key_is_401(make_proxy, http):
    p = await make_proxy()
    secret, record = await p.ledger.create_key("soon-revoked", balance_micros=10_000_000)
    assert (await call(http, p, key=secret))[0] == 200
    await p.ledger.revoke(record.key_id)
    status, _, body = await call(http, p, key=secret)
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"


async def test_auth_cache_hit_costs_no_ledger_trip(make_proxy, http):
    p = await make_proxy()
    assert (await call(http, p, path="/v1/models", method="GET"))[0] == 200  # fills the cache
    ops = p.ledger.stats["ops"]
    for _ in range(5):
        assert (await call(http, p, path="/v1/models", method="GET"))[0] == 200
    assert p.ledger.stats["ops"] == ops


async def test_auth_cache_off_looks_up_every_time(make_proxy, http):
    p = await make_proxy({"auth": {"key_cache_ttl_s": 0}})
    assert (await call(http, p, path="/v1/models", method="GET"))[0] == 200
    ops = p.ledger.stats["ops"]
    for _ in range(3):
        assert (await call(http, p, path="/v1/models", method="GET"))[0] == 200
    assert p.ledger.stats["ops"] == ops + 3


async def test_auth_cache_revoke_elsewhere_takes_effect_within_the_ttl(make_proxy, http, tmp_path):
    """A revoke through another connection to the database (the CLI, another worker) is only
    seen once the cached entry's TTL has passed: the TTL is the revocation bound."""
    from proxy.ledger import open_ledger

    ttl = 1.0
    p = await make_proxy({"auth": {"key_cache_ttl_s": ttl}})
    secret, record = await p.ledger.create_key("revoked-elsewhere", balance_micros=10_000_000)
    assert (await call(http, p, key=secret, path="/v1/models", method="GET"))[0] == 200
    cached_at = time.monotonic()
    async with open_ledger({"path": str(tmp_path / "ledger.db")}) as cli:  # what `keys revoke` does
        await cli.revoke(record.key_id)
    status = (await call(http, p, key=secret, path="/v1/models", method="GET"))[0]
    if time.monotonic() - cached_at < ttl * 0.8:
        assert status == 200  # still cached: this process has not seen the revoke yet
    await asyncio.sleep(max(0.0, cached_at + ttl + 0.05 - time.monotonic()))  # not a wait: the cache's ttl passes
    status, _, body = await call(http, p, key=secret, path="/v1/models", method="GET")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, _ = await call(http, p, key=secret)
    assert status == 401  # and stays out (revoked keys are never cached)


async def test_auth_cache_revoke_and_limits_in_process_take_effect_at_once(make_proxy, http):
    p = await make_proxy({"auth": {"key_cache_ttl_s": 3600}})
    secret, record = await p.ledger.create_key("changing", balance_micros=10_000_000)
    assert (await call(http, p, key=secret))[0] == 200
    await p.ledger.set_limits(record.key_id, KeyLimits(allowed_models=["other-model"]))
    status, _, body = await call(http, p, key=secret)
    assert status == 403 and body["error"]["code"] == "model_not_allowed"
    await p.ledger.revoke(record.key_id)
    assert (await call(http, p, key=secret))[0] == 401


async def test_auth_cache_is_bounded_and_never_caches_unknown_keys(make_proxy, http):
    from middlewares.auth import KEY_CACHE

    p = await make_proxy({"auth": {"key_cache_size": 2}})
    cache = p.app[KEY_CACHE]
    for i in range(50):
        status, _, _ = await call(http, p, key=f"sk-rp-unknown-{i:032d}", path="/v1/models", method="GET")
        assert status == 401
    assert len(cache) == 0
    secrets = [(await p.ledger.create_key(f"k{i}", balance_micros=1))[0] for i in range(3)]
    for secret in secrets:
        assert (await call(http, p, key=secret, path="/v1/models", method="GET"))[0] == 200
    assert len(cache) == 2  # least recently used out
    for secret in secrets:
        assert secret not in repr(cache)


@pytest.mark.parametrize("bad", [-1, "5", True, 7200])
async def test_auth_cache_settings_are_checked(make_proxy, bad):
    from proxy.config.load import ConfigError

    with pytest.raises(ConfigError, match="key_cache_ttl_s"):
        await make_proxy({"auth": {"key_cache_ttl_s": bad}})


async def test_auth_guards_models_but_not_healthz(make_proxy, http):
    p = await make_proxy()
    assert (await call(http, p, key=None, path="/v1/models", method="GET"))[0] == 401
    status, _, body = await call(http, p, path="/v1/models", method="GET")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL]
    assert (await call(http, p, key=None, path="/healthz", method="GET"))[0] == 200
    assert (await call(http, p, key=None, path="/v1/responses/input_tokens"))[0] == 401


async def test_auth_model_not_allowed_is_403(make_proxy, http):
    p = await make_proxy()
    secret, _ = await p.ledger.create_key("limited", balance_micros=10_000_000,
                                          limits=KeyLimits(allowed_models=["other-model"]))
    status, _, body = await call(http, p, key=secret)
    assert status == 403
    assert body["error"]["code"] == "model_not_allowed"
    assert body["error"]["param"] == "model"
    ok_secret, _ = await p.ledger.create_key("vendor", balance_micros=10_000_000,
                                             limits=KeyLimits(allowed_models=["acme/tiny-org/tiny-model"]))
    assert (await call(http, p, key=ok_secret))[0] == 200


async def test_auth_static_keys_without_ledger_billing(make_proxy, http, monkeypatch):
    hashed_secret = "sk-static-hashed-000111222333"
    monkeypatch.setenv("RP_TEST_STATIC_KEY", "sk-static-from-env-444555666")
    p = await make_proxy({
        "auth": {"demo_key": False, "static_keys": [
            {"name": "ci", "sha256": hashlib.sha256(hashed_secret.encode()).hexdigest()},
            {"name": "ops", "key": "${RP_TEST_STATIC_KEY}", "allowed_models": ["other"]},
        ]},
    })
    status, _, body = await call(http, p, key=hashed_secret)
    assert status == 200, body
    assert body["status"] == "completed"
    status, _, body = await call(http, p, key="sk-static-from-env-444555666")
    assert status == 403 and body["error"]["code"] == "model_not_allowed"
    assert (await call(http, p, key="sk-static-hashed-000111222334"))[0] == 401
    assert await p.ledger.list_usage() == []  # a static key has no account: nothing billed


async def test_demo_key_printed_once_and_replaced_on_restart(make_proxy, http, capsys):
    p1 = await make_proxy()
    first = p1.api_key
    assert first.startswith("sk-rp-")
    out = capsys.readouterr().out
    assert out.count("demo key: ") == 1 and f"demo key: {first}\n" in out
    p2 = await make_proxy()  # the same database: the first demo key is revoked
    second = p2.api_key
    assert second != first
    assert (await call(http, p2, key=first))[0] == 401
    assert (await call(http, p2, key=second))[0] == 200
    demos = [k for k in await p2.ledger.list_keys() if k.name == "demo"]
    assert [k.revoked for k in demos] == [True, False]
    captured = capsys.readouterr()
    assert second not in captured.err and first not in captured.err  # never in logs
    assert captured.out.count("demo key: ") == 1


# --------------------------------------------------------------------------- limits


async def _slow_stream(http, p, key, seconds_per_delta=0.05, words=60):
    """A stream the simulator answers slowly; returns once the response headers are in."""
    body = {"model": MODEL, "stream": True, "max_output_tokens": 1000,
            "input": sim_input(text=" ".join(["word"] * words), delay=seconds_per_delta)}
    resp = await http.post(p.url + "/v1/responses", data=orjson.dumps(body),
                           headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert resp.status == 200
    await resp.content.readline()
    return resp


async def test_per_key_concurrency_429_with_retry_after(make_proxy, http, sim, limits_backend):
    p = await make_proxy({"limits": {"retry_after_s": 3, **limits_backend}})
    secret, _ = await p.ledger.create_key("one-at-a-time", balance_micros=10_000_000, limits=KeyLimits(concurrency=1))
    other, _ = await p.ledger.create_key("other", balance_micros=10_000_000)
    slow = await _slow_stream(http, p, secret, seconds_per_delta=0.02, words=40)
    status, headers, body = await call(http, p, key=secret)
    assert status == 429
    assert body["error"]["code"] == "concurrency_limit"
    assert headers["Retry-After"] == "3"
    assert (await call(http, p, key=other))[0] == 200  # another key is not affected
    events = sse_events(await slow.read())
    slow.release()
    assert events[-1]["type"] == "response.completed"
    await wait_for(lambda: _ok(call(http, p, key=secret)), timeout=2)  # the slot was given back


async def test_global_concurrency_429_limits_alone(make_proxy, http, sim, limits_backend):
    p = await make_proxy({**only("limits"), "limits": {"global_concurrency": 2, **limits_backend}})
    slow = [await _slow_stream(http, p, "ignored") for _ in range(2)]
    status, headers, body = await call(http, p, key=None)
    assert status == 429
    assert body["error"]["code"] == "concurrency_limit"
    assert body["error"]["type"] == "rate_limit_error"
    assert headers["Retry-After"] == "1"
    for resp in slow:
        resp.close()
    await wait_for(lambda: _ok(call(http, p, key=None)))


async def _ok(coro) -> bool:
    return (await coro)[0] == 200


async def test_slot_released_when_client_disconnects(make_proxy, http, sim, limits_backend):
    p = await make_proxy({"limits": limits_backend})
    secret, _ = await p.ledger.create_key("one", balance_micros=10_000_000, limits=KeyLimits(concurrency=1))
    slow = await _slow_stream(http, p, secret, seconds_per_delta=0.5)
    assert (await call(http, p, key=secret))[0] == 429
    slow.close()  # the client goes away mid-stream
    await wait_for(lambda: _ok(call(http, p, key=secret)), timeout=5)


async def test_rate_limit_per_key(make_proxy, http, limits_backend):
    p = await make_proxy({"limits": limits_backend})
    secret, _ = await p.ledger.create_key("two-a-minute", balance_micros=10_000_000, limits=KeyLimits(rate_per_min=2))
    assert (await call(http, p, key=secret))[0] == 200
    assert (await call(http, p, key=secret))[0] == 200
    status, headers, body = await call(http, p, key=secret)
    assert status == 429
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(headers["Retry-After"]) <= 30
    assert (await call(http, p))[0] == 200  # the demo key has no rate limit


# --------------------------------------------------------------------------- tools

HOSTED = [{"type": "web_search"}, {"type": "mcp", "server_label": "x", "server_url": "https://example.com"},
          {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]


async def test_hosted_tools_left_out_with_notice_json(make_proxy, http, sim):
    p = await make_proxy()
    status, headers, body = await call(http, p, {"model": MODEL, "input": "hi", "tools": HOSTED,
                                                 "tool_choice": {"type": "web_search"}})
    assert status == 200, body
    assert headers["x-token-notice"] == "tools left out: web_search, mcp"
    sent = sim.requests[-1]
    sent = sent.get("body", sent)
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_time"]
    assert sent.get("tool_choice") == "auto"
    assert [t["type"] for t in body["tools"]] == ["function"]


async def test_hosted_tools_notice_on_stream(make_proxy, http, sim):
    p = await make_proxy()
    status, headers, events = await call(http, p, {"model": MODEL, "input": "hi", "stream": True, "tools": HOSTED})
    assert status == 200
    assert headers["x-token-notice"] == "tools left out: web_search, mcp"
    assert events[-1]["type"] == "response.completed"


async def test_openai_sdk_sees_notice(make_proxy):
    p = await make_proxy()
    raw = await p.openai().responses.with_raw_response.create(
        model=MODEL, input="hi", tools=[{"type": "file_search", "vector_store_ids": ["vs_1"]}])
    assert raw.headers["x-token-notice"] == "tools left out: file_search"
    assert raw.parse().status == "completed"


async def test_image_generation_refused(make_proxy, http):
    p = await make_proxy()
    status, _, body = await call(http, p, {"model": MODEL, "input": "draw", "tools": [{"type": "image_generation"}]})
    assert status == 400
    assert body["error"]["code"] == "image_generation_unsupported"
    assert body["error"]["param"] == "tools[0].type"


async def test_duplicate_tool_names_after_flattening_refused(make_proxy, http):
    p = await make_proxy()
    tools = [{"type": "function", "name": "ns__f"},
             {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f"}]}]
    status, _, body = await call(http, p, {"model": MODEL, "input": "hi", "tools": tools})
    assert status == 400
    assert body["error"]["code"] == "duplicate_tool_name"
    tools = [{"type": "function", "name": "f"}, {"type": "custom", "name": "f"}]
    status, _, body = await call(http, p, {"model": MODEL, "input": "hi", "tools": tools})
    assert status == 400 and body["error"]["code"] == "duplicate_tool_name"


async def test_unknown_tool_type_named(make_proxy, http):
    p = await make_proxy()
    status, _, body = await call(http, p, {"model": MODEL, "input": "hi",
                                           "tools": [{"type": "teleport"}, {"type": "web_search"}]})
    assert status == 400
    assert "teleport" in body["error"]["message"]


async def test_tool_lists_configurable(make_proxy, http, sim):
    p = await make_proxy({**only("tools", "notices"), "tools": {"drop": ["web_search"], "refuse": ["mcp"]}})
    status, _, body = await call(http, p, {"model": MODEL, "input": "hi", "tools": HOSTED[1:2]}, key=None)
    assert status == 400 and body["error"]["code"] == "unsupported_tool"
    status, _, body = await call(http, p, {"model": MODEL, "input": "hi", "tools": [{"type": "file_search"}]}, key=None)
    assert status == 400 and "file_search" in body["error"]["message"]
    status, headers, _ = await call(http, p, {"model": MODEL, "input": "hi", "tools": HOSTED[:1]}, key=None)
    assert status == 200 and headers["x-token-notice"] == "tools left out: web_search"


async def test_tools_alone_drops_without_header(make_proxy, http, sim):
    p = await make_proxy(only("tools"))
    status, headers, _ = await call(http, p, {"model": MODEL, "input": "hi", "tools": HOSTED}, key=None)
    assert status == 200
    assert "x-token-notice" not in headers
    sent = sim.requests[-1]
    sent = sent.get("body", sent)
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_time"]


# --------------------------------------------------------------------------- notices


def test_sanitize_unit():
    assert sanitize("a\r\nX-Evil: 1", 2048) == "aX-Evil: 1"
    assert sanitize("caf\u00e9 \x00\x7f\t", 2048) == "caf? ???"
    assert len(sanitize("x" * 5000, 2048)) == 2048
    assert header_value(["one", "two", "one", ""], 2048) == "one; two"


async def test_notice_header_sanitised_end_to_end(make_proxy, http, sim):
    evil = "x-tool\r\nX-Evil: 1"
    p = await make_proxy({"tools": {"drop": [evil, "w\u00e9b_search"]}})
    tools = [{"type": evil}, {"type": "w\u00e9b_search"},
             {"type": "namespace", "name": "a\r\nX-Evil: 1", "tools": [{"type": "function", "name": "f"}]}]
    for stream in (False, True):
        status, headers, _ = await call(http, p, {"model": MODEL, "input": "hi", "tools": tools, "stream": stream})
        assert status == 200
        assert headers["x-token-notice"] == "tools left out: x-toolX-Evil: 1, w?b_search"
        assert "X-Evil" not in headers


async def test_notice_header_capped(make_proxy, http, sim):
    p = await make_proxy({**only("notices", after_auth=["tests.support.custom_mw:create"]),
                          "tests.support.custom_mw:create": {"header": "x-custom", "notice": "n" * 10_000},
                          "notices": {"max_bytes": 1024}})
    status, headers, _ = await call(http, p, key=None)
    assert status == 200
    assert len(headers["x-token-notice"]) == 1024 and headers["x-token-notice"].endswith("...")


async def test_notices_on_error_and_position_independent(make_proxy, http):
    p = await make_proxy({**only("notices", "stateless", "auth", "limits", "tools", "balance"),
                          "prices": PRICES})
    secret, _ = await p.ledger.create_key("poor", balance_micros=1)
    status, headers, body = await call(http, p, {"model": MODEL, "input": "hi", "tools": HOSTED}, key=secret)
    assert status == 402
    assert headers["x-token-notice"] == "tools left out: web_search, mcp"


async def test_notices_alone_carries_translation_notices(make_proxy, http):
    p = await make_proxy(only("notices"))
    status, headers, _ = await call(http, p, {"model": MODEL, "input": "hi", "tools": HOSTED[:1]}, key=None)
    assert status == 200
    assert headers["x-token-notice"].startswith("tools left out: web_search")


# --------------------------------------------------------------------------- balance


async def test_balance_alone_passes_through(make_proxy, http):
    p = await make_proxy(only("balance"))
    assert (await call(http, p, key=None))[0] == 200
    assert await p.ledger.list_usage() == []


async def test_402_when_balance_cannot_cover_input(make_proxy, http):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("poor", balance_micros=20)
    status, _, body = await call(http, p, {"model": MODEL, "input": "a long question " * 20}, key=secret)
    assert status == 402
    assert body["error"]["code"] == "insufficient_quota"
    assert body["error"]["type"] == "insufficient_quota"
    assert await p.ledger.available(record.key_id) == 20  # no hold left behind
    assert await p.ledger.list_usage(record.key_id) == []


async def test_cap_lowered_to_fit_balance_then_incomplete(make_proxy, http):
    p = await make_proxy({"prices": PRICES})
    body = {"model": MODEL, "input": "Tell me a story about rivers."}
    estimate = prompt_bound(translate_request(body).chat).tokens
    secret, record = await p.ledger.create_key("tight", balance_micros=estimate + 5)
    status, headers, answer = await call(http, p, body, key=secret)
    assert status == 200, answer
    assert headers["x-token-notice"] == "max_output_tokens lowered to 5 to fit the balance"
    assert answer["status"] == "incomplete"
    assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["max_output_tokens"] == 5
    assert answer["usage"]["output_tokens"] == 5
    usage = await usage_of(p.ledger, headers["x-request-id"])
    assert usage.status == "incomplete"
    assert usage.cost_micros == answer["usage"]["input_tokens"] + 5
    assert await balance_of(p.ledger, record.key_id) == estimate + 5 - usage.cost_micros


async def test_402_when_no_output_fits(make_proxy, http, sim):
    p = await make_proxy({"prices": PRICES})
    body = {"model": MODEL, "input": "hi"}
    chat = translate_request(body).chat
    async with http.post(sim.url + "/tokenize", json={"model": MODEL, "messages": chat["messages"]}) as r:
        counted = (await r.json())["count"]  # below the bound: the balance asks the worker before a 402
    secret, _ = await p.ledger.create_key("exact", balance_micros=counted)  # the input, and not one output token
    status, _, answer = await call(http, p, body, key=secret)
    assert status == 402 and answer["error"]["code"] == "insufficient_quota"


async def _check_settled(p, key_id, start, request_id, usage_json, status):
    usage = await usage_of(p.ledger, request_id)
    assert usage.status == status
    assert usage.input_tokens == usage_json["input_tokens"]
    assert usage.cached_tokens == usage_json["input_tokens_details"]["cached_tokens"]
    assert usage.output_tokens == usage_json["output_tokens"]
    assert usage.reasoning_tokens == usage_json["output_tokens_details"]["reasoning_tokens"]
    expected = cost_micros(price_for(PRICES, MODEL), usage.input_tokens, usage.cached_tokens, usage.output_tokens)
    assert usage.cost_micros == expected > 0
    assert await balance_of(p.ledger, key_id) == start - usage.cost_micros
    assert await p.ledger.available(key_id) == start - usage.cost_micros  # the hold is gone
    return usage


async def test_settle_non_stream_with_cached_price(make_proxy, http):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    body = {"model": MODEL, "input": "Please summarise this long shared prefix of words for caching. " * 8}
    start = 1_000_000
    for _ in range(2):
        status, headers, answer = await call(http, p, body, key=secret)
        assert status == 200
        usage = await _check_settled(p, record.key_id, start, headers["x-request-id"], answer["usage"], "completed")
        start -= usage.cost_micros
    cached = usage.cached_tokens
    assert cached > 0  # the second request hit the simulator's prefix cache
    assert usage.cost_micros == -(-((usage.input_tokens - cached) * 1_000_000 + cached * 100_000
                                    + usage.output_tokens * 1_000_000) // 1_000_000)


async def test_settle_stream_completed(make_proxy, http):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    status, headers, events = await call(http, p, {"model": MODEL, "input": "hi", "stream": True}, key=secret)
    assert status == 200 and events[-1]["type"] == "response.completed"
    await _check_settled(p, record.key_id, 1_000_000, headers["x-request-id"], events[-1]["response"]["usage"],
                         "completed")


async def test_settle_stream_incomplete(make_proxy, http):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    status, headers, events = await call(http, p, {"model": MODEL, "input": "hi", "stream": True,
                                                   "max_output_tokens": 3}, key=secret)
    assert events[-1]["type"] == "response.incomplete"
    usage = await _check_settled(p, record.key_id, 1_000_000, headers["x-request-id"],
                                 events[-1]["response"]["usage"], "incomplete")
    assert usage.output_tokens == 3


async def test_settle_stream_failed(make_proxy, http):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    body = {"model": MODEL, "stream": True, "input": sim_input(text="one two three four five six", error_after=3)}
    status, headers, events = await call(http, p, body, key=secret)
    assert status == 200 and events[-1]["type"] == "response.failed"
    usage = await usage_of(p.ledger, headers["x-request-id"])
    assert usage.status == "failed"
    assert usage.output_tokens == 3
    assert usage.cost_micros > 3  # the input estimate plus three output tokens
    assert await balance_of(p.ledger, record.key_id) == 1_000_000 - usage.cost_micros
    assert await p.ledger.available(record.key_id) == 1_000_000 - usage.cost_micros


async def test_settle_client_disconnect_mid_stream(make_proxy, http, sim):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    resp = await _slow_stream(http, p, secret, seconds_per_delta=0.05, words=200)
    request_id = resp.headers["x-request-id"]
    deltas = 0
    while deltas < 3:
        line = await resp.content.readline()
        deltas += line.startswith(b"event: response.output_text.delta")
    resp.close()
    usage = await usage_of(p.ledger, request_id)
    assert usage.status == "cancelled"
    assert 3 <= usage.output_tokens < 200
    assert usage.cost_micros > 0
    assert await balance_of(p.ledger, record.key_id) == 1_000_000 - usage.cost_micros
    assert await p.ledger.available(record.key_id) == 1_000_000 - usage.cost_micros


async def test_settle_client_disconnect_while_upstream_works(make_proxy, http, sim):
    """A non-stream request whose client leaves while the model server is still working:
    the upstream was reached, so the prompt is billed (no usage came: as the worker's
    tokenizer counts it)."""
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    body = {"model": MODEL, "input": sim_input(first_byte_delay=5)}
    chat = translate_request(body).chat
    async with http.post(sim.url + "/tokenize", json={"model": MODEL, "messages": chat["messages"]}) as r:
        estimate = (await r.json())["count"]
    assert estimate < prompt_bound(chat).tokens
    task = asyncio.ensure_future(call(http, p, body, key=secret))
    await wait_for(lambda: _true(sim.in_flight >= 1))
    task.cancel()  # closes the client connection
    usages = await wait_for(lambda: p.ledger.list_usage(record.key_id))
    assert usages[0].status == "cancelled"
    assert (usages[0].input_tokens, usages[0].output_tokens, usages[0].cost_micros) == (estimate, 0, estimate)
    assert await p.ledger.available(record.key_id) == 1_000_000 - estimate


async def _true(value) -> bool:
    return bool(value)


async def test_hold_released_when_upstream_not_reached(make_proxy, http, sim):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    status, _, _ = await call(http, p, {"model": "no-such-model", "input": "hi"}, key=secret)
    assert status == 404
    status, _, _ = await call(http, p, {"model": MODEL, "input": sim_input(status=500)}, key=secret)
    assert status == 502

    async def released():
        return await p.ledger.available(record.key_id) == 1_000_000

    await wait_for(released)
    assert await p.ledger.list_usage(record.key_id) == []
    assert await balance_of(p.ledger, record.key_id) == 1_000_000


async def test_input_tokens_not_billed(make_proxy, http):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    status, _, body = await call(http, p, path="/v1/responses/input_tokens", key=secret)
    assert status == 200 and body["input_tokens"] > 0
    assert await p.ledger.list_usage(record.key_id) == []


async def test_no_overdraft_under_200_concurrent_requests(make_proxy, http):
    p = await make_proxy({"prices": PRICES})
    body = {"model": MODEL, "max_output_tokens": 20, "input": sim_input(delay=0.02)}
    hold = prompt_bound(translate_request(body).chat).tokens + 20
    initial = 10 * hold
    secret, record = await p.ledger.create_key("ten", balance_micros=initial, limits=KeyLimits(concurrency=1000))
    results = await asyncio.gather(*(call(http, p, body, key=secret) for _ in range(200)))
    statuses = [r[0] for r in results]
    ok = statuses.count(200)
    assert ok >= 10 and statuses.count(402) >= 150 and ok + statuses.count(402) == 200, statuses
    for status, _, answer in results:
        if status == 402:
            assert answer["error"]["code"] == "insufficient_quota"
    usages = await wait_for(
        lambda: _usage_count(p.ledger, record.key_id, ok), timeout=10)
    final = await balance_of(p.ledger, record.key_id)
    assert final >= 0
    assert sum(u.cost_micros for u in usages) == initial - final
    assert all(u.debited_micros == u.cost_micros for u in usages)  # never clamped: nothing overdrawn

    async def nothing_held() -> bool:  # a lease's unspent part is given back once idle (balance.lease_idle_s)
        return await p.ledger.available(record.key_id) == await balance_of(p.ledger, record.key_id) == final

    await wait_for(nothing_held, timeout=30, what="every hold and lease of the key given back")


async def test_non_stream_request_costs_two_ledger_operations(make_proxy, http):
    """With the key cached: one hold_up_to before forwarding, one settle after."""
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("counted", balance_micros=1_000_000)
    assert (await call(http, p, key=secret, path="/v1/models", method="GET"))[0] == 200
    ops = p.ledger.stats["ops"]
    status, headers, _ = await call(http, p, key=secret)
    assert status == 200
    await wait_for(lambda: _true(not p.app[SETTLEMENTS].tasks))  # the settle task has finished
    assert p.ledger.stats["ops"] - ops == 2  # hold_up_to + settle
    assert await p.ledger.usage(headers["x-request-id"]) is not None


async def test_two_apps_do_not_share_settlements(make_proxy, http):
    """Each app tracks its own settlements: waiting for one app's (its shutdown, a test reading
    its ledger) neither waits for nor sees another app's ledger work."""
    one = await make_proxy({"prices": PRICES})
    two = await make_proxy({"prices": PRICES})
    secret, _ = await one.ledger.create_key("one", balance_micros=1_000_000)
    assert (await call(http, one, key=secret))[0] == 200
    mine, theirs = one.app[SETTLEMENTS], two.app[SETTLEMENTS]
    assert mine is not theirs and not theirs.tasks and not list(theirs.leases)
    stuck = asyncio.get_running_loop().create_future()
    mine.track(asyncio.ensure_future(stuck))  # ledger work of `one` that never finishes
    await asyncio.wait_for(balance_mw.wait_for_settlements(two.app), 10)
    assert len(mine.tasks) == 1
    stuck.set_result(None)
    await balance_mw.wait_for_settlements(one.app)
    assert not mine.tasks


async def test_partial_holds_under_200_concurrent_requests(make_proxy, http):
    """A balance that is not a multiple of one request's hold: the request that finds less
    than input + cap gets a lowered cap (hold_up_to holds what is left), none overdraws,
    and the costs add up to the balance decrease."""
    p = await make_proxy({"prices": PRICES})
    body = {"model": MODEL, "max_output_tokens": 20, "input": sim_input(delay=0.02)}
    estimate = prompt_bound(translate_request(body).chat).tokens
    hold = estimate + 20
    initial = 7 * hold + estimate + 9  # room for 7 whole requests and one with a cap of <= 9
    secret, record = await p.ledger.create_key("partial", balance_micros=initial, limits=KeyLimits(concurrency=1000))
    results = await asyncio.gather(*(call(http, p, body, key=secret) for _ in range(200)))
    statuses = [r[0] for r in results]
    ok = statuses.count(200)
    assert ok >= 8 and ok + statuses.count(402) == 200, statuses
    lowered = [r for r in results if r[0] == 200 and "x-token-notice" in r[1]]
    assert lowered, "no request got a lowered cap"
    for _, headers, answer in lowered:
        cap = answer["max_output_tokens"]
        assert 1 <= cap < 20
        assert headers["x-token-notice"] == f"max_output_tokens lowered to {cap} to fit the balance"
    usages = await wait_for(lambda: _usage_count(p.ledger, record.key_id, ok), timeout=10)
    final = await balance_of(p.ledger, record.key_id)
    assert final >= 0
    assert sum(u.cost_micros for u in usages) == initial - final
    assert all(u.debited_micros == u.cost_micros for u in usages)
    assert await p.ledger.available(record.key_id) == final


async def test_leased_key_drained_by_a_burst_never_overdraws(make_proxy, http):
    """Steady traffic gives the key a lease (holds and settles in memory); then a burst of
    200 drains it: the lease runs dry, requests fall back to exact holds (partial, then
    402), nothing is overdrawn and the balance falls by exactly the recorded costs."""
    p = await make_proxy({"prices": PRICES, "balance": {"lease_min_rate": 2}})
    body = {"model": MODEL, "max_output_tokens": 20, "input": sim_input(delay=0.02)}
    hold = prompt_bound(translate_request(body).chat).tokens + 20
    initial = 10 * hold + 7  # the bound is ~10x the real cost; near the end holds are sized by the worker
    secret, record = await p.ledger.create_key("leased", balance_micros=initial, limits=KeyLimits(concurrency=1000))
    for _ in range(3):  # steady traffic: a lease is granted
        results = await asyncio.gather(*(call(http, p, body, key=secret) for _ in range(8)))
        assert [r[0] for r in results] == [200] * 8
    holds = await p.ledger.holds(record.key_id)
    assert any(h.request_id.startswith("lease:") for h in holds), holds
    results = await asyncio.gather(*(call(http, p, body, key=secret) for _ in range(200)))
    statuses = [r[0] for r in results]
    assert statuses.count(200) >= 20 and statuses.count(402) >= 100, statuses
    assert statuses.count(200) + statuses.count(402) == 200
    await balance_mw.wait_for_settlements(p.app)
    usages = await p.ledger.list_usage(record.key_id, limit=1000)
    assert len(usages) == 24 + statuses.count(200)
    final = await balance_of(p.ledger, record.key_id)
    assert final >= 0
    assert sum(u.cost_micros for u in usages) == initial - final
    assert all(u.debited_micros == u.cost_micros for u in usages)  # never clamped: nothing overdrawn
    assert await p.ledger.holds() == []  # quiet: the lease was given back
    assert await p.ledger.available(record.key_id) == final


@pytest.mark.parametrize("section, linger", [({}, 0.02), ({"lease_commit_ms": 50}, 0.05)])
async def test_lease_commits_every_lease_commit_ms(make_proxy, http, section, linger):
    p = await make_proxy({"prices": PRICES, "balance": section})
    status, _, _ = await call(http, p, {"model": MODEL, "input": "hello"})
    assert status == 200
    (leases,) = [lz for lz in p.app[SETTLEMENTS].leases if lz.ledger is p.ledger]
    assert leases.linger_s == linger


@pytest.mark.parametrize("bad", [0, -5, "20", True])
def test_lease_commit_ms_must_be_a_positive_number(bad):
    from proxy.config.load import Config, ConfigError

    with pytest.raises(ConfigError, match="lease_commit_ms"):
        Config.from_dict({"balance": {"lease_commit_ms": bad}})


async def _usage_count(ledger, key_id, n):
    found = await ledger.list_usage(key_id, limit=1000)
    return found if len(found) == n else None


# --------------------------------------------------------------------------- the whole chain


async def test_whole_default_chain_with_openai_sdk(make_proxy):
    p = await make_proxy({"prices": PRICES})
    client = p.openai()
    answer = await client.responses.create(model=MODEL, input="hello there")
    assert answer.status == "completed"
    stream = await client.responses.create(model=MODEL, input="hello there", stream=True)
    types = [event.type async for event in stream]
    assert types[-1] == "response.completed"
    demo = next(k for k in await p.ledger.list_keys() if k.name == "demo" and not k.revoked)
    usages = await wait_for(lambda: _usage_count(p.ledger, demo.key_id, 2))
    assert {u.status for u in usages} == {"completed"}
    start = 100_000_000  # balance.demo_balance_micros
    assert start - sum(u.cost_micros for u in usages) == await balance_of(p.ledger, demo.key_id) < start
    import openai

    with pytest.raises(openai.AuthenticationError):
        await p.openai(api_key="sk-rp-wrong").responses.create(model=MODEL, input="hi")
