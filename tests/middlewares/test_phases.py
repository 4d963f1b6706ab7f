"""The fixed phases (middlewares/__init__.py): envelope -> auth -> limits -> prepare -> balance ->
handler. A custom middleware at each named point sees what that point promises; config.yaml
switches policies on and off but cannot reorder them; the old `pipeline` list is refused with a
pointer to its replacement."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from proxy.config.load import Config, ConfigError
from tests.conftest import POLICIES, only
from tests.support.custom_mw import SEEN

PROBE = "tests.support.custom_mw:probe"
BODY = {"model": "tiny-org/tiny-model", "input": "hi"}


def probes(**extra) -> dict:
    return {point: [{PROBE: {"point": point, **extra}}] for point in ("after_auth", "after_prepare", "before_handler")}


async def post(proxy, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json=body, headers=headers) as r:
            return r.status, orjson.loads(await r.read())


async def test_each_named_point_sees_what_it_promises(sim, make_proxy):
    proxy = await make_proxy({**only(*POLICIES, **probes())})
    status, answer = await post(proxy, BODY, proxy.api_key)
    assert status == 200, answer
    seen = {entry["point"]: entry for entry in proxy.app[SEEN]}
    # after_auth: the key is known, nothing of the body has been read.
    assert seen["after_auth"] == {"point": "after_auth", "key": "demo", "body_read": False, "translated": False,
                                  "held": False, "reserved_output": None}
    # after_prepare: the body was read and translated once; nothing is held yet.
    assert seen["after_prepare"] == {"point": "after_prepare", "key": "demo", "body_read": True, "translated": True,
                                     "held": False, "reserved_output": None}
    # before_handler: the balance is held and the output cap it reserved for is in the Translation.
    assert seen["before_handler"]["held"] is True and seen["before_handler"]["reserved_output"] >= 1
    assert [e["point"] for e in proxy.app[SEEN]] == ["after_auth", "after_prepare", "before_handler"]


async def test_no_point_runs_for_a_request_auth_refuses(sim, make_proxy):
    proxy = await make_proxy({**only(*POLICIES, **probes())})
    status, answer = await post(proxy, BODY, None)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert proxy.app[SEEN] == []


async def test_a_body_the_prepare_phase_refuses_never_reaches_later_points(sim, make_proxy):
    proxy = await make_proxy({**only(*POLICIES, **probes())})
    status, answer = await post(proxy, {**BODY, "previous_response_id": "resp_1"}, proxy.api_key)
    assert status == 400 and answer["error"]["code"] == "stateless_only"
    assert [e["point"] for e in proxy.app[SEEN]] == ["after_auth"]


async def test_policies_switched_off_do_not_run(sim, make_proxy):
    proxy = await make_proxy({**only(**probes())})
    status, answer = await post(proxy, BODY, None)  # no auth: no key needed
    assert status == 200, answer
    seen = {entry["point"]: entry for entry in proxy.app[SEEN]}
    assert seen["after_auth"]["key"] is None and seen["before_handler"]["held"] is False


def test_the_old_pipeline_list_is_refused_with_its_replacement():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"pipeline": ["stateless", "auth"]})
    assert "enabled" in str(info.value) and "middlewares" in str(info.value)


@pytest.mark.parametrize("entry", ["auth", "tools"])
def test_a_built_in_policy_cannot_be_placed_at_a_point(entry):
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"middlewares": {"after_auth": [entry]}})
    assert "enabled" in str(info.value)


async def test_a_point_runs_only_for_the_units_that_run_its_phase(sim, make_proxy):
    """One chain per unit, built from the phases it declares: a keyed read (GET /v1/models) runs
    auth and after_auth, never after_prepare nor before_handler (it reads no body, holds
    nothing); a free count (input_tokens) runs after_prepare, never before_handler (nothing is
    held). (Before: one chain served every route and each phase asked the unit itself; the
    custom points ran for every route, promising what was not there.)"""
    proxy = await make_proxy({**only(*POLICIES, **probes(every_path=True))})
    headers = {"Authorization": f"Bearer {proxy.api_key}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.url + "/v1/models", headers=headers) as r:
            assert r.status == 200
        assert [e["point"] for e in proxy.app[SEEN]] == ["after_auth"]
        proxy.app[SEEN].clear()
        async with http.post(proxy.url + "/v1/responses/input_tokens", headers=headers, json=BODY) as r:
            assert r.status == 200, await r.text()
        assert [e["point"] for e in proxy.app[SEEN]] == ["after_auth", "after_prepare"]


def test_each_unit_chain_holds_exactly_its_declared_phases(sim):
    """The chains as built: no unit's chain holds a phase it does not declare."""
    from aiohttp import web

    from middlewares import build_phases
    from proxy import state
    from proxy import units
    from proxy.http.routes import VARIANT_HANDLERS

    config = Config.from_dict(only(*POLICIES, **probes()))
    app = web.Application()
    app[state.CONFIG] = config
    phases = build_phases(config, app, VARIANT_HANDLERS)
    step_of = {"auth": "auth", "limits": "limits", "prepare": "body", "balance": "balance",
               "custom": None}
    for unit in units.UNITS:
        names = phases.names(unit)
        declared = {step_of[n] for n in names if n in step_of and step_of[n]}
        assert declared == unit.phases & {"auth", "limits", "body", "balance"}, (unit.name, names)
    # The compaction_trigger variants end with the route table's handler, not the route's.
    assert set(VARIANT_HANDLERS) == {v.name for u in units.UNITS for v in u.variants if v.compaction}
