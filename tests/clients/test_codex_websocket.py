"""Codex over the Responses WebSocket transport, end to end: the real `codex exec` (0.171,
provider configured with `supports_websockets = true`) -> a recording relay (tests/clients/relay.py)
-> the proxy -> the simulator. The relay proves the socket was used and shows what each turn
carried: after the first, only the new items and the previous response's id.
"""

from __future__ import annotations

import orjson
import pytest

from tests.clients.codex import EgressTrap, run_codex, write_codex_home
from tests.clients.relay import Relay
from tests.clients.test_codex import (COMPACT_EARLY, MODELS, PRICES, REMOTE_COMPACTION_V2, SUMMARY, check_compacting_session,
                              codex_cmd, sim)  # noqa: F401 - fixtures

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WEBSOCKETS = "supports_websockets = true"


def _workers(sim) -> list[dict]:
    return [{"name": "sim", "url": sim.url, "dialect": "vllm", "models": list(MODELS),
             "timeouts": {"connect": 2, "first_byte": 20, "idle": 20, "total": 60}}]


async def _codex(codex_cmd, tmp_path, relay: Relay, api_key: str, prompt: str, *, websockets: bool,
                 extra: str = "", provider_extra: str = ""):
    home = write_codex_home(tmp_path / ("ws" if websockets else "http"), base_url=relay.base_url,
                            model="tiny-org/tiny-model", extra=extra,
                            provider_extra="\n".join(filter(None, (WEBSOCKETS if websockets else "", provider_extra))))
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    async with EgressTrap() as trap:
        result = await run_codex(codex_cmd, home, workdir, prompt, api_key=api_key, timeout=150,
                                 egress_port=trap.port)
    assert trap.attempts == [], f"Codex tried to reach beyond the proxy: {trap.attempts}"
    return result, workdir


def _creates(relay: Relay) -> list[dict]:
    return [orjson.loads(m) for c in relay.ws_connections for m in c["sent"]
            if orjson.loads(m).get("type") == "response.create"]


def _turns(relay: Relay) -> list[tuple[dict, dict]]:
    """(response.create sent, response.completed received) per turn of every socket, in order."""
    pairs = []
    for connection in relay.ws_connections:
        done = [orjson.loads(m)["response"] for m in connection["received"]
                if m.startswith('{"type":"response.completed"')]
        sent = [orjson.loads(m) for m in connection["sent"]]
        pairs += list(zip([m for m in sent if m.get("type") == "response.create"], done))
    return pairs


def _header(headers: dict, name: str) -> str:
    return next((v for k, v in headers.items() if k.lower() == name.lower()), "")


def _tool_loop(sim, calls: int) -> None:
    sim.script(*[{"tool_calls": [{"name": "exec_command", "arguments": {"cmd": f"printf {i} > f{i}.txt"}}]}
                 for i in range(calls)], {"text": "All files are written."})


async def test_codex_runs_a_tool_loop_over_the_websocket(sim, make_proxy, tmp_path, codex_cmd):
    proxy = await make_proxy({}, workers=_workers(sim))
    _tool_loop(sim, 2)
    async with Relay(proxy.url) as relay:
        result, workdir = await _codex(codex_cmd, tmp_path, relay, proxy.api_key,
                                       "Write f0.txt, then f1.txt.", websockets=True)
    assert result.returncode == 0, result.explain()
    assert [(workdir / f"f{i}.txt").read_text() for i in range(2)] == ["0", "1"], result.explain()
    assert [m["text"] for m in result.items("agent_message")] == ["All files are written."], result.explain()

    # The socket carried every turn: no POST /v1/responses reached the proxy.
    assert [r["path"] for r in relay.http_requests if r["path"].endswith("/responses")] == []
    assert len(relay.ws_connections) == 1, "Codex did not open (exactly) one WebSocket"
    assert _header(relay.ws_connections[0]["headers"], "OpenAI-Beta").startswith("responses_websockets=")
    turns = _turns(relay)
    # Codex starts with a warm-up (generate: false): answered without a model call, no output.
    (warmup, warm), *real = turns
    assert warmup.get("generate") is False and warm["output"] == [] and warm["usage"]["output_tokens"] == 0
    assert len(real) == 3 and len(sim.requests) == 3
    # Every turn after it continues the previous response and sends only what is new: the
    # turn's prompt once, then only tool outputs (never the instructions or history again).
    previous = warm["id"]
    for i, (sent, done) in enumerate(real):
        assert sent["previous_response_id"] == previous and done["previous_response_id"] == previous
        kinds = [item.get("type") for item in sent["input"]]
        if i == 0:  # the turn's own context and prompt, none of what the warm-up sent
            assert "function_call_output" not in kinds and "user" in [m.get("role") for m in sent["input"]]
            assert not [item for item in sent["input"] if item in warmup["input"]]
        else:
            assert kinds == ["function_call_output"], kinds
        previous = done["id"]
    # The model saw the whole conversation each time: the proxy expanded the continuation.
    last = sim.requests[-1]["messages"]
    assert [m["role"] for m in last].count("tool") == 2 and last[0]["role"] == "system"
    # Codex sends its hosted web_search tool, left out with a notice: each turn's
    # response.created carried it (`headers`, as HTTP's x-token-notice) and Codex went on; the
    # warm-up too, which passes the same phases (proxy.units.WS_WARMUP).
    created = [orjson.loads(m) for m in relay.ws_connections[0]["received"]
               if m.startswith('{"type":"response.created"')]
    assert all("web_search" in c["headers"]["x-token-notice"] for c in created) and len(created) == 4
    # Every field Codex sends is one the proxy knows: none is named as unknown.
    assert not any("unknown field" in c["headers"]["x-token-notice"] for c in created)


def _http_bytes(record: dict) -> int:
    """A request on the wire: request line, header lines, blank line, body."""
    head = len(f"POST {record['path']} HTTP/1.1\r\n") + 2
    head += sum(len(k) + len(v) + 4 for k, v in record["headers"].items())
    return head + record["bytes"]


def _frame_bytes(payload: str) -> int:
    """A client text frame: 2 bytes, the extended length, a 4-byte mask, the payload."""
    n = len(payload.encode())
    return 2 + (0 if n < 126 else 2 if n < 65536 else 8) + 4 + n


async def test_bytes_per_turn_http_against_websocket(sim, make_proxy, tmp_path, codex_cmd):
    """A 10-turn Codex tool loop (9 tool calls, then the answer) over each transport: what the
    client sends per turn. README ("WebSocket transport") quotes the figures this prints."""
    proxy = await make_proxy({}, workers=_workers(sim))
    sent: dict[str, list[int]] = {}
    for websockets in (False, True):
        _tool_loop(sim, 9)
        async with Relay(proxy.url) as relay:
            result, workdir = await _codex(codex_cmd, tmp_path, relay, proxy.api_key,
                                           "Write f0.txt to f8.txt, one by one.", websockets=websockets)
        assert result.returncode == 0, result.explain()
        assert [m["text"] for m in result.items("agent_message")] == ["All files are written."], result.explain()
        if websockets:
            creates = [m for c in relay.ws_connections for m in c["sent"]
                       if orjson.loads(m).get("type") == "response.create" and orjson.loads(m).get("generate") is not False]
            sent["websocket"] = [_frame_bytes(m) for m in creates]
            sent["warm-up"] = [_frame_bytes(m) for c in relay.ws_connections for m in c["sent"]
                               if orjson.loads(m).get("generate") is False]
            sent["handshake"] = [_http_bytes({"path": "/v1/responses", "headers": c["headers"], "bytes": 0})
                                 for c in relay.ws_connections]
        else:
            sent["http"] = [_http_bytes(r) for r in relay.http_requests if r["path"].endswith("/responses")]
    http, ws = sent["http"], sent["websocket"]
    assert len(http) == len(ws) == 10, sent
    print(f"\nbytes sent by the client per turn, 10-turn Codex tool loop: {sent}")
    print(f"total: http {sum(http)}, websocket {sum(ws) + sum(sent['warm-up']) + sum(sent['handshake'])} "
          f"(turns {sum(ws)}, warm-up {sum(sent['warm-up'])}, handshake {sum(sent['handshake'])})")
    # HTTP resends the whole conversation every turn, so it grows; over the socket a turn after
    # the first carries only the new tool output (and the unchanged tools and settings).
    assert all(later > earlier for earlier, later in zip(http, http[1:])), http
    assert all(w < h for w, h in zip(ws[1:], http[1:])), (ws, http)
    assert max(ws[2:]) - min(ws[2:]) < 200, ws  # flat: the socket's turns do not grow with the history


async def test_codex_reconnects_at_the_connection_limit(sim, make_proxy, tmp_path,
                                                                                       codex_cmd):
    """A connection limit far below 60 minutes: Codex's next turn gets
    websocket_connection_limit_reached; Codex opens a new socket, whose memory is empty, and
    sends that turn in full there; the tool loop completes all the same."""
    proxy = await make_proxy({"websocket": {"max_connection_minutes": 0.01}}, workers=_workers(sim))  # 0.6 s
    sim.script(*[{"tool_calls": [{"name": "exec_command", "arguments": {"cmd": f"printf {i} > f{i}.txt"}}],
                  "first_byte_delay": 0.4} for i in range(3)], {"text": "All files are written."})
    async with Relay(proxy.url) as relay:
        result, workdir = await _codex(codex_cmd, tmp_path, relay, proxy.api_key,
                                       "Write f0.txt to f2.txt.", websockets=True)
    assert result.returncode == 0, result.explain()
    assert [(workdir / f"f{i}.txt").read_text() for i in range(3)] == ["0", "1", "2"]
    assert [m["text"] for m in result.items("agent_message")] == ["All files are written."], result.explain()
    errors = [orjson.loads(m)["error"]["code"] for c in relay.ws_connections for m in c["received"]
              if m.startswith('{"type":"error"')]
    assert "websocket_connection_limit_reached" in errors, errors
    assert len(relay.ws_connections) >= 2 and [r for r in relay.http_requests if r["path"].endswith("/responses")] == []
    first_on_the_new_socket = orjson.loads(relay.ws_connections[1]["sent"][0])
    assert first_on_the_new_socket.get("previous_response_id") is None
    assert first_on_the_new_socket["input"][0]["role"] == "developer"  # the whole conversation again


async def test_codex_compacts_remotely_over_the_websocket(sim, make_proxy, tmp_path, codex_cmd):
    """Codex with remote compaction v2 on, over the socket: the compaction is a turn of the
    socket (the previous response continued with the new tool output and the trigger), and the turn
    goes on from the compacted history."""
    import base64
    import os

    seal = {"reasoning_seal": {"keys": {"k1": base64.urlsafe_b64encode(os.urandom(32)).decode()}}}
    proxy = await make_proxy({**seal, **PRICES}, workers=_workers(sim))
    sim.script({"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "printf compacted > c.txt"}}]},
               {"text": SUMMARY}, {"text": "Done after compaction."})
    async with Relay(proxy.url) as relay:
        result, workdir = await _codex(codex_cmd, tmp_path, relay, proxy.api_key, "Write c.txt containing compacted.",
                                       websockets=True, extra=COMPACT_EARLY, provider_extra=REMOTE_COMPACTION_V2)
    assert [r["path"] for r in relay.http_requests if r["path"].endswith("/responses")] == [], relay.http_requests
    turns = [(sent, done) for sent, done in _turns(relay) if sent.get("generate") is not False]
    check_compacting_session(sim, [sent for sent, _ in turns], workdir, result)
    # Codex continued its last response with only what was new, the tool output and the trigger:
    # the proxy expanded the context from the connection's memory.
    (_, first), (compaction, compacted), _ = turns
    assert [i.get("type") for i in compaction["input"]] == ["function_call_output", "compaction_trigger"]
    assert compaction["previous_response_id"] == first["id"]
    assert [i["type"] for i in compacted["output"]] == ["compaction"] and compacted["usage"]["output_tokens"] > 0
    received = [orjson.loads(m)["type"] for c in relay.ws_connections for m in c["received"]]
    assert "error" not in received, received
    rows = await proxy.ledger.list_usage()
    assert len(rows) == 3 and all(r.status == "completed" and r.cost_micros > 0 for r in rows)
