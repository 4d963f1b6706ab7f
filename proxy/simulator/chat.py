"""The simulator's chat request: its state, validation, and the answer built as vLLM/SGLang bytes.

proxy/simulator/server.py serves these over aiohttp (handlers, faults, `Simulator`, the CLI);
proxy/simulator/script.py turns a script or a prompt into the generation planned here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from proxy.simulator.script import Generation, PrefixCache

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
    traceparents: list = field(default_factory=list)  # each chat request's W3C traceparent (None: none sent)
    cache: PrefixCache = field(default_factory=PrefixCache)
    in_flight: int = 0
    peak_in_flight: int = 0  # the most requests in flight at once (tests of shared limits reset it)
    cancelled: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(f"{self.seed}:{','.join(self.models)}".encode()).hexdigest()
        return f"vllm-{VLLM_VERSION}-{digest[:8]}"


# --------------------------------------------------------------------------- helpers


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else dumps(obj)) + b"\n\n"


def server_headers(st: SimState) -> dict[str, str]:
    headers = {"server": "uvicorn"}
    if st.dialect == "vllm":
        headers["vary"] = "Origin"
    return headers


def json_answer(st: SimState, obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=dumps(obj), status=status, content_type="application/json", headers=server_headers(st)
    )


def error_object(st: SimState, message: str, status: int, *, type: str | None = None, param: str | None = None,
               flat: bool | None = None) -> dict:
    """vLLM: {"error": {message, type, param, code}}; SGLang (or flat): {object, message, type, param, code}."""
    err_type = type or ERROR_TYPES.get(status, "InternalServerError")
    if flat if flat is not None else st.dialect == "sglang":
        return {"object": "error", "message": message, "type": err_type, "param": param, "code": status}
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_answer(st: SimState, message: str, status: int, **kw: Any) -> web.Response:
    return json_answer(st, error_object(st, message, status, **kw), status)


def _validation_error(st: SimState, detail: dict) -> web.Response:
    """FastAPI/pydantic's 400 for a body that fails validation, as vLLM prints it."""
    loc = detail["loc"]
    message = f"1 validation error:\n  {detail!r}"
    return error_answer(st, message, 400, type="Bad Request", param=loc)


def stream_error_line(st: SimState, message: str, code: int, err_type: str | None, flat: bool) -> bytes:
    """A mid-stream error event, as vLLM/SGLang's create_streaming_error_response (json.dumps) print it."""
    obj = error_object(st, message, code, type=err_type, flat=True if flat else False)
    if not flat and st.dialect == "sglang":
        obj = {"error": error_object(st, message, code, type=err_type, flat=True)}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class _ClientGone(ConnectionResetError):
    pass


async def sleep_unless_gone(request: web.Request, seconds: float) -> None:
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


def abort_connection(request: web.Request) -> None:
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
                assert d.call is not None  # a "call" delta carries its call
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
                assert d.call is not None
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


def validate_chat(st: SimState, raw: bytes) -> tuple[dict | None, web.Response | None]:
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
        return body, error_answer(st, message, 404, param="model")
    return body, None


def _max_tokens(body: dict) -> Any:
    mt = body.get("max_completion_tokens")
    return body.get("max_tokens") if mt is None else mt


def context_check(st: SimState, body: dict, prompt_tokens: int) -> tuple[int | None, web.Response | None]:
    """vLLM: overlong prompt or max_tokens > max_model_len is a 400; prompt + max_tokens over is clamped.
    SGLang: prompt + max_tokens over is a 400 too."""
    mml = st.max_model_len
    mt = _max_tokens(body)
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        return None, error_answer(st, f"max_tokens must be at least 1, got {mt}.", 400, param="max_tokens")
    if st.dialect == "sglang":
        if prompt_tokens >= mml:
            return None, error_answer(st, f"The input ({prompt_tokens} tokens) is longer than the model's context "
                                    f"length ({mml} tokens).", 400)
        if mt is not None and prompt_tokens + mt > mml:
            return None, error_answer(st, f"Requested token count exceeds the model's maximum context length of {mml} "
                                    f"tokens. You requested a total of {prompt_tokens + mt} tokens: {prompt_tokens} "
                                    f"tokens from the input messages and {mt} tokens for the completion. Please "
                                    f"reduce the number of tokens in the input messages or the completion to fit "
                                    f"within the limit.", 400)
        return (mt if mt is not None else mml - prompt_tokens), None
    if mt is not None and mt > mml:
        return None, error_answer(st, f"max_tokens={mt} cannot be greater than max_model_len={mml}. Please request "
                                  f"fewer output tokens. (parameter=max_tokens, value={mt})", 400, param="max_tokens")
    if prompt_tokens > mml:
        return None, error_answer(st, f"This model's maximum context length is {mml} tokens. However, your prompt "
                                f"contains at least {prompt_tokens} input tokens, which exceeds this limit even "
                                f"without any output tokens. Please reduce the length of the input prompt. "
                                f"(parameter=input_tokens, value={prompt_tokens})", 400, param="input_tokens")
    room = mml - prompt_tokens
    return (room if mt is None else min(mt, room)), None


SIM_STATE = web.AppKey("simulator_state", SimState)  # on the simulator's own app, not the proxy's
