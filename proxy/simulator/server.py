"""A scriptable chat-completions server speaking vLLM 0.32's and SGLang's dialects byte for byte.

It is the proxy's built-in default upstream and the upstream of the whole test suite.

    python -m proxy.simulator.server --host 127.0.0.1 --port 8100 --dialect vllm --model tiny-org/tiny-model

Each chat request is answered from, in priority order: the script queue (`POST /sim/script`
or `Simulator.script`), a `SIM:{...}` directive in the last user/tool message, or a
deterministic default answer (see `proxy.simulator.script`). Script fields:

  content  reasoning, text, text_words n (n words of text), tool_calls [{name, arguments (str | object),
           id?}], finish, usage (false: no usage chunk), cached_tokens, chunk_chars
  hostile  ignore_max_tokens (generate past max_tokens), usage_override {...} (merged into every
           usage object, nested dicts too: any values, e.g. {"prompt_tokens": -5})
  faults   error_first {message, code, type?} | true, error_after n (+ error {...}),
           flat_error, status + body (+ content_type, headers), drop_after n,
           reset_before_headers, garbage (true | str), endless_line (true | MB),
           endless_pings (after two deltas, SSE comments forever), delay s, first_byte_delay s,
           stall_after n, coalesce, keepalive

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /health, POST /tokenize (vLLM),
POST /v1/tokenize + GET /ready + GET /health_generate (SGLang), POST|DELETE /sim/script,
GET|DELETE /sim/requests, GET /sim/state.
"""


from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.config import settings as config_settings
from proxy.simulator.chat import (
    SIM_STATE,
    SSE_CONTENT_TYPE,
    Chat,
    SimState,
    abort_connection,
    context_check,
    dumps,
    error_answer,
    error_object,
    json_answer,
    server_headers,
    sleep_unless_gone,
    stream_error_line,
    validate_chat,
)
from proxy.simulator.script import (
    default_plan,
    find_directive,
    generate,
    new_tool_id,
    render_prompt,
    script_plan,
    token_id,
    tokenize,
)

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Simulator as SimulatorSettings

# config.yaml `simulator`'s, for a simulator made without one
_DEFAULTS: SimulatorSettings = config_settings.of("simulator")

# --------------------------------------------------------------------------- handlers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[SIM_STATE]
    st.traceparents.append(request.headers.get("traceparent"))  # what vLLM's --otlp-traces-endpoint reads
    body, err = validate_chat(st, await request.read())
    if err is not None:
        return err
    assert body is not None
    messages = body["messages"]
    prompt = render_prompt(messages, body.get("tools"))
    tokens = tokenize(prompt)
    max_tokens, err = context_check(st, body, len(tokens))
    if err is not None:
        return err

    script = st.queue.popleft() if st.queue else (find_directive(messages) or {})
    if not isinstance(script, dict):
        script = {}
    cached, created = st.cache.lookup_insert(tokens)
    if isinstance(script.get("cached_tokens"), int):
        cached = script["cached_tokens"]
    tool_id = lambda: new_tool_id(st.dialect)  # noqa: E731
    plan = default_plan(body, prompt, st.seed, tool_id)
    if script:
        plan = script_plan(script, plan, tool_id)
    gen = generate(plan, None if script.get("ignore_max_tokens") else max_tokens, script.get("chunk_chars"))
    chat = Chat(st, body, script, gen, len(tokens), cached, created)

    st.in_flight += 1
    st.peak_in_flight = max(st.peak_in_flight, st.in_flight)
    try:
        if body.get("stream"):
            return await _stream(request, chat)
        return await _respond(request, chat)
    except (ConnectionResetError, asyncio.CancelledError):
        st.cancelled += 1
        raise
    finally:
        st.in_flight -= 1


async def _before_headers(request: web.Request, chat: Chat) -> web.StreamResponse | None:
    """Faults that happen before any response byte; returns a response to send instead, if any."""
    s, st = chat.script, chat.st
    if s.get("first_byte_delay"):
        await sleep_unless_gone(request, float(s["first_byte_delay"]))
    if s.get("reset_before_headers"):
        abort_connection(request)
        return web.Response(status=500)  # never reaches the client
    if s.get("status"):
        status = int(s["status"])
        headers = server_headers(st)
        headers.update({str(k): str(v) for k, v in (s.get("headers") or {}).items()})
        if "body" in s:
            text = s["body"] if isinstance(s["body"], str) else json.dumps(s["body"])
            ctype = s.get("content_type") or ("application/json" if text.lstrip()[:1] in ("{", "[") else "text/html")
            return web.Response(status=status, text=text, content_type=ctype, headers=headers)
        obj = error_object(st, str(s.get("message") or "simulated upstream error"), status,
                         flat=True if s.get("flat_error") else None)
        return web.Response(status=status, body=dumps(obj), content_type="application/json", headers=headers)
    return None


def _script_error(chat: Chat, key: str) -> tuple[str, int, str | None]:
    e = chat.script.get(key)
    e = e if isinstance(e, dict) else {}
    code = int(e.get("code") or 500)
    return str(e.get("message") or "simulated upstream error"), code, e.get("type")


async def _respond(request: web.Request, chat: Chat) -> web.StreamResponse:
    """A non-stream answer (faults mapped onto one HTTP response)."""
    s, st = chat.script, chat.st
    early = await _before_headers(request, chat)
    if early is not None:
        return early
    n = len(chat.gen.deltas)
    for key in ("stall_after", "drop_after"):
        if s.get(key) is not None:
            n = min(n, int(s[key]))
    if s.get("delay"):
        await sleep_unless_gone(request, float(s["delay"]) * n)
    if s.get("stall_after") is not None:
        await sleep_unless_gone(request, math.inf)
    if s.get("drop_after") is not None:
        abort_connection(request)
        return web.Response(status=500)
    for key in ("error_first", "error_after"):
        if s.get(key) is not None and s.get(key) is not False:
            message, code, err_type = _script_error(chat, "error_first" if key == "error_first" else "error")
            return json_answer(st, error_object(st, message, code, type=err_type,
                                                 flat=True if s.get("flat_error") else None), code)
    if s.get("garbage"):
        text = s["garbage"] if isinstance(s["garbage"], str) else "<html>not json</html>"
        return web.Response(text=text, content_type="application/json", headers=server_headers(st))
    if s.get("endless_line"):
        return await _endless(request, chat, web.StreamResponse(headers={"content-type": "application/json",
                                                                         **server_headers(st)}), b"")
    return json_answer(st, chat.completion())


async def _endless(request: web.Request, chat: Chat, resp: web.StreamResponse, prefix: bytes) -> web.StreamResponse:
    """Bytes without a newline: forever (until the client leaves), or for N megabytes."""
    if not resp.prepared:
        await resp.prepare(request)
    limit = chat.script["endless_line"]
    budget = math.inf if limit is True else float(limit) * 1024 * 1024
    await resp.write(prefix + b'data: {"id":"')
    block = b"x" * 65536
    sent = 0
    while sent < budget:
        await resp.write(block)
        sent += len(block)
        await asyncio.sleep(0)
    return resp


async def _stream(request: web.Request, chat: Chat) -> web.StreamResponse:
    s, st = chat.script, chat.st
    early = await _before_headers(request, chat)
    if early is not None:
        return early
    resp = web.StreamResponse(status=200, headers={"content-type": SSE_CONTENT_TYPE, **server_headers(st)})
    await resp.prepare(request)

    delay = float(s.get("delay") or 0)
    coalesce = bool(s.get("coalesce"))
    keepalive = bool(s.get("keepalive"))
    buf = bytearray()
    wrote_any = False

    async def emit(data: bytes) -> None:
        nonlocal wrote_any
        if keepalive:
            data = b": keep-alive\n\n" + data
        if coalesce:
            buf.extend(data)
            return
        if wrote_any and delay:
            await sleep_unless_gone(request, delay)
        await resp.write(data)
        wrote_any = True

    async def flush() -> None:
        if buf:
            await resp.write(bytes(buf))
            buf.clear()

    flat = bool(s.get("flat_error"))
    if s.get("error_first") is not None and s.get("error_first") is not False:
        message, code, err_type = _script_error(chat, "error_first")
        await emit(stream_error_line(st, message, code, err_type, flat))
        await emit(b"data: [DONE]\n\n")
        await flush()
        return resp

    events = chat.events()
    if s.get("garbage"):
        text = s["garbage"] if isinstance(s["garbage"], str) else "this is not json {"
        events = [events[0], ("delta", b"data: " + text.encode() + b"\n\n"),
                  ("delta", b"data: <html><body>502 Bad Gateway</body></html>\n\n"), events[-1]]

    faults = {k: int(s[k]) for k in ("error_after", "drop_after", "stall_after") if s.get(k) is not None}
    endless = bool(s.get("endless_line"))
    deltas = 0
    for kind, data in events:
        if kind != "role":
            for key, after in faults.items():
                if deltas >= after:
                    await flush()
                    if key == "error_after":
                        message, code, err_type = _script_error(chat, "error")
                        await emit(stream_error_line(st, message, code, err_type, flat))
                        await emit(b"data: [DONE]\n\n")
                        await flush()
                        return resp
                    if key == "drop_after":
                        abort_connection(request)
                        return resp
                    await sleep_unless_gone(request, math.inf)  # stall_after
            if endless:
                await flush()
                return await _endless(request, chat, resp, b"")
            if s.get("endless_pings") and deltas >= 2:  # comments forever: only the total timeout ends it
                await flush()
                while True:
                    await resp.write(b": keep-alive\n\n")
                    await asyncio.sleep(0.01)
        await emit(data)
        if kind == "delta":
            deltas += 1
    await flush()
    return resp


async def models_handler(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    data = []
    for m in st.models:
        if st.dialect == "sglang":
            data.append({"id": m, "object": "model", "created": st.created, "owned_by": "sglang", "root": m,
                         "parent": None, "max_model_len": st.max_model_len})
        else:
            perm = {"id": "modelperm-" + secrets.token_hex(8), "object": "model_permission", "created": st.created,
                    "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                    "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                    "organization": "*", "group": None, "is_blocking": False}
            data.append({"id": m, "object": "model", "created": st.created, "owned_by": "vllm", "root": m,
                         "parent": None, "max_model_len": st.max_model_len, "permission": [perm]})
    return json_answer(st, {"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200, headers=server_headers(request.app[SIM_STATE]))


async def tokenize_handler(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    try:
        body = json.loads(await request.read())
    except ValueError as e:
        return error_answer(st, f"JSON decode error: {e}", 400)
    if not isinstance(body, dict):
        return error_answer(st, "body must be a JSON object", 400)
    if isinstance(body.get("messages"), list):
        # As vLLM 0.32: its chat endpoint renames an assistant's reasoning_content to
        # reasoning, its /tokenize reads only reasoning. SGLang reads reasoning_content.
        keys = ("reasoning",) if st.dialect == "vllm" else ("reasoning_content",)
        text = render_prompt(body["messages"], body.get("tools"), body.get("add_generation_prompt", True) is not False,
                             reasoning_keys=keys)
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        return error_answer(st, "Either 'prompt' or 'messages' must be provided.", 400)
    toks = tokenize(text)
    ids = [token_id(t) for t in toks]
    if st.dialect == "sglang":
        return json_answer(st, {"tokens": ids, "count": len(ids), "max_model_len": st.max_model_len})
    return json_answer(st, {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids,
                               "token_strs": toks if body.get("return_token_strs") else None})


async def sim_script(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    if request.method == "DELETE":
        st.queue.clear()
        return web.json_response({"queued": 0})
    try:
        body = json.loads(await request.read())
    except ValueError as e:
        return web.json_response({"error": f"invalid JSON: {e}"}, status=400)
    scripts = body if isinstance(body, list) else [body]
    if not all(isinstance(x, dict) for x in scripts):
        return web.json_response({"error": "a script is a JSON object (or a list of them)"}, status=400)
    st.queue.extend(scripts)
    return web.json_response({"queued": len(st.queue)})


async def sim_requests(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    if request.method == "DELETE":
        st.requests.clear()
        return web.json_response({"requests": 0})
    return web.Response(body=dumps(st.requests), content_type="application/json")


async def sim_state(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    return web.json_response({"dialect": st.dialect, "models": list(st.models), "in_flight": st.in_flight,
                              "cancelled": st.cancelled, "queued": len(st.queue), "requests": len(st.requests)})


def create_app(*, dialect: str = _DEFAULTS.dialect, models: tuple[str, ...] | list[str] = (_DEFAULTS.model,),
               max_model_len: int = _DEFAULTS.max_model_len, seed: int = 0) -> web.Application:
    if dialect not in ("vllm", "sglang"):
        raise ValueError(f"unknown dialect {dialect!r} (vllm | sglang)")
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SIM_STATE] = SimState(dialect, tuple(models), int(max_model_len), int(seed))
    app.router.add_post("/v1/chat/completions", chat_completions)
    from proxy.simulator.edge import add_routes as add_edge_routes

    add_edge_routes(app)  # /v1/completions, /v1/embeddings, /v1/messages (+ count_tokens)
    app.router.add_get("/v1/models", models_handler)
    app.router.add_get("/health", health)
    if dialect == "vllm":
        app.router.add_post("/tokenize", tokenize_handler)
    else:
        app.router.add_post("/v1/tokenize", tokenize_handler)
        app.router.add_get("/ready", health)
        app.router.add_get("/health_generate", health)
    app.router.add_post("/sim/script", sim_script)
    app.router.add_delete("/sim/script", sim_script)
    app.router.add_get("/sim/requests", sim_requests)
    app.router.add_delete("/sim/requests", sim_requests)
    app.router.add_get("/sim/state", sim_state)
    return app


class Simulator:
    """The simulator on 127.0.0.1 with an ephemeral port, as an async context manager."""

    def __init__(self, *, dialect: str = _DEFAULTS.dialect, models: tuple[str, ...] | list[str] = (_DEFAULTS.model,),
                 max_model_len: int = _DEFAULTS.max_model_len, host: str = _DEFAULTS.host, port: int = _DEFAULTS.port,
                 seed: int = 0):
        self.app = create_app(dialect=dialect, models=models, max_model_len=max_model_len, seed=seed)
        self.state = self.app[SIM_STATE]
        self.host, self.port = host, port
        self.url = ""
        self._runner: web.AppRunner | None = None

    @property
    def requests(self) -> list[dict]:
        return self.state.requests

    @property
    def in_flight(self) -> int:
        return self.state.in_flight

    @property
    def peak_in_flight(self) -> int:
        return self.state.peak_in_flight

    def reset_peak(self) -> None:
        self.state.peak_in_flight = self.state.in_flight

    @property
    def cancelled(self) -> int:
        return self.state.cancelled

    def script(self, *scripts: dict) -> None:
        self.state.queue.extend(scripts)

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Simulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m proxy.simulator.server", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=_DEFAULTS.host)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dialect", choices=("vllm", "sglang"), default=_DEFAULTS.dialect)
    p.add_argument("--model", action="append", help=f"served model name (repeatable; default {_DEFAULTS.model})")
    p.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    app = create_app(dialect=args.dialect, models=tuple(args.model or [_DEFAULTS.model]),
                     max_model_len=args.max_model_len, seed=args.seed)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, access_log=None,
                print=lambda _: print(f"simulator ({args.dialect}) on http://{args.host}:{args.port}", flush=True))


if __name__ == "__main__":
    main()
