"""A 10-turn tool loop where each turn's whole output goes back as input (the stateless
contract): the upstream must receive exactly the conversation it should, every turn.

    one system message, the user message, then per model turn one assistant message
    (its reasoning as vLLM reads it, `reasoning` where there was reasoning, its text, its
    tool_calls) followed by one tool message per call, paired by id.

Run with and without a seal key, streamed and not.
"""

from __future__ import annotations

import base64
import json
import os

import orjson
import pytest

from tests.support.sdk_check import validate_sdk_response
from tests.conftest import only

PIPELINE = only("stateless", "tools", "notices")
INSTRUCTIONS = "You are a careful agent. Use the tools."
QUESTION = "Plan a trip: check weather and time in ten cities."
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather for a city", "strict": False,
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "name": "get_time", "description": "Local time in a city", "strict": True,
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                    "additionalProperties": False}},
]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Pune", "Kyiv", "Doha", "Nice", "Bern"]


def plan(turn: int) -> dict:
    """Turn 0..8: tool calls (some parallel, some with text, some without reasoning); turn 9: the answer."""
    if turn == 9:
        return {"reasoning": "All cities checked; summarise.", "text": "Here is the plan for all cities."}
    city = CITIES[turn]
    script: dict = {"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]}
    if turn % 3 == 1:
        script["tool_calls"].append({"name": "get_time", "arguments": {"city": city}})  # parallel calls
    if turn % 4 != 2:
        script["reasoning"] = f"Turn {turn}: next I check {city}."
    if turn % 3 == 2:
        script["text"] = f"Checking {city} now."
    return script


def expected_assistant(script: dict, call_ids: list[str]) -> dict:
    msg: dict = {"role": "assistant", "content": script.get("text")}
    if script.get("reasoning"):
        msg["reasoning"] = script["reasoning"]
    msg["tool_calls"] = [
        {"id": cid, "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for cid, c in zip(call_ids, script["tool_calls"], strict=True)
    ]
    return msg


def normalise_upstream(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": {**tc["function"],
                                                   "arguments": json.dumps(orjson.loads(tc["function"]["arguments"]))}}
                               for tc in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("sealed", [False, True], ids=["no_key", "seal_key"])
async def test_ten_turn_tool_loop_replays_exactly(sim, make_proxy, monkeypatch, sealed, stream):
    monkeypatch.delenv("RESPONSES_PROXY_SEAL_KEY", raising=False)
    overrides: dict = dict(PIPELINE)
    if sealed:
        overrides["reasoning_seal"] = {"keys": {"k1": base64.urlsafe_b64encode(os.urandom(32)).decode()},
                                       "active": "k1"}
        overrides["responses"] = {"reasoning_in_clear": False}  # the reasoning comes back only sealed
    proxy = await make_proxy(overrides)
    client = proxy.openai()

    items: list[dict] = [{"role": "user", "content": QUESTION}]
    expected: list[dict] = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    for turn in range(10):
        script = plan(turn)
        sim.script(script)
        kwargs = dict(model="tiny-org/tiny-model", instructions=INSTRUCTIONS, input=items, tools=TOOLS,
                      include=["reasoning.encrypted_content"], parallel_tool_calls=True)
        if stream:
            async with client.responses.stream(**kwargs) as s:
                async for _ in s:
                    pass
                response = await s.get_final_response()
        else:
            response = await client.responses.create(**kwargs)
        validate_sdk_response(response.model_dump(mode="json"))

        # What the upstream got is the whole conversation so far, exactly.
        upstream = sim.requests[-1]
        assert normalise_upstream(upstream["messages"]) == expected, f"turn {turn}"
        assert sum(m["role"] == "system" for m in upstream["messages"]) == 1
        assert len(sim.requests) == turn + 1

        output = [item.model_dump(mode="json", exclude_none=True) for item in response.output]
        kinds = [i["type"] for i in output]
        reasoning = [i for i in output if i["type"] == "reasoning"]
        assert len(reasoning) == (1 if script.get("reasoning") else 0), kinds
        for r in reasoning:
            if sealed:
                assert r["encrypted_content"].startswith("rp2.k1.")
                assert script["reasoning"] not in json.dumps(r)
            else:
                assert not r.get("encrypted_content")
        if turn == 9:
            assert response.output_text == script["text"]
            assert kinds == ["reasoning", "message"]
            break

        calls = [i for i in output if i["type"] == "function_call"]
        assert [c["name"] for c in calls] == [c["name"] for c in script["tool_calls"]]
        assert len({c["call_id"] for c in calls}) == len(calls)
        # The client sends everything back, then one output per call.
        items += output
        for c in calls:
            items.append({"type": "function_call_output", "call_id": c["call_id"],
                          "output": f"{c['name']} result for {orjson.loads(c['arguments'])['city']}"})
        expected.append(expected_assistant(script, [c["call_id"] for c in calls]))
        for c in calls:
            expected.append({"role": "tool", "tool_call_id": c["call_id"],
                             "content": f"{c['name']} result for {orjson.loads(c['arguments'])['city']}"})

    final = sim.requests[-1]["messages"]
    assert [m["role"] for m in final].count("assistant") == 9
    assert [m["role"] for m in final].count("tool") == 9 + 3  # turns 1, 4, 7 made two calls
    with_reasoning = [m for m in final if m["role"] == "assistant" and "reasoning" in m]
    assert len(with_reasoning) == sum(1 for t in range(9) if plan(t).get("reasoning"))
