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
from tests.custom_mw import SEEN

PROBE = "tests.custom_mw:probe"
BODY = {"model": "tiny-org/tiny-model", "input": "hi"}


def probes() -> dict:
    return {point: [{PROBE: {"point": point}}] for point in ("after_auth", "after_prepare", "before_handler")}


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
