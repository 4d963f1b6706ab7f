"""Token counts from the workers' own tokenizers: the one counter of the proxy.

vLLM's POST /tokenize and SGLang's POST /v1/tokenize count a chat prompt with the model's chat
template, or a plain text. Who asks: the balance (a prompt as a worker counts it, before
refusing a hold the byte bound does not fit, and for a bill without a usage report), the
context check (when the bound, proxy.protocol.prompt, says the prompt may not fit), the
handler of a non-stream answer without usage (its prompt and its output text) and
/v1/responses/input_tokens (which reports why a count failed, so it calls `count_tokens`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import orjson

from proxy.protocol.dialects import messages_for

if TYPE_CHECKING:
    from proxy.upstream.workers import Worker, WorkerPool

__all__ = ["TokenCountError", "TokenCounter", "count_tokens", "tokenize"]


class Prompt(Protocol):
    """What a count reads of a request: a Translation, or a pass-through's Passthrough."""

    @property
    def chat(self) -> dict: ...

    @property
    def upstream_model(self) -> str: ...


class TokenCountError(Exception):
    def __init__(self, message: str, *, connection: bool = False) -> None:
        super().__init__(message)
        self.connection = connection


async def count_tokens(session: aiohttp.ClientSession, worker: Worker, model: str, messages: list,
                       tools: list | None = None) -> int:
    """The worker's own count of a chat prompt, chat template included; TokenCountError saying
    why it could not be had."""
    body: dict[str, Any] = {"model": model, "messages": messages_for(messages, worker.dialect)}
    if tools:
        body["tools"] = tools
    return await tokenize(session, worker, body)


async def tokenize(session: aiohttp.ClientSession, worker: Worker, body: dict[str, Any]) -> int:
    """The `count` of the worker's tokenizer endpoint for `body` (messages or a prompt), or
    TokenCountError saying why it could not be had."""
    path = worker.tokenize_path
    timeout = aiohttp.ClientTimeout(total=worker.timeouts.first_byte, connect=worker.timeouts.connect)
    try:
        async with session.post(worker.endpoint(path), data=orjson.dumps(body), timeout=timeout,
                                headers={"Content-Type": "application/json", **worker.auth_headers()}) as upstream:
            raw = await upstream.read()
            if upstream.status != 200:
                raise TokenCountError(f"the model server could not count tokens ({upstream.status})")
            data = orjson.loads(raw)
    except aiohttp.ClientConnectionError as exc:
        raise TokenCountError(f"the model server could not be reached ({type(exc).__name__})",
                              connection=not isinstance(exc, aiohttp.ServerTimeoutError)) from None
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        raise TokenCountError(f"the model server could not count tokens ({type(exc).__name__})") from None
    count = data.get("count") if isinstance(data, dict) else None
    if isinstance(count, bool) or not isinstance(count, int):
        raise TokenCountError("the model server gave no token count")
    return count


class TokenCounter:
    """Counts that may be missing: None when the worker cannot say (unreachable, refused, no
    count, no session or pool yet, a session closed at shutdown). A count only sharpens a
    bound or a bill; it is never a reason for a request or a settlement to fail."""

    __slots__ = ("pool", "session")

    def __init__(self, session: aiohttp.ClientSession | None, pool: WorkerPool | None = None) -> None:
        self.session = session
        self.pool = pool

    def _worker(self, on: Worker | str | None, model: str) -> Worker | None:
        if on is not None and not isinstance(on, str):
            return on
        if self.pool is None:
            return None
        if on is None:  # any worker that could serve the request now
            return next((w for w in self.pool.workers if w.available and w.serves(model)), None)
        return next((w for w in self.pool.workers if w.name == on), None)

    async def prompt(self, t: Prompt, on: Worker | str | None = None) -> int | None:
        """The prompt's tokens (template included) as a worker counts them: `on` itself, the
        worker of that name (the one that served it), or with None any available worker
        serving the model (needs the pool)."""
        worker = self._worker(on, t.upstream_model)
        if worker is None or self.session is None:
            return None
        try:
            return await count_tokens(self.session, worker, t.upstream_model, t.chat.get("messages") or [],
                                      t.chat.get("tools"))
        except Exception:  # TokenCountError, or a session closed under a late settlement
            return None

    async def text(self, worker: Worker, model: str, text: str) -> int | None:
        """A plain text's tokens (no template, no special tokens): an answer's output."""
        if self.session is None:
            return None
        try:
            count = await tokenize(self.session, worker, {"model": model, "prompt": text,
                                                          "add_special_tokens": False})
        except Exception:  # as prompt()
            return None
        return count if count >= 0 else None
