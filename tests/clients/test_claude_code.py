"""Claude Code end to end: the real `claude -p` (pinned, from npm) -> the proxy's /v1/messages
(every policy on, x-api-key or Bearer from the environment) -> the simulator speaking vLLM's
native Anthropic Messages SSE (proxy/simulator/edge.py, the shapes of
../shared/fixtures/vllm-0.32-cpu/anthropic_messages*), scripted per request.

Claude Code is installed once into .cache/claude-code/<version> (git-ignored) by
tests/clients/claude_code.py, beside Codex's. These tests skip only when that npm install is
impossible (no npm, no registry); the reason is printed. Everything else is a failure.
"""

from __future__ import annotations

import pytest

from middlewares.balance import wait_for_settlements
from proxy.ledger.pricing import Price, cost_micros
from proxy.protocol.passthrough_fields import MESSAGES as MESSAGES_FIELDS
from proxy.protocol.passthrough_fields import MESSAGES_OWN, SILENT
from tests.clients.capture import CAPTURED, ENTRY as CAPTURE
from tests.clients.claude_code import ClaudeCodeUnavailable, ensure_claude_code, run_claude
from tests.clients.codex import EgressTrap
from tests.conftest import POLICIES, only

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MODEL = "tiny-org/tiny-model"
PATHS = ["/v1/messages", "/v1/messages/count_tokens"]
PIPELINE = only(*POLICIES, after_auth=[{CAPTURE: {"paths": PATHS}}])
PRICE = Price(2_000_000, 500_000, 5_000_000)  # micros per million tokens: 2 / 0.5 / 5 micros a token
PRICES = {"prices": {"default": {"input": PRICE.input, "cached_input": PRICE.cached_input, "output": PRICE.output}}}
BALANCE = 50_000_000


@pytest.fixture(scope="session")
def claude_cmd() -> list[str]:
    try:
        return ensure_claude_code()
    except ClaudeCodeUnavailable as exc:
        print(f"\nClaude Code tests skipped: {exc}")
        pytest.skip(f"Claude Code unavailable: {exc}")


@pytest.fixture
def start(sim, make_proxy, tmp_path, claude_cmd):
    """start(overrides) -> (proxy, workdir, run); run(prompt, api_key=, bearer=) runs `claude -p`."""

    async def go(overrides: dict | None = None):
        workers = [{"name": "sim", "url": sim.url, "dialect": "vllm", "models": [MODEL],
                    "timeouts": {"connect": 2, "first_byte": 20, "idle": 20, "total": 60}}]
        proxy = await make_proxy({**PIPELINE, **PRICES, **(overrides or {})}, workers=workers)
        workdir = tmp_path / "work"
        workdir.mkdir(exist_ok=True)

        async def run(prompt: str, *, api_key: str, bearer: bool = False, timeout: float = 150):
            async with EgressTrap() as trap:
                result = await run_claude(claude_cmd, tmp_path / "home", workdir, prompt, base_url=proxy.url,
                                          api_key=api_key, model=MODEL, bearer=bearer, egress_port=trap.port,
                                          timeout=timeout)
            # Telemetry, error reports and update checks are off: nothing but the proxy is asked.
            assert trap.attempts == [], f"Claude Code tried to reach beyond the proxy: {trap.attempts}"
            return result

        return proxy, workdir, run

    return go


def usage(inp: int, read: int, made: int, out: int) -> dict:
    """What the scripted upstream reports (message_start and message_delta), Anthropic's fields."""
    return {"usage_override": {"input_tokens": inp, "cache_read_input_tokens": read,
                               "cache_creation_input_tokens": made, "output_tokens": out}}


def billed(inp: int, read: int, made: int, out: int) -> int:
    """The upstream's usage x price: input = input + cache reads + cache writes, the reads priced as cached."""
    return cost_micros(PRICE, inp + read + made, read, out)


async def rows_of(proxy, key_id: str):
    await wait_for_settlements(proxy.app)
    return sorted(await proxy.ledger.list_usage(key_id, limit=100), key=lambda r: r.created_at)


def tool_results(body: dict) -> list[dict]:
    return [b for m in body["messages"] if isinstance(m.get("content"), list)
            for b in m["content"] if b.get("type") == "tool_result"]


def result_text(block: dict) -> str:
    content = block.get("content")
    if isinstance(content, list):
        return "".join(c.get("text", "") for c in content if isinstance(c, dict))
    return str(content)


async def test_claude_code_runs_bash_through_the_proxy_billed_as_reported(sim, start):
    proxy, workdir, run = await start()
    secret, record = await proxy.ledger.create_key("claude", balance_micros=BALANCE)
    command = "printf made-by-claude > made.txt && echo wrote-it"
    first, second = usage(1500, 600, 100, 40), usage(1700, 800, 0, 12)
    sim.script({"text": "I will create it.", "usage_override": first["usage_override"],
                "tool_call": {"name": "Bash", "arguments": {"command": command, "description": "Write made.txt"}}},
               {"text": "I created made.txt.", **second})
    result = await run("Create a file named made.txt containing made-by-claude.", api_key=secret)
    assert result.returncode == 0, result.explain()

    # The tool really ran, in the working folder, and the final text arrived.
    assert (workdir / "made.txt").read_text() == "made-by-claude", result.explain()
    assert result.result is not None and result.result["is_error"] is False, result.explain()
    assert result.result["result"] == "I created made.txt.", result.explain()
    assert result.result["num_turns"] == 2

    # What Claude Code sent: two streamed /v1/messages, the key as x-api-key, the served model.
    sent = proxy.app[CAPTURED]
    assert [(r["path"], r["status"]) for r in sent] == [("/v1/messages", 200)] * 2, sent
    for r in sent:
        headers = {k.lower(): v for k, v in r["headers"].items()}
        assert headers["x-api-key"] == secret and "authorization" not in headers
        assert "anthropic-version" in headers
        assert r["body"]["model"] == MODEL and r["body"]["stream"] is True
        assert isinstance(r["body"]["max_tokens"], int)
        assert {t["name"] for t in r["body"]["tools"]} >= {"Bash", "Read"}
        assert r["end"].endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n'), r["end"]
    # The upstream got the body as sent (model resolved, nothing else rewritten but the cap), but
    # the Anthropic fields vLLM does not serve (context_management); no field of it unknown.
    assert [r["_path"] for r in sim.requests] == ["/v1/messages"] * 2
    silent = {k for k, rule in MESSAGES_FIELDS.items() if rule == SILENT}
    assert {k: v for k, v in sim.requests[0].items() if k not in ("_path", "max_tokens")} == \
        {k: v for k, v in sent[0]["body"].items() if k != "max_tokens" and k not in silent}
    assert set(sent[0]["body"]) <= set(MESSAGES_FIELDS) | MESSAGES_OWN, set(sent[0]["body"]) - set(MESSAGES_FIELDS)
    # The second request carries the tool's output back, through the proxy.
    (call,) = [b for m in sim.requests[1]["messages"] if m["role"] == "assistant"
               for b in m["content"] if b.get("type") == "tool_use"]
    assert call["name"] == "Bash" and call["input"]["command"] == command
    (back,) = tool_results(sim.requests[1])
    assert back["tool_use_id"] == call["id"] and "wrote-it" in result_text(back) and not back.get("is_error")

    # Billed exactly the upstream's usage x price, once per request, on /v1/messages rows.
    rows = await rows_of(proxy, record.key_id)
    assert [(r.endpoint, r.status) for r in rows] == [("/v1/messages", "completed")] * 2
    for row, reported in zip(rows, (first, second)):
        u = reported["usage_override"]
        inp, read, made, out = (u["input_tokens"], u["cache_read_input_tokens"],
                                u["cache_creation_input_tokens"], u["output_tokens"])
        assert (row.input_tokens, row.cached_tokens, row.output_tokens) == (inp + read + made, read, out)
        assert row.cost_micros == row.debited_micros == billed(inp, read, made, out)
    key = await proxy.ledger.get_key(record.key_id)
    assert BALANCE - key.balance_micros == sum(r.debited_micros for r in rows)
    assert await proxy.ledger.holds(record.key_id) == []


async def test_claude_code_reads_a_file_with_a_bearer_token(sim, start):
    """ANTHROPIC_AUTH_TOKEN: the key as Authorization: Bearer. The Read tool reads a file the
    model could only know from the tool's result."""
    proxy, workdir, run = await start()
    secret, record = await proxy.ledger.create_key("claude-bearer", balance_micros=BALANCE)
    (workdir / "notes.txt").write_text("the secret word is periwinkle\n")
    sim.script({"text": "", "tool_call": {"name": "Read", "arguments": {"file_path": str(workdir / "notes.txt")}},
                **usage(900, 0, 0, 30)},
               {"text": "The secret word is periwinkle.", **usage(1000, 0, 0, 8)})
    result = await run("What is the secret word in notes.txt?", api_key=secret, bearer=True)
    assert result.returncode == 0, result.explain()
    assert result.result["result"] == "The secret word is periwinkle.", result.explain()
    for r in proxy.app[CAPTURED]:
        headers = {k.lower(): v for k, v in r["headers"].items()}
        assert headers["authorization"] == f"Bearer {secret}" and "x-api-key" not in headers
    (back,) = tool_results(sim.requests[1])
    assert "periwinkle" in result_text(back)
    rows = await rows_of(proxy, record.key_id)
    assert [r.cost_micros for r in rows] == [billed(900, 0, 0, 30), billed(1000, 0, 0, 8)]


async def test_claude_code_is_told_a_spent_balance_in_anthropics_envelope(sim, start):
    """A key with nothing left: Claude Code reads the 402 billing_error, says so and stops; nothing
    reached the model server, nothing was billed."""
    proxy, workdir, run = await start()
    secret, record = await proxy.ledger.create_key("broke", balance_micros=0)
    sim.script({"text": "never sent"})
    result = await run("Say hello", api_key=secret, timeout=120)
    statuses = [r["status"] for r in proxy.app[CAPTURED]]
    assert statuses and set(statuses) == {402}, statuses
    assert len(statuses) <= 3, f"retry storm: {len(statuses)} requests\n" + result.explain()
    assert sim.requests == []
    assert result.returncode != 0 or (result.result or {}).get("is_error"), result.explain()
    assert "balance" in (result.stdout + result.stderr).lower(), result.explain()
    assert await proxy.ledger.list_usage(record.key_id) == []


async def test_claude_code_on_a_revoked_key_ends_in_one_request(sim, start, http):
    """A 401 on /v1/messages says x-should-retry: false: Claude Code stops at once, where without
    it it asked 11 times over 176 s before saying it could not authenticate."""
    proxy, workdir, run = await start()
    secret, record = await proxy.ledger.create_key("gone", balance_micros=BALANCE)
    await proxy.ledger.revoke(record.key_id)
    result = await run("Say hello", api_key=secret, timeout=120)
    async with http.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    refused = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("responses_proxy_requests_total") and 'status="401"' in line)
    assert refused == 1, result.explain()
    assert sim.requests == []
    assert result.returncode != 0 or (result.result or {}).get("is_error"), result.explain()
