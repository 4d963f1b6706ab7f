"""Interoperability with clients that follow the Open Responses specification (openresponses.org)
and with model servers that serve Hugging Face org/name ids (issue 14)."""

from __future__ import annotations

import aiohttp
import orjson

from proxy.models import resolve_model
from proxy.simulator import Simulator

NO_AUTH = {"pipeline": ["stateless"]}
TIMEOUTS = {"connect": 2, "first_byte": 10, "idle": 10, "total": 60}


def sim_worker(name: str, sim: Simulator, models: list[str]) -> dict:
    return {"name": name, "url": sim.url, "dialect": "vllm", "models": models, "timeouts": TIMEOUTS}


async def post(proxy, body: dict, key: str | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", json=body,
                             headers={"Authorization": f"Bearer {key or proxy.api_key}"}) as resp:
            return resp.status, orjson.loads(await resp.read())


# --------------------------------------------------------------------------- model names


def test_resolve_model_rule():
    served = {"Qwen/Qwen3-8B", "tiny-model"}
    assert resolve_model("Qwen/Qwen3-8B", served) == "Qwen/Qwen3-8B"
    assert resolve_model("openai/tiny-model", served) == "tiny-model"
    assert resolve_model("hf/Qwen/Qwen3-8B", served) == "Qwen/Qwen3-8B"
    assert resolve_model("Qwen3-8B", served) is None  # nothing is ever added, only one segment stripped
    assert resolve_model("x/y/tiny-model", served) is None
    assert resolve_model("tiny-model", served.__contains__) == "tiny-model"


async def test_hugging_face_name_is_served_and_echoed(make_proxy):
    async with Simulator(models=("Qwen/Qwen3-8B",)) as qwen:
        proxy = await make_proxy(NO_AUTH, workers=[sim_worker("qwen", qwen, ["Qwen/Qwen3-8B"])])
        models = await proxy.openai().models.list()
        assert [m.id for m in models.data] == ["Qwen/Qwen3-8B"]
        status, body = await post(proxy, {"model": "Qwen/Qwen3-8B", "input": "hi"})
        assert status == 200, body
        assert body["model"] == "Qwen/Qwen3-8B" and body["status"] == "completed"
        assert qwen.requests[-1]["model"] == "Qwen/Qwen3-8B"
        # a vendor prefix in front of the org/name id is stripped (the exact name is served by nobody)
        status, body = await post(proxy, {"model": "hf/Qwen/Qwen3-8B", "input": "hi"})
        assert status == 200, body
        assert body["model"] == "hf/Qwen/Qwen3-8B"
        assert qwen.requests[-1]["model"] == "Qwen/Qwen3-8B"
        status, body = await post(proxy, {"model": "Qwen3-8B", "input": "hi"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert "'Qwen3-8B'" in body["error"]["message"]


async def test_exact_name_wins_over_the_stripped_one(make_proxy):
    async with Simulator(models=("org/m",)) as org, Simulator(models=("m",)) as bare:
        proxy = await make_proxy(NO_AUTH, workers=[sim_worker("org", org, ["org/m"]), sim_worker("bare", bare, ["m"])])
        assert (await post(proxy, {"model": "org/m", "input": "hi"}))[0] == 200
        assert len(org.requests) == 1 and not bare.requests
        status, body = await post(proxy, {"model": "other/m", "input": "hi"})
        assert status == 200 and body["model"] == "other/m"
        assert len(bare.requests) == 1 and bare.requests[-1]["model"] == "m"


async def test_key_allowed_models_follow_the_same_rule(make_proxy):
    async with Simulator(models=("Qwen/Qwen3-8B", "other/Qwen3-8B")) as qwen:
        proxy = await make_proxy(workers=[sim_worker("qwen", qwen, ["Qwen/Qwen3-8B", "other/Qwen3-8B"])])
        secret, _ = await proxy.ledger.create_key("k", balance_micros=10_000_000, allowed_models=["Qwen/Qwen3-8B"])
        assert (await post(proxy, {"model": "Qwen/Qwen3-8B", "input": "hi"}, secret))[0] == 200
        assert (await post(proxy, {"model": "hf/Qwen/Qwen3-8B", "input": "hi"}, secret))[0] == 200
        # the same last segment is another model: not allowed
        status, body = await post(proxy, {"model": "other/Qwen3-8B", "input": "hi"}, secret)
        assert status == 403 and body["error"]["code"] == "model_not_allowed"


def test_default_simulator_model_is_an_org_name_id():
    from proxy.config import DEFAULTS

    assert DEFAULTS["simulator"]["model"] == "tiny-org/tiny-model"
    assert DEFAULTS["workers"][0]["models"] == ["tiny-org/tiny-model"]
    assert tuple(Simulator().state.models) == ("tiny-org/tiny-model",)
