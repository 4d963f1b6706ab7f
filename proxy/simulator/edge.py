"""The simulator's other endpoints, in vLLM 0.32's shapes (../shared/fixtures/vllm-0.32-cpu:
completions_legacy, anthropic_messages[_stream], messages_count_tokens; embeddings as vLLM's
/v1/embeddings answers): POST /v1/completions, /v1/embeddings, /v1/messages,
/v1/messages/count_tokens. The answer comes from the same script queue and generator as the
chat endpoint (proxy.simulator.script); the faults a pass-through must survive are honoured:
status (+ body), usage_override (merged into the usage), usage false, ignore_max_tokens,
first_byte_delay, drop_after n, stall_after n, endless_line, endless_pings (after two events,
pings or SSE comments forever), delay.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import secrets
import time
from typing import Any

from aiohttp import web

from proxy.simulator.chat import SIM_STATE, abort_connection, error_answer, server_headers, sleep_unless_gone
from proxy.simulator.script import content_text, default_plan, find_directive, generate, new_tool_id, tokenize


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _override(script: dict, usage: dict) -> dict:
    extra = script.get("usage_override")
    if isinstance(extra, dict):
        usage.update(extra)
    return usage


async def _body(request: web.Request) -> tuple[dict | None, web.Response | None]:
    st = request.app[SIM_STATE]
    try:
        body = json.loads(await request.read())
    except ValueError:
        return None, error_answer(st, "JSON decode error", 400)
    if not isinstance(body, dict):
        return None, error_answer(st, "Input should be a valid dictionary", 400)
    st.requests.append({**body, "_path": request.path})
    model = body.get("model")
    if model is not None and model not in st.models:
        return None, error_answer(st, f"The model `{model}` does not exist.", 404, param="model")
    return body, None


def _script(st: Any, messages: list) -> dict:
    script = st.queue.popleft() if st.queue else (find_directive(messages) or {})
    return script if isinstance(script, dict) else {}


async def _early(request: web.Request, script: dict) -> web.StreamResponse | None:
    st = request.app[SIM_STATE]
    if script.get("first_byte_delay"):
        await sleep_unless_gone(request, float(script["first_byte_delay"]))
    if script.get("status"):
        status = int(script["status"])
        if "body" in script:
            text = script["body"] if isinstance(script["body"], str) else json.dumps(script["body"])
            return web.Response(status=status, text=text, content_type="application/json")
        return error_answer(st, str(script.get("message") or "simulated upstream error"), status)
    return None


def _pieces(script: dict, body: dict, prompt: str, max_tokens: int | None) -> tuple[list[str], str, int]:
    st_seed = 0
    plan = default_plan({"messages": [{"role": "user", "content": prompt}]}, prompt, st_seed,
                        lambda: new_tool_id("vllm"))
    if script.get("text") is not None:
        plan.text = str(script["text"])
    elif script.get("text_words") is not None:
        plan.text = " ".join(f"w{i}" for i in range(int(script["text_words"])))
    plan.reasoning = ""
    plan.calls = []
    gen = generate(plan, None if script.get("ignore_max_tokens") else max_tokens, script.get("chunk_chars"))
    return [d.text for d in gen.deltas if d.kind == "content"], gen.finish, gen.completion_tokens


async def _faulty_stream(request: web.Request, script: dict, events: list[bytes]) -> web.StreamResponse:
    st = request.app[SIM_STATE]
    resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream; charset=utf-8",
                                                   **server_headers(st)})
    await resp.prepare(request)
    delay = float(script.get("delay") or 0)
    for i, event in enumerate(events):
        if script.get("drop_after") is not None and i > int(script["drop_after"]):
            abort_connection(request)
            return resp
        if script.get("stall_after") is not None and i > int(script["stall_after"]):
            await sleep_unless_gone(request, math.inf)
        if script.get("endless_line") and i == 2:
            await resp.write(b'data: {"id":"')
            while True:
                await resp.write(b"x" * 65536)
                await asyncio.sleep(0)
        if script.get("endless_pings") and i == 2:
            # whole events that carry nothing, forever, 10 ms apart: only the total timeout ends it
            ping = (b'event: ping\ndata: {"type":"ping"}\n\n' if events[0].startswith(b"event:")
                    else b": keep-alive\n\n")
            while True:
                await resp.write(ping)
                await asyncio.sleep(0.01)
        if delay and i:
            await sleep_unless_gone(request, delay)
        await resp.write(event)
    await resp.write_eof()
    return resp


# --------------------------------------------------------------------------- /v1/completions

async def completions(request: web.Request) -> web.StreamResponse:
    body, err = await _body(request)
    if err is not None:
        return err
    assert body is not None  # _body gives one or the other
    st = request.app[SIM_STATE]
    prompt = body.get("prompt")
    text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    prompt_tokens = len(tokenize(text))
    script = _script(st, [{"role": "user", "content": text}])
    early = await _early(request, script)
    if early is not None:
        return early
    max_tokens = body.get("max_tokens", 16)
    pieces, finish, n = _pieces(script, body, text, max_tokens)
    cid, created, model = "cmpl-" + secrets.token_hex(8), int(time.time()), body.get("model") or st.models[0]
    usage = _override(script, {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n,
                               "completion_tokens": n})
    if not body.get("stream"):
        return web.json_response({"id": cid, "object": "text_completion", "created": created, "model": model,
                                  "choices": [{"index": 0, "text": "".join(pieces), "logprobs": None,
                                               "finish_reason": finish, "stop_reason": None}],
                                  "usage": usage})
    head = {"id": cid, "object": "text_completion", "created": created, "model": model}
    events = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        events.append(b"data: " + _dumps({**head, "choices": [{"index": 0, "text": piece, "logprobs": None,
                                                               "finish_reason": finish if last else None,
                                                               "stop_reason": None}]}) + b"\n\n")
    if not pieces:
        events.append(b"data: " + _dumps({**head, "choices": [{"index": 0, "text": "", "finish_reason": finish}]})
                      + b"\n\n")
    if (body.get("stream_options") or {}).get("include_usage") and script.get("usage", True) is not False:
        events.append(b"data: " + _dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return await _faulty_stream(request, script, events)


# --------------------------------------------------------------------------- /v1/embeddings

async def embeddings(request: web.Request) -> web.StreamResponse:
    body, err = await _body(request)
    if err is not None:
        return err
    assert body is not None  # _body gives one or the other
    st = request.app[SIM_STATE]
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)) else raw
    if not isinstance(inputs, list) or not inputs:
        return error_answer(st, "input must be a string or a list", 400)
    script = _script(st, [])
    early = await _early(request, script)
    if early is not None:
        return early
    dims = int(body.get("dimensions") or 8)
    data, tokens = [], 0
    for i, item in enumerate(inputs):
        text = item if isinstance(item, str) else json.dumps(item)
        tokens += len(item) if isinstance(item, list) else len(tokenize(text))
        digest = hashlib.sha256(text.encode()).digest()
        data.append({"index": i, "object": "embedding", "embedding": [(b - 128) / 128 for b in digest[:dims]]})
    usage = _override(script, {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0})
    return web.json_response({"id": "embd-" + secrets.token_hex(8), "object": "list", "created": int(time.time()),
                              "model": body.get("model") or st.models[0], "data": data, "usage": usage})


# --------------------------------------------------------------------------- /v1/messages

def _anthropic_prompt(body: dict) -> tuple[str, list]:
    messages = body["messages"] if isinstance(body.get("messages"), list) else []
    system = body.get("system")
    parts = [system if isinstance(system, str) else json.dumps(system)] if system else []
    for m in messages:
        if isinstance(m, dict):
            c = m.get("content")
            parts.append(c if isinstance(c, str) else content_text(c) if isinstance(c, list) else "")
    return "\n".join(parts), [{"role": "user", "content": parts[-1] if parts else ""}]


def _anthropic_error(status: int, message: str) -> web.Response:
    return web.json_response({"type": "error", "error": {"type": "invalid_request_error", "message": message}},
                             status=status)


async def messages(request: web.Request) -> web.StreamResponse:
    body, err = await _body(request)
    if err is not None:
        return err
    assert body is not None  # _body gives one or the other
    st = request.app[SIM_STATE]
    if not isinstance(body.get("max_tokens"), int):
        return _anthropic_error(400, "max_tokens: Field required")
    text, msgs = _anthropic_prompt(body)
    prompt_tokens = len(tokenize(text)) + 4 * len(body.get("messages") or [])
    script = _script(st, msgs)
    early = await _early(request, script)
    if early is not None:
        return early
    mid, model = "chatcmpl-" + secrets.token_hex(8), body.get("model") or st.models[0]
    tools = body.get("tools") or []
    call = script.get("tool_call") if isinstance(script.get("tool_call"), dict) else None
    if call is None and tools and isinstance(script.get("tool_calls"), list) and script["tool_calls"]:
        call = script["tool_calls"][0]
    pieces, finish, n = _pieces(script, body, text, body["max_tokens"])
    stop = {"length": "max_tokens"}.get(finish, "end_turn")
    blocks: list[dict] = [{"type": "text", "text": "".join(pieces)}]
    if call is not None:
        args = call.get("arguments") or {}
        blocks.append({"type": "tool_use", "id": "toolu_" + secrets.token_hex(8), "name": call["name"],
                       "input": json.loads(args) if isinstance(args, str) else args})
        stop = "tool_use"
        n += max(1, len(tokenize(json.dumps(blocks[1]["input"]))))  # the call's tokens are output too
    usage = _override(script, {"input_tokens": prompt_tokens, "output_tokens": n,
                               "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0})
    if not body.get("stream"):
        return web.json_response({"id": mid, "type": "message", "role": "assistant", "content": blocks, "model": model,
                                  "stop_reason": stop, "stop_sequence": None, "usage": usage})

    def ev(kind: str, obj: dict) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + _dumps({"type": kind, **obj}) + b"\n\n"

    start_usage = _override(script, {"input_tokens": prompt_tokens, "output_tokens": 0})
    events = [ev("message_start", {"message": {"id": mid, "type": "message", "role": "assistant", "content": [],
                                               "model": model, "stop_reason": None, "stop_sequence": None,
                                               "usage": start_usage}}),
              ev("content_block_start", {"content_block": {"type": "text", "text": ""}, "index": 0})]
    events += [ev("content_block_delta", {"delta": {"type": "text_delta", "text": p}, "index": 0}) for p in pieces]
    events.append(ev("content_block_stop", {"index": 0}))
    if call is not None:
        events.append(ev("content_block_start", {"content_block": {"type": "tool_use", "id": blocks[1]["id"],
                                                                   "name": call["name"], "input": {}}, "index": 1}))
        events.append(ev("content_block_delta", {"delta": {"type": "input_json_delta",
                                                           "partial_json": json.dumps(blocks[1]["input"])},
                                                 "index": 1}))
        events.append(ev("content_block_stop", {"index": 1}))
    events.append(ev("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": usage}))
    events.append(ev("message_stop", {}))
    return await _faulty_stream(request, script, events)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    body, err = await _body(request)
    if err is not None:
        return err
    assert body is not None  # _body gives one or the other
    text, _ = _anthropic_prompt(body)
    n = len(tokenize(text)) + 4 * len(body.get("messages") or [])
    return web.json_response({"input_tokens": n, "context_management": {"original_input_tokens": n}})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
