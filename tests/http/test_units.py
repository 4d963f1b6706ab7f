"""One declared path: every route and every unit of work runs the phases its unit declares
(proxy.units), and no other. Tried from outside, as an attacker would: each phase is
probed by the request it must refuse (a revoked key, a spent rate, an oversize body, too many
items, a model the key may not use, a body the translation refuses, a spent balance), sent as
each unit of work (HTTP routes, socket messages, a warm-up, a compaction). A unit refuses the
probe exactly when it declares the phase; a unit without a driver here fails the test, so a new
route or message type cannot be added without being tried."""

from __future__ import annotations

import base64
import os
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import WSMsgType

from proxy import units
from proxy.http.routes import ROUTES, unit_for
from proxy.units import AUTH, BALANCE, BODY, LIMITS, MODELS, ORDER, SIZES, TRANSLATE
from proxy.ledger import KeyLimits

MODEL = "tiny-org/tiny-model"
SEAL = {"reasoning_seal": {"keys": {"k1": base64.urlsafe_b64encode(os.urandom(32)).decode()}}}
CONFIG = {
    **SEAL,
    "server": {"log_format": "json", "max_body_bytes": 200_000, "max_unbilled_body_bytes": 50_000,
               "max_input_items": 8},
    "websocket": {"max_message_bytes": 1_000_000},
    "compact": {"keep_recent_items": 8},
}


class Probe:
    """What one phase must refuse: the key to use and how to change the body."""

    def __init__(self, proxy, unit) -> None:
        self.proxy, self.unit = proxy, unit

    async def key(self, phase: str) -> tuple[str, str]:
        balance, limits = 10_000_000, KeyLimits()
        if phase == LIMITS:
            limits = KeyLimits(rate_per_min=1)
        elif phase == MODELS:
            limits = KeyLimits(allowed_models=["other-org/other-model"])
        elif phase == BALANCE:
            balance = 0
        secret, record = await self.proxy.ledger.create_key(f"probe-{phase}", balance, limits)
        return secret, record.key_id

    def body(self, phase: str) -> dict[str, Any]:
        family = self.unit.family
        if family:
            return _passthrough_body(family, phase, CONFIG["server"][self.unit.body_limit])
        body: dict[str, Any] = {"model": MODEL, "input": "Say hi."}
        if phase == SIZES:
            body["input"] = [{"type": "message", "role": "user", "content": "hi"}] * 9
        elif phase == TRANSLATE:
            body["temperature"] = "hot"
        elif phase == BODY:
            limit = CONFIG["server"][self.unit.body_limit]
            body["instructions"] = "x" * (limit + 1)
        return body


def _passthrough_body(family: str, phase: str, limit: int) -> dict[str, Any]:
    """The same probes in the shape of each pass-through family (proxy.units.PASSTHROUGH)."""
    many = CONFIG["server"]["max_input_items"] + 1
    if family in ("chat", "messages", "messages_count"):
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}]}
        if family == "messages":
            body["max_tokens"] = 16
        items = "messages"
    elif family == "completions":
        body, items = {"model": MODEL, "prompt": "Say hi.", "max_tokens": 16}, "prompt"
    else:
        body, items = {"model": MODEL, "input": "Say hi."}, "input"
    if phase == SIZES:
        body[items] = [{"role": "user", "content": "hi"}] * many if items == "messages" else ["hi"] * many
    elif phase == TRANSLATE:
        body["stream"] = "yes"  # refused by the pass-through's checks (proxy.protocol.passthrough)
    elif phase == BODY:
        body["user"] = "x" * (limit + 1)
    return body


# ----------------------------------------------------------------------------- drivers
# Each returns the statuses of its attempts: the probe is sent twice for LIMITS (a rate of one
# a minute refuses the second), once otherwise. A revoked key is revoked after what the unit
# needs before its body (a socket's handshake), so only the unit's own auth can stop it.

async def _http(proxy, http, method: str, path: str, phase: str, probe: Probe) -> list[int]:
    secret, key_id = await probe.key(phase)
    if phase == AUTH:
        await proxy.ledger.revoke(key_id)
    statuses = []
    for _ in range(2 if phase == LIMITS else 1):
        kwargs: dict[str, Any] = {"headers": {"Authorization": f"Bearer {secret}"}}
        if method == "POST":
            kwargs["data"] = orjson.dumps(probe.body(phase))
            kwargs["headers"]["Content-Type"] = "application/json"
        async with http.request(method, proxy.url + path, **kwargs) as resp:
            await resp.read()
            statuses.append(resp.status)
    return statuses


async def _socket(proxy, http, phase: str, probe: Probe, warmup: bool) -> list[int]:
    secret, key_id = await probe.key(phase)
    async with http.ws_connect(proxy.url + "/v1/responses", headers={"Authorization": f"Bearer {secret}"}) as ws:
        if phase == AUTH:
            await proxy.ledger.revoke(key_id)
        statuses = []
        for _ in range(2 if phase == LIMITS else 1):
            body = probe.body(phase)
            if warmup:
                body["generate"] = False
            await ws.send_bytes(orjson.dumps({"type": "response.create", **body}))
            while True:
                msg = await ws.receive()
                assert msg.type == WSMsgType.TEXT, msg
                event = orjson.loads(msg.data)
                if event["type"] == "error":
                    statuses.append(event["status"])
                    break
                if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    statuses.append(200)
                    break
        return statuses


async def _handshake(proxy, http, phase: str, probe: Probe) -> list[int]:
    secret, key_id = await probe.key(phase)
    if phase == AUTH:
        await proxy.ledger.revoke(key_id)
    statuses = []
    for _ in range(2 if phase == LIMITS else 1):
        try:
            async with http.ws_connect(proxy.url + "/v1/responses", headers={"Authorization": f"Bearer {secret}"}):
                statuses.append(101)
        except aiohttp.WSServerHandshakeError as exc:
            statuses.append(exc.status)
    return statuses


DRIVERS = {
    units.RESPONSES.name: lambda p, h, ph, pr: _http(p, h, "POST", "/v1/responses", ph, pr),
    units.INPUT_TOKENS.name: lambda p, h, ph, pr: _http(p, h, "POST", "/v1/responses/input_tokens", ph, pr),
    units.COMPACT.name: lambda p, h, ph, pr: _http(p, h, "POST", "/v1/responses/compact", ph, pr),
    units.KEYED.name: lambda p, h, ph, pr: _http(p, h, "GET", "/v1/models", ph, pr),
    units.WS_TURN.name: lambda p, h, ph, pr: _socket(p, h, ph, pr, warmup=False),
    units.WS_WARMUP.name: lambda p, h, ph, pr: _socket(p, h, ph, pr, warmup=True),
    units.WS_HANDSHAKE.name: _handshake,
    **{u.name: (lambda path: lambda p, h, ph, pr: _http(p, h, "POST", path, ph, pr))(u.name.split(" ", 1)[1])
       for u in units.PASSTHROUGH},
}
# Units no request reaches alone: the compaction's summary turn runs inside a compaction (its
# own test below); PUBLIC is what a path without a unit runs (tested below).
NESTED = {units.COMPACT_SUMMARY.name, units.PUBLIC.name,
          # another method on Anthropic's paths answers only its refusal (auth, then the 405), in
          # Anthropic's envelope: tests/integration/test_edge_anthropic_clients.py
          units.KEYED_ANTHROPIC.name}
REFUSALS = {AUTH: 401, LIMITS: 429, BODY: 413, SIZES: 400, MODELS: 403, TRANSLATE: 400, BALANCE: 402}


def test_every_unit_has_a_driver():
    assert {u.name for u in units.UNITS} == set(DRIVERS) | NESTED


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.mark.parametrize("phase", ORDER)
@pytest.mark.parametrize("unit", [u for u in units.UNITS if u.name in DRIVERS], ids=lambda u: u.name)
async def test_a_unit_refuses_each_probe_exactly_when_it_declares_the_phase(make_proxy, http, unit, phase):
    proxy = await make_proxy(CONFIG)
    statuses = await DRIVERS[unit.name](proxy, http, phase, Probe(proxy, unit))
    refused = REFUSALS[phase]
    if unit.runs(phase):
        assert statuses[-1] == refused, f"{unit.name} declares {phase} but answered {statuses}"
        assert all(s in (200, 101) for s in statuses[:-1]), statuses
    else:
        assert all(s in (200, 101) for s in statuses), f"{unit.name} does not declare {phase} but answered {statuses}"


class TriggerProbe(Probe):
    """The same probes, each request's input ending with a compaction_trigger item."""

    def body(self, phase: str) -> dict[str, Any]:
        body = super().body(phase)
        items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
        body["input"] = [*items, {"type": "compaction_trigger"}]
        return body


@pytest.mark.parametrize("phase", ORDER)
@pytest.mark.parametrize("unit", [units.RESPONSES, units.WS_TURN], ids=lambda u: u.name)
async def test_a_compaction_trigger_runs_every_phase_of_its_unit(make_proxy, http, unit, phase):
    """A compaction_trigger is an input item, not a path of its own: the request that carries it
    (HTTP or a socket's turn) refuses each probe exactly as its unit declares, balance included."""
    proxy = await make_proxy(CONFIG)
    statuses = await DRIVERS[unit.name](proxy, http, phase, TriggerProbe(proxy, unit))
    assert unit.phases == units.EVERY
    assert statuses[-1] == REFUSALS[phase], f"{unit.name} with a compaction_trigger answered {statuses} to {phase}"
    assert all(s in (200, 101) for s in statuses[:-1]), statuses
    if phase == LIMITS:  # the one answered: a billed compaction
        assert [r.status for r in await proxy.ledger.list_usage()] == ["completed"]


async def test_the_compaction_summary_turn_is_billed_but_takes_no_second_slot(make_proxy, http, sim):
    """COMPACT_SUMMARY: a spent balance stops it (402), a key allowed one request at a time
    still gets its compaction (the summary does not ask for a second slot)."""
    proxy = await make_proxy({**CONFIG, "compact": {"keep_recent_items": 1}})
    window = [{"type": "message", "role": "user", "content": f"turn {i}"} for i in range(4)]
    for balance, limits, expected in ((0, KeyLimits(), 402), (10_000_000, KeyLimits(concurrency=1), 200)):
        secret, _ = await proxy.ledger.create_key(f"compact-{expected}", balance, limits)
        sim.script({"text": "A summary."})
        async with http.post(proxy.url + "/v1/responses/compact", json={"model": MODEL, "input": window},
                             headers={"Authorization": f"Bearer {secret}"}) as resp:
            assert resp.status == expected, await resp.text()
    assert units.BALANCE in units.COMPACT_SUMMARY.phases and units.LIMITS not in units.COMPACT_SUMMARY.phases


async def test_every_route_of_the_app_is_in_the_route_table(make_proxy):
    proxy = await make_proxy(CONFIG)
    declared = {(r.method, r.path): r.handler for r in ROUTES}
    served = set()
    for route in proxy.app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method == "HEAD" or path.startswith("/admin") or path == "/metrics":
            continue  # HEAD mirrors its GET; the console's sub-app has its own guard; metrics are public
        assert declared.get((route.method, path)) is route.handler, f"{route.method} {path} is not in ROUTES"
        served.add((route.method, path))
    assert served == set(declared)


async def test_paths_without_a_unit_run_no_phase_and_guarded_paths_auth_any_method(make_proxy, http):
    proxy = await make_proxy(CONFIG)
    for path in ("/livez", "/healthz", "/readyz", "/openapi.json", "/metrics"):
        async with http.get(proxy.url + path) as resp:
            assert resp.status in (200, 503), path  # never 401
    async with http.put(proxy.url + "/v1/responses/compact", data=b"{}") as resp:
        assert resp.status == 405  # auth ran, and left the router's 405 to be told (middlewares.auth._refuse)
    assert unit_for("DELETE", "/v1/models").runs(AUTH)
    assert not unit_for("GET", "/nowhere").phases


async def test_a_window_with_nothing_to_summarize_is_free_and_bounded_as_free_work(make_proxy, http):
    """330 B of zstd used to buy 8 MB of echo: a compaction that calls no model is answered up
    to server.max_unbilled_body_bytes, like every unit nobody pays for."""
    import zstandard

    proxy = await make_proxy(CONFIG)
    window = [{"type": "message", "role": "user", "content": "y" * 60_000}]
    raw = zstandard.ZstdCompressor().compress(orjson.dumps({"model": MODEL, "input": window}))
    assert len(raw) < 1_000
    headers = {"Authorization": f"Bearer {proxy.api_key}", "Content-Type": "application/json",
               "Content-Encoding": "zstd"}
    async with http.post(proxy.url + "/v1/responses/compact", data=raw, headers=headers) as resp:
        assert resp.status == 413 and (await resp.json())["error"]["code"] == "request_too_large"
    window[0]["content"] = "short"
    async with http.post(proxy.url + "/v1/responses/compact", json={"model": MODEL, "input": window},
                         headers={"Authorization": f"Bearer {proxy.api_key}"}) as resp:
        assert resp.status == 200 and (await resp.json())["output"][0]["content"][0]["text"] == "short"
