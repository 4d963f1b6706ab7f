"""Cancellation and settlement (issue 25), played as the attacker through real HTTP:

  * a client that resets its connection at any moment of the hold (before, during or after
    the ledger call) never leaves a hold open: once the settlements are done, no hold row is
    left and every key's balance is its top-ups minus its debits;
  * a request cancelled mid-stream writes an access line, metrics and a usage row with the
    same figures (the access line waits for the settlement task);
  * a worker that cuts its stream mid-way is billed what it reported so far (its prompt
    count, the output seen), never the hold's upper bound, and the client's response.failed
    shows the same usage as the ledger row.

No wall-clock assertion: the loops below wait for a condition, bounded only so that a
broken tree fails instead of hanging.
"""

from __future__ import annotations

from typing import Any

import asyncio
import json

import orjson
import pytest

from middlewares.balance import wait_for_settlements
from proxy import state
from tests.conftest import sim_input
from tests.support.raw_chat_upstream import ChatUpstream
from tests.support.sdk_check import parse_sse
from tests.runtime.test_access_line import lines  # noqa: F401 (the access lines, as the envelope hands them over)
from tests.runtime.test_metrics import scrape, total
from tests.conftest import eventually

PRICES = {"default": {"input": 1_000_000, "cached_input": 100_000, "output": 1_000_000}}
MODEL = "tiny-org/tiny-model"


async def until(predicate, what: str):
    return await eventually(predicate, 30.0, what=what, step=0.005)


def responses_lines(lines: list[dict]) -> list[dict]:
    return [line for line in lines if line.get("path") == "/v1/responses"]


async def raw_post(p, key: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """POST /v1/responses on a raw socket (the test decides when it goes away)."""
    host, port = p.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = orjson.dumps(body)
    writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer " + key.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(payload)).encode()
                 + b"\r\n\r\n" + payload)
    await writer.drain()
    return reader, writer


def reset(writer: asyncio.StreamWriter) -> None:
    """The client goes away at once: a TCP reset, as a killed process leaves it."""
    writer.transport.abort()


async def assert_books_balance(p) -> None:
    await wait_for_settlements(p.app)
    ledger = p.ledger
    assert await ledger.holds() == [], await ledger.holds()
    for key_id, balance, expected in await ledger.audit():
        assert balance == expected, key_id


# --------------------------------------------------------------------------- the hold

class HoldGate:
    """Wraps the ledger's hold_up_to so the test can close the client's socket at a chosen
    moment of the hold: before the ledger call, while it is in flight, after it returned."""

    def __init__(self, ledger, moment: str) -> None:
        self.real = ledger.hold_up_to
        self.moment = moment
        self.entered = asyncio.Event()  # the moment has come: the test resets now
        self.proceed = asyncio.Event()  # the reset landed: the hold goes on
        self.calls = 0

    async def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls > 1:
            return await self.real(*args, **kwargs)
        if self.moment == "before":
            self.entered.set()
            await self.proceed.wait()
            return await self.real(*args, **kwargs)
        if self.moment == "during":
            # The ledger's operation is under way (its writer / its connection does it
            # whatever becomes of the caller); the caller is waiting for its answer.
            inner = asyncio.ensure_future(self.real(*args, **kwargs))
            self.entered.set()
            await self.proceed.wait()
            return await inner
        hold = await self.real(*args, **kwargs)  # "after": made, not yet handed back
        self.entered.set()
        await self.proceed.wait()
        return hold


@pytest.mark.parametrize("leases", [False, True])
@pytest.mark.parametrize("moment", ["before", "during", "after"])
async def test_a_reset_at_any_moment_of_the_hold_leaves_no_hold_open(make_proxy, lines, monkeypatch, moment,
                                                                      leases):
    balance = {} if leases else {"lease_max_micros": 0}
    p = await make_proxy({"prices": PRICES, "balance": balance})
    secret, record = await p.ledger.create_key("payer", balance_micros=50_000_000)
    gate = HoldGate(p.ledger, moment)
    monkeypatch.setattr(p.ledger, "hold_up_to", gate)
    reader, writer = await raw_post(p, secret, {"model": MODEL, "input": "hello there", "stream": True,
                                                "max_output_tokens": 50})
    await asyncio.wait_for(gate.entered.wait(), 10)
    reset(writer)
    # The reset has landed once the envelope ended the request (aiohttp cancelled the handler).
    await until(lambda: responses_lines(lines), "the cancelled request's access line")
    gate.proceed.set()
    await assert_books_balance(p)
    [line] = responses_lines(lines)
    assert line["status"] == 499 and line.get("cost_micros") is None
    key = await p.ledger.get_key(record.key_id)
    assert key.balance_micros == 50_000_000  # nothing reached a worker: nothing is charged
    assert await p.ledger.available(record.key_id) == 50_000_000  # and nothing stays held


async def test_resets_around_many_holds_leave_none_open(make_proxy, lines):
    """Resets 0-6 event-loop turns after sending, many times: no hold outlives its request."""
    p = await make_proxy({"prices": PRICES, "balance": {"lease_max_micros": 0}})
    secret, record = await p.ledger.create_key("payer", balance_micros=500_000_000)
    for i in range(60):
        reader, writer = await raw_post(p, secret, {"model": MODEL, "input": f"hello {i}", "stream": True,
                                                    "max_output_tokens": 20})
        for _ in range(i % 7):
            await asyncio.sleep(0)  # not a wait: reset at a different moment of the request each time
        reset(writer)
    await until(lambda: len(responses_lines(lines)) >= 60, "an access line per request")
    await assert_books_balance(p)
    debits = sum(u.debited_micros for u in await p.ledger.list_usage(record.key_id, limit=1000))
    key = await p.ledger.get_key(record.key_id)
    assert key.balance_micros == 500_000_000 - debits
    assert await p.ledger.available(record.key_id) == key.balance_micros


# --------------------------------------------------------------------------- cancelled mid-stream

async def read_until_deltas(reader: asyncio.StreamReader, n: int) -> bytes:
    got = b""
    while got.count(b"response.output_text.delta") < 2 * n:  # "event:" and "type" lines
        chunk = await asyncio.wait_for(reader.read(65536), 10)
        assert chunk, got
        got += chunk
    return got


@pytest.mark.parametrize("usage", [True, False])
async def test_a_stream_cancelled_mid_way_logs_and_counts_what_it_billed(make_proxy, lines, usage):
    p = await make_proxy({"prices": PRICES, "balance": {"lease_max_micros": 0}})
    secret, _ = await p.ledger.create_key("payer", balance_micros=50_000_000)
    script = {"text": "one two three four five six seven eight", "stall_after": 3}
    if not usage:
        script["usage"] = False  # an upstream that reports no usage: the tokenizer and the deltas bill
    reader, writer = await raw_post(p, secret, {"model": MODEL, "input": "tell me " + sim_input(**script),
                                                "stream": True, "max_output_tokens": 50})
    head = await read_until_deltas(reader, 3)
    request_id = head.split(b"x-request-id: ", 1)[1].split(b"\r\n", 1)[0].decode()
    reset(writer)
    await until(lambda: responses_lines(lines), "the cancelled request's access line")
    await assert_books_balance(p)
    row = await p.ledger.usage(request_id)
    assert row is not None and row.status == "cancelled" and row.cost_micros > 0
    [line] = responses_lines(lines)
    assert line["outcome"] == "cancelled"
    assert (line["input_tokens"], line["cached_tokens"], line["output_tokens"], line["cost_micros"]) == \
           (row.input_tokens, row.cached_tokens, row.output_tokens, row.cost_micros)
    assert row.input_tokens > 0 and row.output_tokens >= 3
    _, samples = await scrape(p)
    assert total(samples, "responses_proxy_input_tokens_total", model=MODEL) == row.input_tokens
    assert total(samples, "responses_proxy_output_tokens_total", model=MODEL) == row.output_tokens


# --------------------------------------------------------------------------- a worker cuts the stream

PROMPT_TOKENS = 26  # what the raw worker says the prompt is (far below the hold's bound)


def cut_after(n: int, honours: bool = True):
    """A vLLM-shaped worker that sends the role chunk and n one-token text chunks, then drops
    the connection mid-stream. It reports usage on every chunk only when the request asks for
    continuous_usage_stats (as vLLM and SGLang do), and never when it does not `honour` it."""

    async def behave(_n: int, chat: dict, writer: asyncio.StreamWriter):
        options = chat.get("stream_options") or {}
        continuous = honours and bool(options.get("include_usage") and options.get("continuous_usage_stats"))

        def chunk(delta: dict, done: int) -> bytes:
            body: dict = {"id": "chatcmpl-cut", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                          "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
            if continuous:
                body["usage"] = {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS + done,
                                 "completion_tokens": done, "completion_tokens_details": None}
            data = b"data: " + orjson.dumps(body) + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(data), data)

        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(chunk({"role": "assistant", "content": ""}, 0))
        for i in range(n):
            writer.write(chunk({"content": f" word{i}"}, i + 1))
        await writer.drain()
        writer.transport.abort()  # cut: no last chunk, no [DONE]
        return "close"

    return behave


async def _cut_stream(make_proxy, behave) -> tuple[dict, Any]:
    """A streamed request of ~150 prompt tokens to a raw worker that `behave`s: -> its last
    event and its usage row, once the books balance."""
    import aiohttp

    async with ChatUpstream(behave) as upstream:
        p = await make_proxy({"prices": PRICES, "balance": {"lease_max_micros": 0}},
                             workers=[upstream.worker()])
        secret, _ = await p.ledger.create_key("payer", balance_micros=50_000_000)
        async with aiohttp.ClientSession() as http:
            async with http.post(p.url + "/v1/responses", headers={"Authorization": f"Bearer {secret}"},
                                 json={"model": MODEL, "input": "x " * 150, "stream": True,
                                       "max_output_tokens": 50}) as resp:
                request_id = resp.headers["x-request-id"]
                events = parse_sse(await resp.read())
        await assert_books_balance(p)
    assert events[-1]["type"] == "response.failed", [e["type"] for e in events]
    return events[-1], await p.ledger.usage(request_id)


async def test_a_stream_cut_by_the_worker_is_billed_what_it_reported(make_proxy):
    failed, row = await _cut_stream(make_proxy, cut_after(3))
    assert row.status == "failed"
    # What the worker reported: its prompt count (not the hold's bound of ~300+), the output seen.
    assert (row.input_tokens, row.output_tokens) == (PROMPT_TOKENS, 3)
    shown = failed["response"]["usage"]
    assert (shown["input_tokens"], shown["input_tokens_details"]["cached_tokens"], shown["output_tokens"]) == \
           (row.input_tokens, row.cached_tokens, row.output_tokens)
    assert row.cost_micros == PROMPT_TOKENS + 3  # 1 micro per token at these prices


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_simulated_worker_dropping_mid_stream_bills_what_the_client_is_shown(make_proxy, dialect):
    from proxy.simulator.server import Simulator

    async with Simulator(dialect=dialect) as sim:
        p = await make_proxy({"prices": PRICES, "balance": {"lease_max_micros": 0}},
                             workers=[{"name": "s", "url": sim.url, "dialect": dialect, "models": [MODEL]}])
        secret, _ = await p.ledger.create_key("payer", balance_micros=50_000_000)
        import aiohttp

        script = {"text": "one two three four five six seven", "drop_after": 4}
        async with aiohttp.ClientSession() as http:
            async with http.post(p.url + "/v1/responses", headers={"Authorization": f"Bearer {secret}"},
                                 json={"model": MODEL, "input": "tell me " + sim_input(**script), "stream": True,
                                       "max_output_tokens": 50}) as resp:
                request_id = resp.headers["x-request-id"]
                events = parse_sse(await resp.read())
            async with http.get(sim.url + "/sim/requests") as r:
                sent = (await r.json())[-1]
        await assert_books_balance(p)
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    failed = events[-1]
    assert failed["type"] == "response.failed"
    row = await p.ledger.usage(request_id)
    shown = failed["response"]["usage"]
    assert row.input_tokens > 0 and row.output_tokens == 4
    assert (shown["input_tokens"], shown["output_tokens"]) == (row.input_tokens, row.output_tokens)
    assert json.dumps(shown)  # plain JSON


async def test_a_cut_stream_without_any_usage_shows_the_client_what_it_billed(make_proxy):
    """A worker that reports no usage (and cannot count: no /tokenize): the prompt is billed at
    the bound, the output as counted, and response.failed says exactly that, not input 0."""
    failed, row = await _cut_stream(make_proxy, cut_after(3, honours=False))
    assert row.status == "failed" and row.output_tokens == 3 and row.input_tokens > PROMPT_TOKENS
    shown = failed["response"]["usage"]
    assert (shown["input_tokens"], shown["output_tokens"]) == (row.input_tokens, row.output_tokens)
