"""openai-agents (Python), unchanged: an agent with two function tools runs a multi-step
tool loop to a final answer through the proxy, scripted in the simulator."""

from __future__ import annotations

import orjson
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from tests.conftest import POLICIES, only

PIPELINE = only(*POLICIES)  # every policy: auth (demo key), balance...

set_tracing_disabled(True)


def make_agent(proxy, calls: list[tuple[str, str]]) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(("get_weather", city))
        return f"sunny and 21C in {city}"

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return f"14:05 in {city}"

    client = proxy.openai()
    return Agent(
        name="travel",
        instructions="Answer with the weather and the time.",
        model=OpenAIResponsesModel(model="tiny-org/tiny-model", openai_client=client),
        model_settings=ModelSettings(include_usage=True),
        tools=[get_weather, get_time],
    )


SCRIPT = (
    {"reasoning": "First the weather.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
    {"reasoning": "Now the time.", "tool_calls": [{"name": "get_time", "arguments": {"city": "Paris"}}]},
    {"text": "In Paris it is sunny and 21C, and the time is 14:05."},
)


def check_upstream(sim) -> None:
    assert len(sim.requests) == 3
    tools = {t["function"]["name"] for t in sim.requests[0]["tools"]}
    assert tools == {"get_weather", "get_time"}
    last = sim.requests[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert last[0]["content"] == "Answer with the weather and the time."
    assert last[2]["reasoning"] == "First the weather."
    assert last[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert orjson.loads(last[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert last[3] == {"role": "tool", "tool_call_id": last[2]["tool_calls"][0]["id"],
                       "content": "sunny and 21C in Paris"}
    assert last[4]["reasoning"] == "Now the time."
    assert last[5]["tool_call_id"] == last[4]["tool_calls"][0]["id"] and last[5]["content"] == "14:05 in Paris"


@pytest.mark.parametrize("pipeline", [PIPELINE, only("stateless")], ids=["full_chain", "stateless_only"])
async def test_agent_runs_a_two_tool_loop(sim, make_proxy, pipeline):
    proxy = await make_proxy(pipeline)
    calls: list[tuple[str, str]] = []
    sim.script(*SCRIPT)
    result = await Runner.run(make_agent(proxy, calls), "What is the weather and the time in Paris?", max_turns=6)
    assert result.final_output == "In Paris it is sunny and 21C, and the time is 14:05."
    assert calls == [("get_weather", "Paris"), ("get_time", "Paris")]
    assert len(result.raw_responses) == 3
    assert all(r.usage.output_tokens > 0 for r in result.raw_responses)
    check_upstream(sim)


async def test_agent_streamed_run(sim, make_proxy):
    proxy = await make_proxy(PIPELINE)
    calls: list[tuple[str, str]] = []
    sim.script(*SCRIPT)
    result = Runner.run_streamed(make_agent(proxy, calls), "What is the weather and the time in Paris?",
                                 max_turns=6)
    kinds = []
    async for event in result.stream_events():
        if event.type == "run_item_stream_event":
            kinds.append(event.item.type)
    assert result.final_output == "In Paris it is sunny and 21C, and the time is 14:05."
    assert calls == [("get_weather", "Paris"), ("get_time", "Paris")]
    assert kinds.count("tool_call_item") == 2 and kinds.count("tool_call_output_item") == 2
    assert kinds[-1] == "message_output_item"
    check_upstream(sim)
    # every stream the agent read ended with the spec's data: [DONE]: the agents SDK takes it
    assert len(proxy.spec.stream_ends) == 3
    assert all(end.endswith(b"}\n\ndata: [DONE]\n\n") for end in proxy.spec.stream_ends)
