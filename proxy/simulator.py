"""A scriptable chat-completions server speaking vLLM 0.32's and SGLang's dialects byte for byte.

It is the proxy's built-in default upstream and the upstream of the whole test suite.

    python -m proxy.simulator --host 127.0.0.1 --port 8100 --dialect vllm --model tiny-org/tiny-model

Each chat request is answered from, in priority order: the script queue (`POST /sim/script`
or `Simulator.script`), a `SIM:{...}` directive in the last user/tool message, or a
deterministic default answer (see `proxy.simulator_script`). Script fields:

  content  reasoning, text, text_words n (n words of text), tool_calls [{name, arguments (str | object),
           id?}], finish, usage (false: no usage chunk), cached_tokens, chunk_chars
  hostile  ignore_max_tokens (generate past max_tokens), usage_override {...} (merged into every
           usage object, nested dicts too: any values, e.g. {"prompt_tokens": -5})
  faults   error_first {message, code, type?} | true, error_after n (+ error {...}),
           flat_error, status + body (+ content_type, headers), drop_after n,
           reset_before_headers, garbage (true | str), endless_line (true | MB),
           delay s, first_byte_delay s, stall_after n, coalesce, keepalive

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /health, POST /tokenize (vLLM),
POST /v1/tokenize + GET /ready + GET /health_generate (SGLang), POST|DELETE /sim/script,
GET|DELETE /sim/requests, GET /sim/state.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from proxy.simulator_script import (
    Generation,
    PrefixCache,
    default_plan,
    find_directive,
    generate,
    new_tool_id,
    render_prompt,
    script_plan,
    token_id,
    tokenize,
)
from proxy.state import SIM_STATE

VLLM_VERSION = "0.32.0"
SGLANG_EOS = 151645  # matched_stop printed by SGLang when generation hit EOS

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "ForbiddenError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


@dataclass
class SimState:
    dialect: str
    models: tuple[str, ...]
    max_model_len: int
    seed: int
    queue: deque = field(default_factory=deque)
    requests: list = field(default_factory=list)
    cache: PrefixCache = field(default_factory=PrefixCache)
    in_flight: int = 0
    cancelled: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(f"{self.seed}:{','.join(self.models)}".encode()).hexdigest()
        return f"vllm-{VLLM_VERSION}-{digest[:8]}"


# --------------------------------------------------------------------------- helpers


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else _dumps(obj)) + b"\n\n"


def _server_headers(st: SimState) -> dict[str, str]:
    headers = {"server": "uvicorn"}
    if st.dialect == "vllm":
        headers["vary"] = "Origin"
    return headers


def _json_response(st: SimState, obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=_dumps(obj), status=status, content_type="application/json", headers=_server_headers(st)
    )


def _error_obj(st: SimState, message: str, status: int, *, type: str | None = None, param: str | None = None,
               flat: bool | None = None) -> dict:
    """vLLM: {"error": {message, type, param, code}}; SGLang (or flat): {object, message, type, param, code}."""
    err_type = type or ERROR_TYPES.get(status, "InternalServerError")
    if flat if flat is not None else st.dialect == "sglang":
        return {"object": "error", "message": message, "type": err_type, "param": param, "code": status}
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def _error(st: SimState, message: str, status: int, **kw: Any) -> web.Response:
    return _json_response(st, _error_obj(st, message, status, **kw), status)


def _validation_error(st: SimState, detail: dict) -> web.Response:
    """FastAPI/pydantic's 400 for a body that fails validation, as vLLM prints it."""
    loc = detail["loc"]
    message = f"1 validation error:\n  {detail!r}"
    return _error(st, message, 400, type="Bad Request", param=loc)


def _stream_error_line(st: SimState, message: str, code: int, err_type: str | None, flat: bool) -> bytes:
    """A mid-stream error event, as vLLM/SGLang's create_streaming_error_response (json.dumps) print it."""
    obj = _error_obj(st, message, code, type=err_type, flat=True if flat else False)
    if not flat and st.dialect == "sglang":
        obj = {"error": _error_obj(st, message, code, type=err_type, flat=True)}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class _ClientGone(ConnectionResetError):
    pass


async def _sleep(request: web.Request, seconds: float) -> None:
    """Sleep, but notice the client going away (raises ConnectionResetError)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise _ClientGone("client went away")
        left = end - loop.time()
        if left <= 0:
            return
        await asyncio.sleep(min(left, 0.05))


def _abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


# --------------------------------------------------------------------------- the chat request


@dataclass
class Chat:
    """One validated chat request on its way to bytes."""

    st: SimState
    body: dict
    script: dict
    gen: Generation
    prompt_tokens: int
    cached_tokens: int
    created_cache_tokens: int
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = secrets.token_hex(16) if self.st.dialect == "sglang" else "chatcmpl-" + secrets.token_hex(8)
        self.created = int(time.time())

    @property
    def model(self) -> str:
        return self.body.get("model") or self.st.models[0]

    @property
    def stream_options(self) -> dict:
        so = self.body.get("stream_options")
        return so if isinstance(so, dict) else {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options.get("include_usage")) and self.script.get("usage", True) is not False

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.get("continuous_usage_stats"))

    # ---- usage objects

    def _override(self, u: dict) -> dict:
        """A hostile upstream's usage: script `usage_override` merged in (one level deep)."""
        extra = self.script.get("usage_override")
        if isinstance(extra, dict):
            for k, v in extra.items():
                if isinstance(v, dict) and isinstance(u.get(k), dict):
                    u[k] = {**u[k], **v}
                else:
                    u[k] = v
        return u

    def usage_final(self, *, stream: bool) -> dict:
        return self._override(self._usage_final(stream=stream))

    def usage_running(self, completion: int) -> dict:
        return self._override(self._usage_running(completion))

    def _usage_final(self, *, stream: bool) -> dict:
        g = self.gen
        u: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + g.completion_tokens,
            "completion_tokens": g.completion_tokens,
        }
        if self.st.dialect == "sglang":
            u["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
            u["reasoning_tokens"] = g.reasoning_tokens
            return u
        details: dict[str, Any] = {"cached_tokens": self.cached_tokens,
                                   "created_cache_tokens": self.created_cache_tokens}
        if not stream:
            details["multimodal_tokens"] = None
        u["prompt_tokens_details"] = details
        u["completion_tokens_details"] = {"reasoning_tokens": g.reasoning_tokens}
        return u

    def _usage_running(self, completion: int) -> dict:
        u: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion,
            "completion_tokens": completion,
        }
        if self.st.dialect == "sglang":
            u["prompt_tokens_details"] = None
            u["reasoning_tokens"] = 0
        else:
            u["completion_tokens_details"] = None
        return u

    # ---- stream events: (kind, bytes); kind in role | delta | finish | usage | done

    def events(self) -> list[tuple[str, bytes]]:
        return self._sglang_events() if self.st.dialect == "sglang" else self._vllm_events()

    def _head(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}

    def _vllm_events(self) -> list[tuple[str, bytes]]:
        g, out = self.gen, []
        cont = self.continuous_usage
        usage_chunk = self.include_usage
        first = self._head()
        first["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]
        if cont:
            first["usage"] = self.usage_running(0)
        first["prompt_token_ids"] = None
        first["prompt_text"] = None
        out.append(("role", _sse(first)))

        finish_on_last = g.finish == "length" and bool(g.deltas)
        done_tokens = 0
        for i, d in enumerate(g.deltas):
            done_tokens += d.tokens
            if d.kind == "reasoning":
                delta: dict[str, Any] = {"reasoning": d.text}
            elif d.kind == "content":
                delta = {"content": d.text}
            elif d.kind == "call":
                delta = {"content": None, "tool_calls": [{"id": d.call.id, "type": "function", "index": d.index,
                                                          "function": {"name": d.call.name}}]}
            else:
                delta = {"content": None, "tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}
            last = finish_on_last and i == len(g.deltas) - 1
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": g.finish if last else None}
            if last:
                choice["stop_reason"] = None
            choice["token_ids"] = None
            chunk = self._head()
            chunk["choices"] = [choice]
            if cont:
                chunk["usage"] = self.usage_running(done_tokens)
            if last and not usage_chunk:
                chunk["system_fingerprint"] = self.st.fingerprint
            out.append(("finish" if last else "delta", _sse(chunk)))
        if not finish_on_last:
            chunk = self._head()
            chunk["choices"] = [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": g.finish,
                                 "stop_reason": None, "token_ids": None}]
            if cont:
                chunk["usage"] = self.usage_running(done_tokens)
            if not usage_chunk:
                chunk["system_fingerprint"] = self.st.fingerprint
            out.append(("finish", _sse(chunk)))
        if usage_chunk:
            chunk = self._head()
            chunk["choices"] = []
            chunk["usage"] = self.usage_final(stream=True)
            chunk["system_fingerprint"] = self.st.fingerprint
            out.append(("usage", _sse(chunk)))
        out.append(("done", b"data: [DONE]\n\n"))
        return out

    def _sglang_events(self) -> list[tuple[str, bytes]]:
        g, out = self.gen, []
        cont = self.continuous_usage

        def chunk(delta: dict, finish: str | None = None, matched: Any = None, used: int = 0) -> bytes:
            c = self._head()
            c["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                             "matched_stop": matched}]
            c["usage"] = self.usage_running(used) if cont else None
            return _sse(c)

        def delta(role=None, content=None, reasoning=None, tool_calls=None) -> dict:
            return {"role": role, "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}

        out.append(("role", chunk(delta(role="assistant", content=""))))
        used = 0
        # SGLang sends each tool call whole, in one chunk, arguments re-serialised.
        calls = {c.id: c for c in g.calls()}
        for d in g.deltas:
            if d.kind == "args":
                continue
            if d.kind == "call":
                call = calls[d.call.id]
                used += sum(x.tokens for x in g.deltas if x.kind == "args" and x.index == d.index)
                tc = [{"id": call.id, "index": d.index, "type": "function",
                       "function": {"name": call.name, "arguments": _reserialise(call.arguments)}}]
                out.append(("delta", chunk(delta(tool_calls=tc), used=used)))
                continue
            used += d.tokens
            if d.kind == "reasoning":
                out.append(("delta", chunk(delta(reasoning=d.text), used=used)))
            else:
                out.append(("delta", chunk(delta(content=d.text), used=used)))
        matched = SGLANG_EOS if g.finish == "stop" else None
        out.append(("finish", chunk(delta(), g.finish, matched, used=used)))
        if self.include_usage:
            c = self._head()
            c["choices"] = []
            c["usage"] = self.usage_final(stream=True)
            out.append(("usage", _sse(c)))
        out.append(("done", b"data: [DONE]\n\n"))
        return out

    # ---- non-stream body

    def completion(self) -> dict:
        g = self.gen
        text, reasoning, calls = g.text(), g.reasoning(), g.calls()
        head = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model}
        if self.st.dialect == "sglang":
            message = {"role": "assistant", "content": text or None, "reasoning_content": reasoning or None,
                       "tool_calls": [{"id": c.id, "index": i, "type": "function",
                                       "function": {"name": c.name, "arguments": _reserialise(c.arguments)}}
                                      for i, c in enumerate(calls)] or None}
            head["choices"] = [{"index": 0, "message": message, "logprobs": None, "finish_reason": g.finish,
                                "matched_stop": SGLANG_EOS if g.finish == "stop" else None}]
            head["usage"] = self.usage_final(stream=False)
            head["metadata"] = {"weight_version": "default"}
            if self.script.get("usage", True) is False:
                del head["usage"]
            return head
        message = {"role": "assistant", "content": text if text else ("" if calls else None), "refusal": None,
                   "annotations": None, "audio": None, "function_call": None}
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        message["reasoning"] = reasoning or None
        head["choices"] = [{"index": 0, "message": message, "logprobs": None, "finish_reason": g.finish,
                            "stop_reason": None, "token_ids": None, "routed_experts": None}]
        head.update({
            "service_tier": None,
            "system_fingerprint": self.st.fingerprint,
            "usage": self.usage_final(stream=False),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        })
        if self.script.get("usage", True) is False:
            del head["usage"]
        return head


def _reserialise(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return arguments


# --------------------------------------------------------------------------- validation


def _validate(st: SimState, raw: bytes) -> tuple[dict | None, web.Response | None]:
    """Parse and check a chat body like vLLM/SGLang: (body, None) or (maybe body, error response)."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        pos, msg = getattr(e, "pos", 0), getattr(e, "msg", str(e))
        return None, _validation_error(st, {"type": "json_invalid", "loc": f"body.{pos}", "msg": "JSON decode error",
                                            "input": "<dict of 0 items>", "ctx": {"error": msg}})
    if not isinstance(body, dict):
        msg = "Input should be a valid dictionary or object to extract fields from"
        return None, _validation_error(st, {"type": "model_attributes_type", "loc": "body", "msg": msg, "input": body})
    st.requests.append(body)
    messages = body.get("messages")
    if "messages" not in body:
        return body, _validation_error(st, {"type": "missing", "loc": "body.messages", "msg": "Field required",
                                            "input": body})
    if not isinstance(messages, list):
        return body, _validation_error(st, {"type": "list_type", "loc": "body.messages",
                                            "msg": "Input should be a valid list", "input": messages})
    model = body.get("model")
    if model is not None and model not in st.models:
        message = f"The model `{model}` does not exist."
        if st.dialect == "vllm":
            message += f" Valid aliases: {', '.join(st.models)}."
        return body, _error(st, message, 404, param="model")
    return body, None


def _max_tokens(body: dict) -> Any:
    mt = body.get("max_completion_tokens")
    return body.get("max_tokens") if mt is None else mt


def _context_check(st: SimState, body: dict, prompt_tokens: int) -> tuple[int | None, web.Response | None]:
    """vLLM: overlong prompt or max_tokens > max_model_len is a 400; prompt + max_tokens over is clamped.
    SGLang: prompt + max_tokens over is a 400 too."""
    mml = st.max_model_len
    mt = _max_tokens(body)
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        return None, _error(st, f"max_tokens must be at least 1, got {mt}.", 400, param="max_tokens")
    if st.dialect == "sglang":
        if prompt_tokens >= mml:
            return None, _error(st, f"The input ({prompt_tokens} tokens) is longer than the model's context "
                                    f"length ({mml} tokens).", 400)
        if mt is not None and prompt_tokens + mt > mml:
            return None, _error(st, f"Requested token count exceeds the model's maximum context length of {mml} "
                                    f"tokens. You requested a total of {prompt_tokens + mt} tokens: {prompt_tokens} "
                                    f"tokens from the input messages and {mt} tokens for the completion. Please "
                                    f"reduce the number of tokens in the input messages or the completion to fit "
                                    f"within the limit.", 400)
        return (mt if mt is not None else mml - prompt_tokens), None
    if mt is not None and mt > mml:
        return None, _error(st, f"max_tokens={mt} cannot be greater than max_model_len={mml}. Please request fewer "
                                f"output tokens. (parameter=max_tokens, value={mt})", 400, param="max_tokens")
    if prompt_tokens > mml:
        return None, _error(st, f"This model's maximum context length is {mml} tokens. However, your prompt "
                                f"contains at least {prompt_tokens} input tokens, which exceeds this limit even "
                                f"without any output tokens. Please reduce the length of the input prompt. "
                                f"(parameter=input_tokens, value={prompt_tokens})", 400, param="input_tokens")
    room = mml - prompt_tokens
    return (room if mt is None else min(mt, room)), None


# --------------------------------------------------------------------------- handlers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[SIM_STATE]
    body, err = _validate(st, await request.read())
    if err is not None:
        return err
    assert body is not None
    messages = body["messages"]
    prompt = render_prompt(messages, body.get("tools"))
    tokens = tokenize(prompt)
    max_tokens, err = _context_check(st, body, len(tokens))
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
        await _sleep(request, float(s["first_byte_delay"]))
    if s.get("reset_before_headers"):
        _abort(request)
        return web.Response(status=500)  # never reaches the client
    if s.get("status"):
        status = int(s["status"])
        headers = _server_headers(st)
        headers.update({str(k): str(v) for k, v in (s.get("headers") or {}).items()})
        if "body" in s:
            text = s["body"] if isinstance(s["body"], str) else json.dumps(s["body"])
            ctype = s.get("content_type") or ("application/json" if text.lstrip()[:1] in ("{", "[") else "text/html")
            return web.Response(status=status, text=text, content_type=ctype, headers=headers)
        obj = _error_obj(st, str(s.get("message") or "simulated upstream error"), status,
                         flat=True if s.get("flat_error") else None)
        return web.Response(status=status, body=_dumps(obj), content_type="application/json", headers=headers)
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
        await _sleep(request, float(s["delay"]) * n)
    if s.get("stall_after") is not None:
        await _sleep(request, math.inf)
    if s.get("drop_after") is not None:
        _abort(request)
        return web.Response(status=500)
    for key in ("error_first", "error_after"):
        if s.get(key) is not None and s.get(key) is not False:
            message, code, err_type = _script_error(chat, "error_first" if key == "error_first" else "error")
            return _json_response(st, _error_obj(st, message, code, type=err_type,
                                                 flat=True if s.get("flat_error") else None), code)
    if s.get("garbage"):
        text = s["garbage"] if isinstance(s["garbage"], str) else "<html>not json</html>"
        return web.Response(text=text, content_type="application/json", headers=_server_headers(st))
    if s.get("endless_line"):
        return await _endless(request, chat, web.StreamResponse(headers={"content-type": "application/json",
                                                                         **_server_headers(st)}), b"")
    return _json_response(st, chat.completion())


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
    resp = web.StreamResponse(status=200, headers={"content-type": SSE_CONTENT_TYPE, **_server_headers(st)})
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
            await _sleep(request, delay)
        await resp.write(data)
        wrote_any = True

    async def flush() -> None:
        if buf:
            await resp.write(bytes(buf))
            buf.clear()

    flat = bool(s.get("flat_error"))
    if s.get("error_first") is not None and s.get("error_first") is not False:
        message, code, err_type = _script_error(chat, "error_first")
        await emit(_stream_error_line(st, message, code, err_type, flat))
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
                        await emit(_stream_error_line(st, message, code, err_type, flat))
                        await emit(b"data: [DONE]\n\n")
                        await flush()
                        return resp
                    if key == "drop_after":
                        _abort(request)
                        return resp
                    await _sleep(request, math.inf)  # stall_after
            if endless:
                await flush()
                return await _endless(request, chat, resp, b"")
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
    return _json_response(st, {"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200, headers=_server_headers(request.app[SIM_STATE]))


async def tokenize_handler(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    try:
        body = json.loads(await request.read())
    except ValueError as e:
        return _error(st, f"JSON decode error: {e}", 400)
    if not isinstance(body, dict):
        return _error(st, "body must be a JSON object", 400)
    if isinstance(body.get("messages"), list):
        # As vLLM 0.32: its chat endpoint renames an assistant's reasoning_content to
        # reasoning, its /tokenize reads only reasoning. SGLang reads reasoning_content.
        keys = ("reasoning",) if st.dialect == "vllm" else ("reasoning_content",)
        text = render_prompt(body["messages"], body.get("tools"), body.get("add_generation_prompt", True) is not False,
                             reasoning_keys=keys)
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        return _error(st, "Either 'prompt' or 'messages' must be provided.", 400)
    toks = tokenize(text)
    ids = [token_id(t) for t in toks]
    if st.dialect == "sglang":
        return _json_response(st, {"tokens": ids, "count": len(ids), "max_model_len": st.max_model_len})
    return _json_response(st, {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids,
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
    return web.Response(body=_dumps(st.requests), content_type="application/json")


async def sim_state(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    return web.json_response({"dialect": st.dialect, "models": list(st.models), "in_flight": st.in_flight,
                              "cancelled": st.cancelled, "queued": len(st.queue), "requests": len(st.requests)})


def create_app(*, dialect: str = "vllm", models: tuple[str, ...] | list[str] = ("tiny-org/tiny-model",),
               max_model_len: int = 32768, seed: int = 0) -> web.Application:
    if dialect not in ("vllm", "sglang"):
        raise ValueError(f"unknown dialect {dialect!r} (vllm | sglang)")
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SIM_STATE] = SimState(dialect, tuple(models), int(max_model_len), int(seed))
    app.router.add_post("/v1/chat/completions", chat_completions)
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

    def __init__(self, *, dialect: str = "vllm", models: tuple[str, ...] | list[str] = ("tiny-org/tiny-model",),
                 max_model_len: int = 32768, host: str = "127.0.0.1", port: int = 0, seed: int = 0):
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

    async def __aenter__(self) -> "Simulator":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m proxy.simulator", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dialect", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--model", action="append", help="served model name (repeatable; default tiny-org/tiny-model)")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    app = create_app(dialect=args.dialect, models=tuple(args.model or ["tiny-org/tiny-model"]),
                     max_model_len=args.max_model_len, seed=args.seed)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, access_log=None,
                print=lambda _: print(f"simulator ({args.dialect}) on http://{args.host}:{args.port}", flush=True))


if __name__ == "__main__":
    main()
