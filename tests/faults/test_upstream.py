"""Upstream faults, each played by the simulator, through the full default chain (auth,
limits, tools, balance, notices) with the SQLite ledger:

  the client gets a well-formed answer (failover, 502/503/504 in the envelope, or a
  response.failed event with retry hints), the hold is settled or released (no open hold,
  the usage row has the right status, audit() balances), and afterwards no task, pooled
  connection or file descriptor is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import orjson
import pytest

from proxy.state import UPSTREAMS
from tests.conftest import eventually, free_port
from tests.support.sdk_check import parse_sse

pytestmark = pytest.mark.slow

FAST = {"connect": 1, "first_byte": 0.6, "idle": 0.6, "total": 2.5}
REPEAT = 3  # each fault is injected REPEAT times per mode, so a leak of one per fault shows
TRACE = ('Traceback (most recent call last):\n  File "/opt/venv/lib/python3.11/site-packages/vllm/entrypoints/'
         'openai/serving_chat.py", line 412, in chat\nRuntimeError: CUDA out of memory')
HTML = ("<html><head><title>503 Service Unavailable</title></head><body><h1>upstream down</h1>"
        "<pre>" + TRACE + "</pre></body></html>")


def body(script: dict | None, *, stream: bool, text: str = "hello") -> dict:
    prompt = text if script is None else f"{text} SIM:{json.dumps(script)}"
    return {"model": "tiny-org/tiny-model", "input": prompt, "stream": stream, "max_output_tokens": 200}


async def call(proxy, payload: dict) -> tuple[int, dict, object]:
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", data=orjson.dumps(payload),
                             headers={"Authorization": f"Bearer {proxy.api_key}",
                                      "Content-Type": "application/json"},
                             timeout=aiohttp.ClientTimeout(total=15)) as resp:
            raw = await resp.read()
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                return resp.status, resp.headers.copy(), parse_sse(raw)
            return resp.status, resp.headers.copy(), orjson.loads(raw)


def assert_envelope(status: int, data, allowed: set[int]) -> dict:
    assert status in allowed, (status, data)
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}, data
    text = json.dumps(data)
    assert "Traceback" not in text and "/opt/venv" not in text and "<html" not in text, text
    return data["error"]


def assert_failed_stream(events: list[dict]) -> dict:
    assert events[0]["type"] == "response.created"
    last = events[-1]
    assert last["type"] == "response.failed", [e["type"] for e in events]
    response = last["response"]
    assert response["status"] == "failed" and response["error"]["message"]
    assert response["retry_after_ms"] and response["x_should_retry"] is True
    text = json.dumps(last)
    assert "Traceback" not in text and "/opt/venv" not in text, text
    return response


def resources(proxy) -> dict[str, int]:
    upstreams = proxy.app[UPSTREAMS].stats()
    return {
        "tasks": len([t for t in asyncio.all_tasks() if not t.done()]),
        "acquired": upstreams["in_use"],
        "pooled": upstreams["idle"],
        "fds": len(os.listdir("/proc/self/fd")),
    }


def quiet(proxy, sim, before: dict) -> bool:
    """Nothing in flight upstream, and the proxy back to `before`'s tasks and descriptors."""
    after = resources(proxy)
    return (sim.in_flight == 0 and after["acquired"] == 0 and after["tasks"] <= before["tasks"]
            and after["fds"] <= before["fds"] + 4)


async def settled(proxy, request_id: str, expect: str | None) -> None:
    """No open hold is left; the request has a usage row of status `expect` (None: released)."""
    ledger = proxy.ledger

    async def no_hold() -> bool:
        return not await ledger.holds()

    await eventually(no_hold, 5, what="no open hold")
    usage = await ledger.usage(request_id)
    if expect is None:
        assert usage is None, usage
    else:
        assert usage is not None and usage.status == expect, usage
        assert usage.cost_micros == usage.debited_micros > 0
    for key_id, balance, expected in await ledger.audit():
        assert balance == expected, key_id


# (name, script, stream, expectation) - expectation: an int set (envelope statuses), or "failed"
STREAM_FAULTS = [
    ("reset_mid_stream", {"text": "one two three four five six", "drop_after": 2}, "failed"),
    ("garbage_bytes", {"text": "one two three", "garbage": "\x00\xff not json {"}, "failed"),
    ("endless_line", {"endless_line": 3}, "failed"),  # 3 MiB without a newline
    ("stall_between_chunks", {"text": "one two three four", "stall_after": 2}, "failed"),
    ("error_after", {"text": "one two three four", "error_after": 2,
                     "error": {"message": "engine died\n" + TRACE, "code": 500}}, "failed"),
    ("error_first", {"error_first": {"message": "bad things " + TRACE, "code": 500}}, "failed"),
]
BEFORE_HEADER_FAULTS = [
    ("reset_before_headers", {"reset_before_headers": True}, {502}),
    ("stall_before_first_byte", {"first_byte_delay": 5}, {504}),
    ("html_5xx", {"status": 503, "body": HTML}, {502}),
    ("html_500_json_ct", {"status": 500, "body": TRACE, "content_type": "application/json"}, {502}),
    ("garbage_json_body", {"garbage": True}, {502}),
]


async def test_stream_faults_fail_cleanly_and_settle(sim, make_proxy):
    proxy = await make_proxy(workers=[{"name": "sim", "url": sim.url, "models": ["tiny-org/tiny-model"], "timeouts": FAST}])
    status, _, _ = await call(proxy, body(None, stream=True))  # warm the pool
    assert status == 200
    before = resources(proxy)
    injected = 0
    for _ in range(REPEAT):
        for name, script, _expect in STREAM_FAULTS:
            status, headers, events = await call(proxy, body(script, stream=True))
            assert status == 200, (name, events)
            response = assert_failed_stream(events)
            injected += 1
            await settled(proxy, headers["x-request-id"], "failed")
            assert response["id"] == "resp_" + headers["x-request-id"].removeprefix("req_")
    await eventually(lambda: quiet(proxy, sim, before), what="the faulted streams' resources given back")
    after = resources(proxy)
    assert sim.in_flight == 0
    assert after["acquired"] == 0, after
    assert after["tasks"] <= before["tasks"], (before, after)
    assert after["fds"] <= before["fds"] + 4, (before, after)
    assert injected == REPEAT * len(STREAM_FAULTS)
    status, _, events = await call(proxy, body(None, stream=True))  # still serving
    assert status == 200 and events[-1]["type"] == "response.completed"


@pytest.mark.parametrize("stream", [True, False])
async def test_faults_before_the_headers_answer_in_the_envelope(sim, make_proxy, stream):
    proxy = await make_proxy(workers=[{"name": "sim", "url": sim.url, "models": ["tiny-org/tiny-model"], "timeouts": FAST}])
    assert (await call(proxy, body(None, stream=stream)))[0] == 200
    before = resources(proxy)
    for _ in range(REPEAT):
        for name, script, allowed in BEFORE_HEADER_FAULTS:
            if stream and name == "garbage_json_body":
                continue  # on a stream garbage comes after the headers (STREAM_FAULTS)
            status, headers, data = await call(proxy, body(script, stream=stream))
            assert status != 200, (name, data)
            error = assert_envelope(status, data, allowed | {503})
            assert error["code"], (name, error)
            await settled(proxy, headers["x-request-id"], None)  # released: nothing was produced
    # the stalled upstream requests notice the closed connection
    await eventually(lambda: quiet(proxy, sim, before), what="the stalled upstream requests ended")
    after = resources(proxy)
    assert sim.in_flight == 0
    assert after["acquired"] == 0, after
    assert after["tasks"] <= before["tasks"], (before, after)
    assert after["fds"] <= before["fds"] + 4, (before, after)


async def test_non_stream_mid_answer_faults(sim, make_proxy):
    proxy = await make_proxy(workers=[{"name": "sim", "url": sim.url, "models": ["tiny-org/tiny-model"], "timeouts": FAST}])
    # (the simulator drops and stalls a JSON answer before its headers: nothing to bill; an
    # endless body came after a 200, so the worker did work: billed within the hold, as a stream
    # that fails mid-way is)
    cases = [({"text": "a b c d", "drop_after": 2}, {502}, None), ({"text": "a b c d", "stall_after": 1}, {504}, None),
             ({"endless_line": True}, {502, 504}, "failed")]
    for script, allowed, billed in cases:
        started = time.monotonic()
        status, headers, data = await call(proxy, body(script, stream=False))
        assert_envelope(status, data, allowed)
        assert time.monotonic() - started < 10
        await settled(proxy, headers["x-request-id"], billed)
    await eventually(lambda: sim.in_flight == 0, what="the upstream requests ended")
    assert sim.in_flight == 0


async def test_connection_refused_fails_over_then_502(sim, make_proxy):
    dead = f"http://127.0.0.1:{free_port()}"
    workers = [{"name": "dead", "url": dead, "models": ["tiny-org/tiny-model"], "timeouts": FAST},
               {"name": "sim", "url": sim.url, "models": ["tiny-org/tiny-model"], "timeouts": FAST}]
    proxy = await make_proxy(workers=workers)
    for stream in (False, True):
        for _ in range(4):  # whichever worker is tried first, the answer comes from the live one
            status, headers, data = await call(proxy, body(None, stream=stream))
            assert status == 200, data
            await settled(proxy, headers["x-request-id"], "completed")
    only_dead = await make_proxy(workers=[workers[0]])
    for stream in (False, True):
        status, headers, data = await call(only_dead, body(None, stream=stream))
        assert_envelope(status, data, {502, 503})
        await settled(only_dead, headers["x-request-id"], None)


async def test_reset_before_headers_fails_over(sim, make_proxy):
    from proxy.simulator.server import Simulator

    async with Simulator() as broken:
        workers = [{"name": "broken", "url": broken.url, "models": ["tiny-org/tiny-model"], "timeouts": FAST},
                   {"name": "sim", "url": sim.url, "models": ["tiny-org/tiny-model"], "timeouts": FAST}]
        proxy = await make_proxy(workers=workers)
        for _ in range(4):
            broken.script({"reset_before_headers": True})
            status, headers, data = await call(proxy, body(None, stream=True))
            assert status == 200 and data[-1]["type"] == "response.completed"
            await settled(proxy, headers["x-request-id"], "completed")
            broken.state.queue.clear()


async def test_endless_non_stream_body_is_cut_off_not_buffered(sim, make_proxy):
    """A JSON answer that never ends (or an endless error page) is refused at a bound, long
    before the total timeout, instead of being buffered in memory until then."""
    slow_total = {"connect": 1, "first_byte": 30, "idle": 30, "total": 60}
    proxy = await make_proxy(workers=[{"name": "sim", "url": sim.url, "models": ["tiny-org/tiny-model"],
                                       "timeouts": slow_total}])
    for script, billed in (({"endless_line": True}, "failed"), ({"status": 500, "body": "x" * (4 << 20)}, None)):
        started = time.monotonic()
        sim.script(script)
        status, headers, data = await call(proxy, body(None, stream=False))
        assert_envelope(status, data, {502})
        assert time.monotonic() - started < 10, script
        # a 200 whose body never ends is work the worker started: billed within the hold; an error
        # page is not
        await settled(proxy, headers["x-request-id"], billed)
    await eventually(lambda: sim.in_flight == 0, what="the upstream requests ended")
    assert sim.in_flight == 0
