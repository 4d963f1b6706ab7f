"""The JSON answer of POST /v1/responses (stream: false): the worker's chat completion read
whole, as one Response (json_answer); its usage, when the worker reported none, from the
worker's tokenizer (count_usage)."""

from __future__ import annotations

import aiohttp
import orjson

from proxy.errors import APIError
from proxy.protocol.response import ResponseContext, client_usage, map_usage
from proxy.protocol.rewriter import completion_response
from proxy.protocol.translate import Translation
from proxy.upstream.exchange import Attempt, Retryable, upstream_message
from proxy.upstream.tokens import TokenCounter


def json_answer(attempt: Attempt, rctx: ResponseContext, body: bytes) -> dict:
    """The Response for the worker's answer `body`, its report made; the report has no usage
    when the worker reported none (then count_usage asks the worker's tokenizer)."""
    worker = attempt.worker
    try:
        completion = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise Retryable(worker, "garbage body", APIError(502, "The model server sent an unreadable answer.",
                                                          code="upstream_error")) from None
    if not isinstance(completion, dict) or "error" in completion or completion.get("object") == "error":
        message, _ = upstream_message(body)
        raise APIError(502, message or "The model server failed.", code="upstream_error")
    response, reported = completion_response(rctx, completion)
    if completion.get("usage"):
        attempt.end(response["status"], reported, 0, rctx.output_cap, shown=response["usage"])
    else:  # as counted (one per item with text) until the worker's tokenizer says, if it can
        attempt.end(response["status"], None, int(response["usage"]["output_tokens"]), rctx.output_cap)
    return response


def _output_text(response: dict) -> str:
    """Everything the model wrote in a Response: its text, reasoning and call arguments."""
    parts: list[str] = []
    for item in response.get("output") or ():
        kind = item.get("type")
        if kind == "message":
            parts.extend(c.get("text") or "" for c in item.get("content") or ())
        elif kind == "reasoning":
            parts.extend(c.get("text") or "" for c in item.get("summary") or ())
        elif kind == "function_call":
            parts.append(item.get("arguments") or "")
        elif kind == "custom_tool_call":
            parts.append(item.get("input") or "")
    return "".join(parts)


async def count_usage(session: aiohttp.ClientSession, attempt: Attempt, t: Translation, rctx: ResponseContext,
                       response: dict) -> None:
    """A non-stream answer without a usage report: the worker's tokenizer counts the prompt and
    the output, so the client, the access line, the metrics and the bill show what it really
    processed. Left as counted when the worker cannot say."""
    worker = attempt.worker
    status = response["status"]
    counted = int(response["usage"]["output_tokens"])
    counter = TokenCounter(session)
    prompt = await counter.prompt(t, worker)
    text = _output_text(response) if prompt is not None else ""
    output = await counter.text(worker, t.upstream_model, text) if text else 0
    if prompt is None or output is None:
        attempt.end(status, None, counted, rctx.output_cap, count_failed=True)  # the balance does not ask again
        return
    usage = map_usage({"prompt_tokens": prompt, "completion_tokens": output})
    response["usage"] = client_usage(usage, rctx.output_cap)
    attempt.end(status, usage, counted, rctx.output_cap)
