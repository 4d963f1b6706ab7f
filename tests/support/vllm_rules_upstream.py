"""A fake model server that does what vLLM 0.32 does with each field that costs, and records it.

Not the simulator: this one exists to be honest about the work, so an attack on the edge can be
judged against the truth. Its rules are vLLM's (vllm/entrypoints/openai/chat_completion/serving.py,
completion/serving.py, serve/utils/api_utils.py get_max_tokens, anthropic/serving.py):

  * chat: the cap is `max_completion_tokens` when set, else `max_tokens`, else the window;
    `n` answers; a completion's default cap is 16 (`max_tokens: null`: the window); a list of
    prompts is one answer set per prompt; `best_of` is not read (vLLM 0.32 has none);
  * every role string is rendered into the prompt, as are names, tools and documents;
  * `ignore_eos`: every answer runs to its cap (else each writes `words` tokens, at most the cap);
  * `logprobs` / `top_logprobs`: each token carries them in vLLM's JSON shape (~55 bytes per
    alternative), so an answer's size follows them;
  * usage is what it generated, compact JSON; an OpenAI stream is written in ONE write (a
    coalesced read), an Anthropic one event by event (paced reads).

`generated` is the truth: the output tokens the server produced for every request, summed.
Tokens: one per whitespace-separated word of the prompt's rendered text; "tok " per output token.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from aiohttp import web

WINDOW = 1_000_000


class VLLMRules:
    def __init__(self, *, words: int = 30, model: str = "tiny-model") -> None:
        self.words = words
        self.model = model
        self.generated = 0
        self.prompt_tokens = 0
        self.requests: list[dict] = []
        self.usage_spaces = False  # write usage as `"usage": {` (legal JSON, spaces)
        self.app = web.Application(client_max_size=1024 ** 3)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/messages", self.messages)
        self.app.router.add_post("/v1/embeddings", self.embeddings)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int) -> None:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "max_model_len": WINDOW}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") if "prompt" in body else self._render(body.get("messages") or [], body)
        n = len(str(text).split())
        return web.json_response({"count": n, "max_model_len": WINDOW, "tokens": list(range(n))})

    # ------------------------------------------------------------------ rules

    @staticmethod
    def _render(messages: list, body: dict) -> str:
        parts = []
        for m in messages:
            parts.append(f"<|{m.get('role')}|>")  # any role string, rendered as sent
            for key in ("name", "content", "reasoning_content", "tool_call_id"):
                value = m.get(key)
                parts.append(value if isinstance(value, str) else json.dumps(value) if value else "")
            if m.get("tool_calls"):
                parts.append(json.dumps(m["tool_calls"]))
        for key in ("tools", "documents", "chat_template_kwargs"):
            if body.get(key):
                parts.append(json.dumps(body[key]))
        return " ".join(parts)

    def _length(self, body: dict, cap: int | None) -> int:
        cap = WINDOW if cap is None else cap
        return cap if body.get("ignore_eos") else min(self.words, cap)

    def _logprobs(self, body: dict, chat: bool) -> int:
        if chat:
            return int(body.get("top_logprobs") or 0) + 1 if body.get("logprobs") else 0
        return int(body["logprobs"]) + 1 if body.get("logprobs") is not None else 0

    def _usage(self, prompt: int, output: int) -> bytes:
        self.generated += output
        self.prompt_tokens += prompt
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + output, "completion_tokens": output}
        raw = orjson.dumps(usage)
        return b'"usage": ' + raw.replace(b",", b", ").replace(b":", b": ") if self.usage_spaces \
            else b'"usage":' + raw

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        prompt = len(self._render(body["messages"], body).split())
        mct = body.get("max_completion_tokens")
        cap = mct if mct is not None else body.get("max_tokens")
        n = int(body.get("n") or 1)
        length = self._length(body, cap)
        alts = self._logprobs(body, chat=True)
        return await self._answer(request, body, prompt, [length] * n, alts, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        raw = body["prompt"]
        prompts = raw if isinstance(raw, list) and raw and not isinstance(raw[0], int) else [raw]
        prompt = sum(len(p) if isinstance(p, list) else len(str(p).split()) for p in prompts)
        cap = body.get("max_tokens", 16)
        n = int(body.get("n") or 1)
        length = self._length(body, cap)
        alts = self._logprobs(body, chat=False)
        return await self._answer(request, body, prompt, [length] * (n * len(prompts)), alts, chat=False)

    async def _answer(self, request: web.Request, body: dict, prompt: int, lengths: list[int], alts: int,
                      chat: bool) -> web.StreamResponse:
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": "x-1", "object": kind + (".chunk" if chat and body.get("stream") else ""), "created": 1,
                "model": self.model}
        lp = ({"content": [{"token": "tok", "logprob": -1.0, "bytes": [116, 111, 107],
                            "top_logprobs": [{"token": f"t{i}", "logprob": -1.5, "bytes": [116]}
                                             for i in range(alts - 1)]}]} if alts else None)
        usage = self._usage(prompt, sum(lengths))
        if not body.get("stream"):
            choices = []
            for i, length in enumerate(lengths):
                text = "tok " * length
                logprobs = {"content": lp["content"] * length} if lp else None
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                                "finish_reason": "length"} if chat else
                               {"index": i, "text": text, "logprobs": logprobs, "finish_reason": "length"})
            out = orjson.dumps({**head, "choices": choices})
            return web.Response(body=out[:-1] + b"," + usage + b"}", content_type="application/json")
        events = []
        for i, length in enumerate(lengths):
            for t in range(length):
                finish = "length" if t == length - 1 else None
                choice = ({"index": i, "delta": {"content": "tok "}, "logprobs": lp, "finish_reason": finish} if chat
                          else {"index": i, "text": "tok ", "logprobs": lp, "finish_reason": finish})
                events.append(b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(b"data: " + orjson.dumps({**head, "choices": []})[:-1] + b"," + usage + b"}\n\n")
        events.append(b"data: [DONE]\n\n")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join(events))  # one write: the proxy reads it coalesced
        await resp.write_eof()
        return resp

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        raw = body["input"]
        inputs = raw if isinstance(raw, list) and raw and not isinstance(raw[0], int) else [raw]
        prompt = sum(len(p) if isinstance(p, list) else len(str(p).split()) for p in inputs)
        self.prompt_tokens += prompt
        return web.json_response({"object": "list", "model": self.model,
                                  "data": [{"index": i, "object": "embedding", "embedding": [0.5, -0.5]}
                                           for i in range(len(inputs))],
                                  "usage": {"prompt_tokens": prompt, "total_tokens": prompt}})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's /v1/messages as vLLM 0.32 streams it with a reasoning parser: thinking
        deltas, then the signature_delta that closes the block (no token of its own), then text."""
        body = await request.json()
        self.requests.append(body)
        prompt = len(self._render([{"role": m.get("role"), "content": m.get("content")} for m in body["messages"]],
                                  body).split())
        length = self._length(body, body["max_tokens"])
        thinking = length // 2
        self._usage(prompt, length)

        def ev(kind: str, obj: dict[str, Any]) -> bytes:
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **obj}) + b"\n\n"

        events = [ev("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                   "content": [], "model": self.model, "stop_reason": None,
                                                   "usage": {"input_tokens": prompt, "output_tokens": 0}}}),
                  ev("content_block_start", {"index": 0, "content_block": {"type": "thinking", "thinking": ""}})]
        events += [ev("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": "hm "}})
                   for _ in range(thinking)]
        events += [ev("content_block_delta", {"index": 0, "delta": {"type": "signature_delta",
                                                                    "signature": "04679e80b748466fbd5a1a1088d372a7"}}),
                   ev("content_block_stop", {"index": 0}),
                   ev("content_block_start", {"index": 1, "content_block": {"type": "text", "text": ""}})]
        events += [ev("content_block_delta", {"index": 1, "delta": {"type": "text_delta", "text": "tok "}})
                   for _ in range(length - thinking)]
        events += [ev("content_block_stop", {"index": 1}),
                   ev("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                        "usage": {"input_tokens": prompt, "output_tokens": length}}),
                   ev("message_stop", {})]
        if not body.get("stream"):
            return web.json_response({"id": "msg_1", "type": "message", "role": "assistant", "model": self.model,
                                      "content": [{"type": "thinking", "thinking": "hm " * thinking, "signature": "s"},
                                                  {"type": "text", "text": "tok " * (length - thinking)}],
                                      "stop_reason": "max_tokens",
                                      "usage": {"input_tokens": prompt, "output_tokens": length}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:  # paced, as vLLM streams them: the proxy reads them one by one
            await resp.write(event)
            await asyncio.sleep(0.002)
        await resp.write_eof()
        return resp
