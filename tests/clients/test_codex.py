"""Codex CLI end to end: the real `codex exec` (pinned, from npm) -> the proxy (every
policy on, demo key) -> the simulator, scripted per request.

Codex is installed once into .cache/codex/<version> (git-ignored) by tests/clients/codex.py.
These tests skip only when that npm install is impossible (no npm, no network); the
reason is printed. Everything else is a failure.
"""

from __future__ import annotations

import base64
import gzip
import json
import os

import aiohttp
import orjson
import pytest
import zstandard

from proxy.protocol.compaction import SUMMARY_HEADER
from tests.clients.capture import CAPTURED, ENTRY as CAPTURE
from tests.clients.codex import CodexUnavailable, EgressTrap, ensure_codex, run_codex, write_codex_home
from tests.support.sdk_check import parse_sse
from tests.conftest import POLICIES, only

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# The default chain (auth with the demo key, balance...), with the capture in front.
PIPELINE = only(*POLICIES, after_auth=[CAPTURE])
# Codex offers apply_patch as a custom (freeform, lark grammar) tool only for models of its
# bundled catalog; "gpt-5.5" is one in 0.171. Unknown names ("tiny-org/tiny-model") get function tools.
CATALOG_MODEL = "gpt-5.5"
MODELS = ("tiny-org/tiny-model", CATALOG_MODEL)


@pytest.fixture(scope="session")
def codex_cmd() -> list[str]:
    try:
        return ensure_codex()
    except CodexUnavailable as exc:
        print(f"\nCodex CLI tests skipped: {exc}")
        pytest.skip(f"Codex CLI unavailable: {exc}")


@pytest.fixture
async def sim():
    # Overrides conftest's: this simulator also serves the catalog model name.
    from proxy.simulator.server import Simulator

    async with Simulator(models=MODELS) as simulator:
        yield simulator


def _key() -> str:
    return base64.urlsafe_b64encode(os.urandom(32)).decode()


@pytest.fixture
def start(sim, make_proxy, tmp_path, codex_cmd):
    """start(model, overrides, extra=, provider_extra=) -> (proxy, workdir, run); run(prompt, api_key=None)
    runs codex exec (`extra`, `provider_extra`: more lines of its config.toml, tests/clients/codex.py)."""

    async def go(model: str = "tiny-org/tiny-model", overrides: dict | None = None, *, extra: str = "",
                 provider_extra: str = ""):
        workers = [{"name": "sim", "url": sim.url, "dialect": "vllm", "models": list(MODELS),
                    "timeouts": {"connect": 2, "first_byte": 20, "idle": 20, "total": 60}}]
        proxy = await make_proxy({**PIPELINE, **(overrides or {})}, workers=workers)
        home = write_codex_home(tmp_path, base_url=proxy.base_url, model=model, extra=extra,
                                provider_extra=provider_extra)
        workdir = tmp_path / "work"
        workdir.mkdir(exist_ok=True)

        async def run(prompt: str, *, api_key: str | None = None, timeout: float = 150):
            async with EgressTrap() as trap:
                result = await run_codex(codex_cmd, home, workdir, prompt, api_key=api_key or proxy.api_key,
                                         timeout=timeout, egress_port=trap.port)
            # The config keeps Codex on the proxy: no update check, analytics, plugins... anywhere else.
            assert trap.attempts == [], f"Codex tried to reach beyond the proxy: {trap.attempts}"
            return result

        return proxy, workdir, run

    return go


def captured(proxy) -> list[dict]:
    return proxy.app[CAPTURED]


def tool_names(body: dict) -> dict[str, dict]:
    return {t.get("name") or t["type"]: t for t in body.get("tools") or []}


async def test_codex_runs_a_shell_command_through_the_proxy(sim, start):
    proxy, workdir, run = await start()
    command = "printf made-by-codex > made.txt"
    sim.script(
        {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": command}}]},
        {"text": "I created made.txt."},
    )
    result = await run("Create a file named made.txt containing made-by-codex.")
    assert result.returncode == 0, result.explain()

    # The tool really ran, in the working folder, and the turn completed.
    assert (workdir / "made.txt").read_text() == "made-by-codex", result.explain()
    executions = result.items("command_execution")
    assert executions and executions[0]["exit_code"] == 0 and "made.txt" in executions[0]["command"]
    assert [m["text"] for m in result.items("agent_message")] == ["I created made.txt."]
    assert any(e.get("type") == "turn.completed" for e in result.events), result.explain()
    assert not [e for e in result.events if e.get("type") in ("turn.failed", "error")], result.explain()

    # What Codex sent: the shape the proxy must accept unchanged.
    first = captured(proxy)[0]
    body = first["body"]
    assert first["status"] in (200, "client_closed")
    # Codex read streams that end with the Open Responses spec's data: [DONE], and took them
    assert all(r["end"].endswith(b"}\n\ndata: [DONE]\n\n") for r in captured(proxy)), captured(proxy)[0]["end"]
    assert body["stream"] is True and body["store"] is False
    assert "reasoning.encrypted_content" in body["include"]
    assert body.get("instructions") is None and body.get("previous_response_id") is None
    assert first["headers"]["Accept"] == "text/event-stream"
    tools = tool_names(body)
    assert tools["exec_command"]["type"] == "function" and tools["exec_command"]["strict"] is False
    assert "cmd" in tools["exec_command"]["parameters"]["properties"]
    assert any(t["type"] == "namespace" for t in body["tools"])
    assert any(t["type"] == "web_search" for t in body["tools"])
    roles = [i.get("role") for i in body["input"] if i.get("type") == "message"]
    assert roles[0] == "developer"

    # Two model requests; the second replays the call (with id and status) and its output.
    assert len(sim.requests) == 2 and len(captured(proxy)) == 2
    replay = captured(proxy)[1]["body"]["input"]
    call = next(i for i in replay if i.get("type") == "function_call")
    assert call["id"].startswith("fc_") and call["status"] == "completed" and call["name"] == "exec_command"
    output = next(i for i in replay if i.get("type") == "function_call_output")
    assert output["call_id"] == call["call_id"] and isinstance(output["output"], str)

    upstream = sim.requests[1]
    assert upstream["messages"][0]["role"] == "system"
    assert sum(m["role"] == "system" for m in upstream["messages"]) == 1
    assistant = next(m for m in upstream["messages"] if m["role"] == "assistant")
    assert assistant["tool_calls"][0]["function"]["name"] == "exec_command"
    assert orjson.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"cmd": command}
    tool_msg = upstream["messages"][-1]
    assert tool_msg["role"] == "tool" and tool_msg["tool_call_id"] == assistant["tool_calls"][0]["id"]
    # Hosted tools (web_search) are left out; namespace tools are flattened.
    upstream_tools = {t["function"]["name"] for t in upstream["tools"]}
    assert "exec_command" in upstream_tools and "web_search" not in upstream_tools
    assert any("__" in name for name in upstream_tools)

    # Codex compresses request bodies (zstd, or gzip) when it talks to OpenAI: the same second
    # request, byte for byte, compressed, with Codex's own headers, is answered the same way.
    second = captured(proxy)[1]
    raw_body = orjson.dumps(second["body"])
    headers = {k: v for k, v in second["headers"].items()
               if k.lower() not in ("host", "content-length", "content-encoding")}
    for encoding, packed in (("zstd", zstandard.ZstdCompressor().compress(raw_body)),
                             ("gzip", gzip.compress(raw_body))):
        sim.script({"text": f"again via {encoding}"})
        async with aiohttp.ClientSession() as http:
            async with http.post(proxy.base_url + "/responses", data=packed,
                                 headers={**headers, "Content-Encoding": encoding}) as resp:
                assert resp.status == 200, await resp.text()
                events = parse_sse(await resp.read())
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["output"][-1]["content"][0]["text"] == f"again via {encoding}"
        assert sim.requests[-1]["messages"] == upstream["messages"]


async def test_codex_reasoning_is_replayed_sealed(sim, start):
    # responses.reasoning_in_clear: false -> with a seal the reasoning reaches the client only sealed.
    proxy, workdir, run = await start(overrides={"reasoning_seal": {"keys": {"k1": _key()}, "active": "k1"},
                                                 "responses": {"reasoning_in_clear": False}})
    thought = "The user wants a file; I will write it with printf and then confirm."
    sim.script(
        {"reasoning": thought, "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "printf x > r.txt"}}]},
        {"reasoning": "It worked.", "text": "Done."},
    )
    result = await run("Write r.txt")
    assert result.returncode == 0, result.explain()
    assert (workdir / "r.txt").exists(), result.explain()
    assert len(sim.requests) == 2, result.explain()

    # Codex replayed the reasoning item as it came: a proxy ciphertext, and nothing in clear.
    replay = captured(proxy)[1]["body"]["input"]
    reasoning = [i for i in replay if i.get("type") == "reasoning"]
    assert len(reasoning) == 1, replay
    sealed = reasoning[0]["encrypted_content"]
    assert isinstance(sealed, str) and sealed.startswith("rp2.k1.")
    assert thought not in json.dumps(reasoning[0])
    assert thought not in result.stdout, "the client only ever sees the ciphertext"

    # The upstream got the reasoning text back, in the assistant turn that made the call.
    assistant = next(m for m in sim.requests[1]["messages"] if m["role"] == "assistant")
    assert assistant["reasoning"] == thought
    assert assistant["tool_calls"][0]["function"]["name"] == "exec_command"


async def test_codex_reasoning_without_a_seal_key_travels_in_clear(sim, start, monkeypatch):
    monkeypatch.delenv("RESPONSES_PROXY_SEAL_KEY", raising=False)
    proxy, workdir, run = await start()
    thought = "Plain reasoning that the client may read."
    sim.script(
        {"reasoning": thought, "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "true"}}]},
        {"text": "ok"},
    )
    result = await run("Run true")
    assert result.returncode == 0, result.explain()
    replay = captured(proxy)[1]["body"]["input"]
    reasoning = next(i for i in replay if i.get("type") == "reasoning")
    assert not reasoning.get("encrypted_content")
    assert thought in json.dumps(reasoning)
    assistant = next(m for m in sim.requests[1]["messages"] if m["role"] == "assistant")
    assert assistant["reasoning"] == thought


async def test_codex_apply_patch_custom_tool_edits_a_file(sim, start):
    proxy, workdir, run = await start(CATALOG_MODEL)
    (workdir / "hello.txt").write_text("hello\nworld\n")
    patch = "*** Begin Patch\n*** Update File: hello.txt\n@@\n hello\n-world\n+proxy\n*** End Patch\n"
    sim.script(
        {"tool_calls": [{"name": "apply_patch", "arguments": {"input": patch}}]},
        {"text": "Patched hello.txt."},
    )
    result = await run("Replace world with proxy in hello.txt")
    assert result.returncode == 0, result.explain()

    body = captured(proxy)[0]["body"]
    apply_patch = tool_names(body)["apply_patch"]
    assert apply_patch["type"] == "custom" and apply_patch["format"]["syntax"] == "lark"
    assert (workdir / "hello.txt").read_text() == "hello\nproxy\n", result.explain()
    assert result.items("file_change"), result.explain()
    assert [m["text"] for m in result.items("agent_message")] == ["Patched hello.txt."]

    # Upstream: a function with one string parameter `input`; the replay pairs call and output.
    fn = next(t["function"] for t in sim.requests[0]["tools"] if t["function"]["name"] == "apply_patch")
    assert fn["parameters"]["required"] == ["input"]
    replay = captured(proxy)[1]["body"]["input"]
    call = next(i for i in replay if i.get("type") == "custom_tool_call")
    assert call["input"] == patch
    out = next(i for i in replay if i.get("type") == "custom_tool_call_output")
    assert out["call_id"] == call["call_id"]
    messages = sim.requests[1]["messages"]
    assistant = next(m for m in messages if m["role"] == "assistant")
    assert orjson.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"input": patch}
    assert messages[-1]["role"] == "tool" and messages[-1]["tool_call_id"] == call["call_id"]


async def test_codex_stops_when_the_balance_runs_out(sim, start):
    proxy, workdir, run = await start()
    secret, _record = await proxy.ledger.create_key("broke", balance_micros=0)
    sim.script({"text": "never sent"})
    result = await run("Say hello", api_key=secret, timeout=120)

    statuses = [r["status"] for r in captured(proxy)]
    assert statuses and set(statuses) == {402}, statuses
    assert len(statuses) <= 2, f"retry storm: {len(statuses)} requests\n" + result.explain()
    assert sim.requests == []  # nothing reached the model server
    shown = (result.stdout + result.stderr).lower()
    assert "quota exceeded" in shown, result.explain()
    assert "reconnecting" not in shown, result.explain()
    assert result.returncode != 0 or any(e.get("type") in ("turn.failed", "error") for e in result.events), \
        result.explain()


async def test_codex_retries_a_failed_stream_and_recovers(sim, start):
    """A mid-stream upstream failure is a response.failed event (retryable): Codex retries once
    and the retried turn completes."""
    proxy, workdir, run = await start()
    sim.script(
        {"text": "this answer breaks off half way through", "error_after": 2},
        {"text": "Recovered."},
    )
    result = await run("Say something")
    assert result.returncode == 0, result.explain()
    assert [m["text"] for m in result.items("agent_message")] == ["Recovered."], result.explain()
    assert len(sim.requests) == 2 and len(captured(proxy)) == 2
    assert any("Reconnecting" in (e.get("message") or "") for e in result.events), result.explain()


# Codex's remote compaction v2 (codex-rs compact_remote_v2): a provider that says it supports
# it, and a context budget small enough that the first tool round passes it, so Codex compacts
# in the middle of the turn: the history with a compaction_trigger item, then the turn goes on
# from the user messages and the one compaction item it got back.
REMOTE_COMPACTION_V2 = 'capabilities = { remote_compaction = "v2" }'
COMPACT_EARLY = "model_auto_compact_token_limit = 2000"
PRICES = {"prices": {"default": {"input": 1_000_000, "cached_input": 1_000_000, "output": 1_000_000}}}
SUMMARY = "The user asked for c.txt; it is written with printf; what is left is to say so."


def check_compacting_session(sim, bodies: list[dict], workdir, result) -> None:
    """A Codex turn that compacted remotely (v2) half way and then finished: what it sent, what
    the model was asked, what it made of the answer. `bodies`: the turn's Responses bodies."""
    assert result.returncode == 0, result.explain()
    assert (workdir / "c.txt").read_text() == "compacted", result.explain()
    assert [m["text"] for m in result.items("agent_message")] == ["Done after compaction."], result.explain()
    assert not [e for e in result.events if e.get("type") in ("turn.failed", "error")], result.explain()
    # Three model requests: the tool call, the summary (the history then a compaction_trigger),
    # and the rest of the turn from the compacted history.
    assert len(bodies) == 3 and len(sim.requests) == 3, [b.get("input", [])[-1:] for b in bodies]
    trigger = bodies[1]["input"][-1]
    assert trigger == {"type": "compaction_trigger"}, trigger
    compact = sim.requests[1]
    assert compact["messages"][-1]["content"].startswith("Summarize")
    assert compact["chat_template_kwargs"] == {"enable_thinking": False} and compact["stream"] is False
    assert any(m["role"] == "tool" for m in compact["messages"])
    # Codex installed the user messages and the one compaction item it got back, sealed here.
    after = bodies[2]["input"]
    items = [i for i in after if i.get("type") == "compaction"]
    assert len(items) == 1 and items[0]["encrypted_content"].startswith("rp2."), after
    assert not [i for i in after if i.get("type") in ("function_call", "function_call_output")], after
    assert {"role": "user", "content": SUMMARY_HEADER + SUMMARY} in sim.requests[2]["messages"]


async def test_codex_compacts_remotely_over_http(sim, start):
    """Codex with remote compaction v2 on: a compacting session over HTTP completes."""
    proxy, workdir, run = await start(overrides={"reasoning_seal": {"keys": {"k1": _key()}}, **PRICES},
                                      extra=COMPACT_EARLY, provider_extra=REMOTE_COMPACTION_V2)
    sim.script({"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "printf compacted > c.txt"}}]},
               {"text": SUMMARY}, {"text": "Done after compaction."})
    result = await run("Write c.txt containing compacted.")
    bodies = [r["body"] for r in captured(proxy)]
    check_compacting_session(sim, bodies, workdir, result)
    assert [r["status"] for r in captured(proxy)] == [200, 200, 200]
    # Each of the three was billed, the compaction as any request.
    rows = await proxy.ledger.list_usage()
    assert len(rows) == 3 and all(r.status == "completed" and r.cost_micros > 0 for r in rows)
