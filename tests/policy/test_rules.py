"""One rule, one wording: the stateless guard and hosted-tool handling answer the same whether
the `stateless` and `tools` policies apply them or the translation does (a deployment with
those policies off), through real HTTP against the real simulator."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from tests.conftest import only

MODEL = "tiny-org/tiny-model"
FULL = None  # the default policies: stateless and tools run before the translation
BARE = only("notices")  # only the translation applies the rules
FN = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


async def post(proxy, body: dict) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {proxy.api_key}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", data=orjson.dumps(body), headers=headers) as r:
            return r.status, dict(r.headers), orjson.loads(await r.read())


async def both(make_proxy, body: dict) -> list[tuple[int, dict, dict]]:
    return [await post(await make_proxy(overrides), body) for overrides in (FULL, BARE)]


@pytest.mark.parametrize("extra", [
    {"previous_response_id": "resp_1"},
    {"background": True},
    {"prompt": {"id": "pmpt_1"}},
    {"input": [{"role": "user", "content": "a"}, {"type": "item_reference", "id": "msg_1"}]},
], ids=["previous_response_id", "background", "prompt", "item_reference"])
async def test_stateless_refusal_same_in_middleware_and_translation(make_proxy, sim, extra):
    (s1, _, full), (s2, _, bare) = await both(make_proxy, {"model": MODEL, "input": "hi", **extra})
    assert s1 == s2 == 400
    assert full == bare
    assert full["error"]["code"] == "stateless_only"


async def test_hosted_tools_notice_same_in_middleware_and_translation(make_proxy, sim):
    body = {"model": MODEL, "input": "hi", "tool_choice": {"type": "web_search"},
            "tools": [{"type": "web_search"}, {"type": "mcp", "server_label": "x"}, FN]}
    (s1, h1, _), (s2, h2, _) = await both(make_proxy, body)
    assert s1 == s2 == 200
    assert h1["x-token-notice"] == h2["x-token-notice"] == "tools left out: web_search, mcp"


@pytest.mark.parametrize("where", ["tools", "tool_choice"])
async def test_refused_tool_same_in_middleware_and_translation(make_proxy, sim, where):
    body = {"model": MODEL, "input": "hi", "tools": [FN]}
    if where == "tools":
        body["tools"] = [FN, {"type": "image_generation"}]
    else:
        body["tool_choice"] = {"type": "image_generation"}
    (s1, _, full), (s2, _, bare) = await both(make_proxy, body)
    assert s1 == s2 == 400
    assert full == bare
    assert full["error"]["code"] == "image_generation_unsupported"
