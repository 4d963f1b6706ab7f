"""Money: a request can never be charged more than was held for it.

Real HTTP: a client -> the proxy (auth + balance over a SQLite ledger file) -> the
simulator, which can be told to be hostile (ignore max_tokens, report bogus usage).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import aiohttp
import orjson
import pytest

from middlewares import balance as balance_mw
from proxy.ledger import KeyLimits
from proxy.ledger.pricing import Price, cost_micros
from proxy.protocol.prompt import prompt_bound
from proxy.protocol.translate import translate_request
from tests.conftest import eventually, sim_input, sse_events

PRICES = {"default": {"input": 1_000_000, "cached_input": 100_000, "output": 1_000_000}}
PRICE = Price(1_000_000, 100_000, 1_000_000)  # 1 micro per token
MODEL = "tiny-org/tiny-model"
MAX_AMOUNT = 2**63 - 1  # SQLite's largest INTEGER


async def call(http, proxy, body, *, key):
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    async with http.post(proxy.url + "/v1/responses", data=orjson.dumps(body), headers=headers) as r:
        raw = await r.read()
        if r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return r.status, r.headers, sse_events(raw)
        return r.status, r.headers, orjson.loads(raw) if raw else None


async def balance_of(ledger, key_id: str) -> int:
    return (await ledger.get_key(key_id)).balance_micros


def bound_cost(body: dict, cap: int) -> int:
    """The most a request may be billed: its input bound and its output cap."""
    return cost_micros(PRICE, prompt_bound(translate_request(body).chat).tokens, 0, cap)


async def scrape(http, proxy) -> str:
    async with http.get(proxy.url + "/metrics") as r:
        return await r.text()


# --------------------------------------------------------------------------- the input bound


def test_input_bound_is_at_least_one_token_per_byte():
    digits = "1,2,3;4.5!" * 3000  # punctuation and digits: about one token per byte
    chat = translate_request({"model": MODEL, "input": digits}).chat
    assert prompt_bound(chat).tokens >= len(digits) + 16  # the text, and the template around it


async def test_concurrent_byte_dense_inputs_cannot_overdraw(make_proxy, http, sim):
    """Ten concurrent requests whose input is one token per byte, on a key that covers a few:
    the holds are upper bounds, so the admitted ones are billed in full, nothing clamps."""
    p = await make_proxy({"prices": PRICES})
    initial = 100_000
    secret, record = await p.ledger.create_key("dense", balance_micros=initial, limits=KeyLimits(concurrency=100))
    bodies = [{"model": MODEL, "max_output_tokens": 16, "input": f"q{i} " + ",;" * 10_000}  # no cache hits
              for i in range(10)]
    results = await asyncio.gather(*(call(http, p, body, key=secret) for body in bodies))
    statuses = [r[0] for r in results]
    assert 200 in statuses and 402 in statuses, statuses
    await balance_mw.wait_for_settlements(p.app)
    usages = await p.ledger.list_usage(record.key_id, limit=100)
    assert len(usages) == statuses.count(200)
    assert all(u.input_tokens >= 20_000 for u in usages)  # the simulator counts each mark
    assert all(u.debited_micros == u.cost_micros > 0 for u in usages)  # none was clamped at the balance
    assert initial - await balance_of(p.ledger, record.key_id) == sum(u.debited_micros for u in usages)


async def test_a_balance_below_the_bound_is_sized_by_the_workers_tokenizer(make_proxy, http, sim):
    """The bound is generous; a key that cannot cover it but covers the prompt as the worker
    counts it is served (the cap lowered to fit) instead of refused."""
    p = await make_proxy({"prices": PRICES})
    body = {"model": MODEL, "input": "hello there, how are you today?"}
    chat = translate_request(body).chat
    async with http.post(sim.url + "/tokenize", json={"model": MODEL, "messages": chat["messages"]}) as r:
        counted = (await r.json())["count"]
    initial = counted + 4
    assert initial < prompt_bound(chat).tokens
    secret, record = await p.ledger.create_key("small", balance_micros=initial)
    status, headers, answer = await call(http, p, body, key=secret)
    assert status == 200, answer
    assert headers["x-token-notice"] == "max_output_tokens lowered to 4 to fit the balance"
    usage = await p.ledger.usage(headers["x-request-id"])
    assert usage.input_tokens == counted and usage.output_tokens <= 4
    assert initial - await balance_of(p.ledger, record.key_id) == usage.debited_micros == usage.cost_micros


# --------------------------------------------------------------------------- the output cap


@pytest.mark.parametrize("stream", [True, False])
async def test_upstream_ignoring_max_tokens_is_cut_at_the_cap(make_proxy, http, sim, stream):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("capped", balance_micros=10_000_000)
    body = {"model": MODEL, "max_output_tokens": 50, "stream": stream,
            "input": sim_input(text_words=3000, ignore_max_tokens=True, **({"delay": 0.005} if stream else {}))}
    status, headers, answer = await call(http, p, body, key=secret)
    assert status == 200
    final = answer[-1]["response"] if stream else answer
    if stream:
        assert answer[-1]["type"] == "response.incomplete"
        assert sum(e["type"] == "response.output_text.delta" for e in answer) == 50
        assert final["status"] == "incomplete"
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    # (a whole non-stream answer cannot be cut without the tokenizer: only its bill is)
    assert final["usage"]["output_tokens"] == 50
    usage = await p.ledger.usage(headers["x-request-id"])  # settled before the answer ended
    assert usage is not None and usage.output_tokens == 50
    assert usage.cost_micros <= bound_cost(body, 50)
    if stream:  # the upstream's connection was closed, not left streaming
        # (15 s of stream left when the proxy stopped reading)
        await eventually(lambda: sim.cancelled, what="the upstream request cancelled")
        assert sim.cancelled >= 1 and sim.in_flight == 0


def _chunk(text: str) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                     "choices": [{"index": 0, "delta": {"content": text},
                                                  "logprobs": None, "finish_reason": None}]}) + b"\n\n"


@pytest.mark.parametrize("cap", [1, 2, 7, 50, 300])
@pytest.mark.parametrize("read_size", [1, 97, 4096, 1 << 20])
def test_rewriter_cap_holds_on_every_path(cap, read_size):
    """However the bytes are split (big reads become TextRuns), never more than
    `cap` output deltas are written, and the response ends incomplete."""
    from proxy.protocol.rewriter import ResponseContext, StreamRewriter

    stream = b"".join([_chunk("x")] + [_chunk(" w%d" % i) for i in range(400)] + [b"data: [DONE]\n\n"])
    rw = StreamRewriter(ResponseContext("resp_1", "m", 1, output_cap=cap))
    out = rw.start()
    for at in range(0, len(stream), read_size):
        out += rw.feed(stream[at:at + read_size])
    out += rw.finish()
    events = sse_events(out)
    assert sum(e["type"] == "response.output_text.delta" for e in events) == cap
    assert events[-1]["type"] == "response.incomplete" and rw.capped
    assert events[-1]["response"]["usage"]["output_tokens"] == cap
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_rewriter_cap_not_reached_changes_nothing():
    from proxy.protocol.rewriter import ResponseContext, StreamRewriter

    stream = b"".join([_chunk("a"), _chunk("b")]) + b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n' \
        + b"data: [DONE]\n\n"
    outs = []
    for cap in (None, 2):
        rw = StreamRewriter(ResponseContext("resp_1", "m", 1, output_cap=cap))
        outs.append(re.sub(rb'"(msg_|rs_)[0-9a-f]+"', b'"id"', rw.start() + rw.feed(stream) + rw.finish()))
        assert not rw.capped and rw.status == "completed"
    assert outs[0] == outs[1]


# --------------------------------------------------------------------------- hostile usage

HOSTILE = [
    {"prompt_tokens": -5},
    {"prompt_tokens": 1.5},
    {"prompt_tokens": 1e30},
    {"prompt_tokens": "12"},
    {"prompt_tokens": 500_000_000_008},
    {"completion_tokens": 500_000_000_008},
    {"completion_tokens": -1},
    {"completion_tokens": "many"},
    {"prompt_tokens_details": {"cached_tokens": 10_000_000}},
    {"prompt_tokens_details": "garbage", "completion_tokens_details": [1]},
]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("override", HOSTILE, ids=[json.dumps(h) for h in HOSTILE])
async def test_hostile_usage_is_checked_and_clamped(make_proxy, http, sim, stream, override):
    p = await make_proxy({"prices": PRICES})
    initial = 1_000_000
    secret, record = await p.ledger.create_key("victim", balance_micros=initial)
    body = {"model": MODEL, "max_output_tokens": 20, "stream": stream,
            "input": sim_input(text="one two three", usage_override=override)}
    status, headers, answer = await call(http, p, body, key=secret)
    assert status == 200
    usage = await p.ledger.usage(headers["x-request-id"])  # a row, written before the answer ended
    assert usage is not None
    assert 0 <= usage.debited_micros == usage.cost_micros <= bound_cost(body, 20)
    assert usage.output_tokens <= 20 and usage.cached_tokens <= usage.input_tokens
    assert await balance_of(p.ledger, record.key_id) == initial - usage.debited_micros
    assert await p.ledger.holds(record.key_id) == []
    shown = (answer[-1]["response"] if stream else answer)["usage"]
    assert all(type(shown[k]) is int and shown[k] >= 0 for k in ("input_tokens", "output_tokens", "total_tokens"))
    if "prompt_tokens_details" not in override or isinstance(override["prompt_tokens_details"], dict):
        # (details that are not objects read as absent: nothing to correct)
        assert "responses_proxy_usage_corrections_total{reason=" in await scrape(http, p)


def test_clean_usage_never_raises_and_stays_within_the_hold():
    from proxy.ledger.usage import clean_usage

    weird = [None, -1, 1.5, 1e30, float("nan"), float("inf"), "7", [], {}, True, 2**80, 3]
    for a in weird:
        for b in weird:
            for c in weird:
                reported = {"input_tokens": a, "input_tokens_details": {"cached_tokens": b}, "output_tokens": c,
                            "output_tokens_details": {"reasoning_tokens": b}}
                got = clean_usage(reported, counted_output=4, input_fallback=30, input_bound=100, output_cap=10,
                                  price=PRICE, hold_micros=90)
                assert all(type(v) is int and 0 <= v <= MAX_AMOUNT for v in
                           (got.input_tokens, got.cached_tokens, got.output_tokens, got.reasoning_tokens))
                assert got.input_tokens <= 100 and got.cached_tokens <= got.input_tokens
                assert 4 <= got.output_tokens <= 10 and got.reasoning_tokens <= got.output_tokens
                assert got.cost_micros <= 90


def test_clean_usage_without_a_report_bills_the_fallbacks():
    from proxy.ledger.usage import clean_usage

    got = clean_usage(None, counted_output=7, input_fallback=40, input_bound=100, output_cap=5, price=PRICE,
                      hold_micros=None)
    assert (got.input_tokens, got.cached_tokens, got.output_tokens, got.cost_micros) == (40, 0, 5, 45)
    assert got.corrections == []


# --------------------------------------------------------------------------- what is billed without usage


async def test_failed_stream_without_usage_bills_the_workers_count(make_proxy, http, sim):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    body = {"model": MODEL, "stream": True,
            "input": sim_input(text="one two three four five six", error_after=3, usage=False)}
    status, headers, events = await call(http, p, body, key=secret)
    assert status == 200 and events[-1]["type"] == "response.failed"
    chat = translate_request(body).chat
    async with http.post(sim.url + "/tokenize", json={"model": MODEL, "messages": chat["messages"]}) as r:
        counted = (await r.json())["count"]
    usage = await p.ledger.usage(headers["x-request-id"])
    assert (usage.input_tokens, usage.output_tokens) == (counted, 3)
    assert usage.input_tokens < prompt_bound(chat).tokens


async def test_non_stream_without_usage_bills_the_workers_count(make_proxy, http, sim):
    p = await make_proxy({"prices": PRICES})
    secret, record = await p.ledger.create_key("payer", balance_micros=1_000_000)
    body = {"model": MODEL, "input": sim_input(text="one two three", usage=False)}
    status, headers, answer = await call(http, p, body, key=secret)
    assert status == 200
    chat = translate_request(body).chat
    async with http.post(sim.url + "/tokenize", json={"model": MODEL, "messages": chat["messages"]}) as r:
        counted = (await r.json())["count"]
    usage = await p.ledger.usage(headers["x-request-id"])
    # the worker's tokenizer counted both: the client, the ledger (and the access line) agree
    assert usage.output_tokens == answer["usage"]["output_tokens"] == 3
    assert usage.input_tokens == answer["usage"]["input_tokens"] == counted


# --------------------------------------------------------------------------- back to back


@pytest.mark.parametrize("stream", [True, False])
async def test_back_to_back_requests_find_their_balance_settled(make_proxy, http, sim, stream):
    """Sequential requests on a key whose balance covers one hold at a time: each waits for
    its answer, so the previous one's hold is settled and the next is admitted."""
    p = await make_proxy({"balance": {"lease_max_micros": 0}})  # the default prices: each hold takes it all
    initial = 40_000
    secret, record = await p.ledger.create_key("seq", balance_micros=initial)
    body = {"model": MODEL, "stream": stream, "input": "hello there"}
    refused = 0
    for _ in range(30):
        status, _, _ = await call(http, p, body, key=secret)
        refused += status == 402
    print(f"\nback to back ({'stream' if stream else 'json'}): {refused} of 30 refused")
    assert refused == 0
    usages = await p.ledger.list_usage(record.key_id, limit=100)
    assert len(usages) == 30
    assert initial - await balance_of(p.ledger, record.key_id) == sum(u.debited_micros for u in usages)


# --------------------------------------------------------------------------- amounts and limits


async def test_amounts_beyond_64_bits_are_refused(ledger_path):
    from proxy.ledger import open_ledger

    async with open_ledger({"path": str(ledger_path)}) as ledger:
        with pytest.raises(ValueError, match="at most"):
            await ledger.create_key("huge", balance_micros=2**63)
        _, record = await ledger.create_key("big", balance_micros=MAX_AMOUNT - 5)
        with pytest.raises(ValueError, match="exceed"):
            await ledger.top_up(record.key_id, 10)
        with pytest.raises(ValueError):
            await ledger.top_up(record.key_id, 2**64)
        with pytest.raises(ValueError, match="positive"):
            await ledger.create_key("zero", balance_micros=5, limits=KeyLimits(concurrency=0))
        with pytest.raises(ValueError, match="positive"):
            await ledger.set_limits(record.key_id, KeyLimits(rate_per_min=0))
        keys = await ledger.list_keys()
        assert all(type(k.balance_micros) is int for k in keys)


@pytest.fixture
def ledger_path(tmp_path):
    return tmp_path / "ledger.db"


def _keys(db, *args):
    return subprocess.run([sys.executable, "-m", "proxy.ledger.cli", "--db", str(db), "keys", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [
    ["create", "a", "--rate", "0"],
    ["create", "a", "--concurrency", "0"],
    ["create", "a", "--balance", str(2**63)],
    ["create", "a", "--balance-usd", "1e40"],
])
def test_cli_refuses_zero_limits_and_huge_amounts(ledger_path, args):
    done = _keys(ledger_path, *args)
    assert done.returncode == 2, done
    assert "error" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("text,micros", [("1,50", None), ("1,5,0", None), ("12,34", None), ("1.5.0", None),
                                         ("1,0000", None), ("1e3", None), ("1.50", 1_500_000), ("$1.50", 1_500_000),
                                         ("1,250.00", 1_250_000_000), ("1_000", 1_000_000_000), ("-0.25", -250_000)])
def test_dollars_take_one_decimal_point_and_separators_in_groups_of_three(ledger_path, text, micros):
    """`--usd 1,50` credited $150 once (every comma stripped): a decimal comma is refused now."""
    created = _keys(ledger_path, "create", "a", "--balance", "1000000000", "--json")
    key_id = json.loads(created.stdout)["key_id"]
    done = _keys(ledger_path, "topup", key_id, "--usd", text)
    if micros is None:
        assert done.returncode == 2 and "not an amount of dollars" in done.stderr, done
        return
    assert done.returncode == 0, done
    shown = json.loads(_keys(ledger_path, "show", key_id, "--json").stdout)
    assert shown["balance_micros"] == 1_000_000_000 + micros


def test_cli_refuses_zero_limits_on_limits_and_huge_topups(ledger_path):
    created = _keys(ledger_path, "create", "a", "--balance", "100", "--json")
    assert created.returncode == 0, created
    key_id = json.loads(created.stdout)["key_id"]
    for args in (["limits", key_id, "--rate", "0"], ["limits", key_id, "--concurrency", "0"],
                 ["topup", key_id, str(2**63)]):
        done = _keys(ledger_path, *args)
        assert done.returncode == 2, (args, done)
        assert "Traceback" not in done.stderr
    done = _keys(ledger_path, "topup", key_id, str(MAX_AMOUNT))  # the ledger refuses the sum
    assert done.returncode != 0 and "exceed" in done.stderr and "Traceback" not in done.stderr
    listed = _keys(ledger_path, "list")
    assert listed.returncode == 0, listed


def record_holds(monkeypatch) -> dict[str, int]:
    """request id -> the amount held for it, filled as the test runs (every hold goes through
    Leases.hold_up_to, the lease's and the exact path's alike)."""
    from proxy.ledger.lease import Leases

    made: dict[str, int] = {}
    hold_up_to = Leases.hold_up_to

    async def recording(self, request_id, key_id, low, high):
        found = await hold_up_to(self, request_id, key_id, low, high)
        made[request_id] = found.amount_micros
        return found

    monkeypatch.setattr(Leases, "hold_up_to", recording)
    return made


# --------------------------------------------------------------------------- the cap, differentially

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _capped_streams():
    from tests.protocol.test_rewriter_fastpath import _CTXS, upstream_event

    return _CTXS, upstream_event


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(_capped_streams()[1](), min_size=1, max_size=60),
       plain=st.integers(0, 80),
       mode=st.sampled_from(["coalesced", "per_event", "random_cuts"]),
       cuts=st.lists(st.integers(0, 20_000), max_size=8),
       which=st.sampled_from(sorted(_capped_streams()[0])),
       cap=st.integers(0, 40))
def test_random_streams_with_a_cap_runs_equal_parsed(events, plain, mode, cuts, which, cap):
    """Runs of text chunks (TextRun) and parsing every chunk agree byte for byte under a cap,
    and neither lets more than `cap` output deltas through."""
    from tests.protocol.test_rewriter_fastpath import _CTXS, _run, _state
    from tests.protocol.test_rewriter import ctx

    # A run of plain text chunks in the middle: what becomes a TextRun.
    events = events[:len(events) // 2] + [_chunk(" w%d" % i) for i in range(plain)] + events[len(events) // 2:]
    body = b"".join(events)
    if mode == "coalesced":
        chunks = [body]
    elif mode == "per_event":
        chunks = events
    else:
        points = sorted({c % (len(body) + 1) for c in cuts})
        chunks = [body[a:b] for a, b in zip([0, *points], [*points, len(body)])]
    c = ctx(**_CTXS[which], output_cap=cap)
    fast, rw_fast = _run(chunks, c, True)
    slow, rw_slow = _run(chunks, c, False)
    assert fast == slow
    assert _state(rw_fast) == _state(rw_slow) and rw_fast.capped == rw_slow.capped
    assert rw_fast.output_tokens_seen <= cap
    if rw_fast.capped:
        assert rw_fast.status == "incomplete"
        assert rw_fast.response["incomplete_details"] == {"reason": "max_output_tokens"}


# --------------------------------------------------------------------------- the audit

_HOSTILE_SCRIPTS = [
    {"text": "a b c d e f"},
    {"text_words": 400, "ignore_max_tokens": True},
    {"text": "one two three four five", "error_after": 2},
    {"text": "one two three four five", "drop_after": 3},
    {"text": "one two three", "usage": False},
    {"text": "one two", "usage_override": {"prompt_tokens": 500_000_000_008}},
    {"text": "one two", "usage_override": {"completion_tokens": 10**12}},
    {"text": "one two", "usage_override": {"prompt_tokens": -3, "completion_tokens": 1.5}},
    {"text": "one two", "usage_override": {"prompt_tokens": "9"}},
    {"text": "one two", "usage_override": {"prompt_tokens_details": {"cached_tokens": 10**9}}},
    {"text_words": 200, "delay": 0.01},  # the client leaves part way
]


@pytest.mark.parametrize("leases", [True, False])
async def test_audit_under_hostile_concurrent_load(make_proxy, http, sim, monkeypatch, leases):
    """Mixed concurrent traffic on several small keys, every upstream behaviour above; then,
    for every key: balance decrease == sum of debits <= sum of holds, no debit above its own
    hold, no hold left open."""
    holds = record_holds(monkeypatch)
    section = {"lease_min_rate": 1} if leases else {"lease_max_micros": 0}
    p = await make_proxy({"prices": PRICES, "balance": section})
    keys = []
    for n, initial in enumerate((3_000, 12_000, 40_000)):
        secret, record = await p.ledger.create_key(f"audit{n}", balance_micros=initial,
                                                   limits=KeyLimits(concurrency=1000))
        keys.append((secret, record.key_id, initial))

    async def one(secret: str, i: int) -> None:
        script = _HOSTILE_SCRIPTS[i % len(_HOSTILE_SCRIPTS)]
        body = {"model": MODEL, "stream": i % 3 != 0, "max_output_tokens": 5 + i % 40,
                "input": f"request {i} " + sim_input(**script)}
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {secret}"}
        try:
            async with http.post(p.url + "/v1/responses", data=orjson.dumps(body), headers=headers) as r:
                if "delay" in script and r.status == 200 and body["stream"]:
                    for _ in range(8):  # a few events, then hang up
                        await r.content.readline()
                    return
                await r.read()
        except aiohttp.ClientError:
            pass

    for _ in range(2):  # two waves: the second runs on what the first left
        await asyncio.gather(*(one(secret, i) for secret, _, _ in keys for i in range(44)))
    await balance_mw.wait_for_settlements(p.app)
    figures = []
    for secret, key_id, initial in keys:
        final = await balance_of(p.ledger, key_id)
        usages = await p.ledger.list_usage(key_id, limit=10_000)
        debits = sum(u.debited_micros for u in usages)
        held = sum(holds[u.request_id] for u in usages)
        figures.append((key_id, initial, final, debits, held, len(usages)))
        assert initial - final == debits <= held, figures[-1]
        assert all(u.debited_micros <= holds[u.request_id] for u in usages)
        assert all(u.debited_micros == u.cost_micros for u in usages)  # never clamped at the balance
        assert final >= 0
    assert await p.ledger.holds() == []
    assert all(balance == expected for _, balance, expected in await p.ledger.audit())
    print(f"\naudit (leases {'on' if leases else 'off'}): key, initial, final, debits, holds, rows")
    for row in figures:
        print("  ", *row)


@pytest.mark.parametrize("script", [{"error_after": 3, "usage": False},
                                    {"usage_override": {"prompt_tokens": 10**15, "completion_tokens": -4}}])
async def test_access_line_metrics_and_ledger_agree(make_proxy, http, sim, capsys, script):
    p = await make_proxy({"prices": PRICES})
    secret, _ = await p.ledger.create_key("payer", balance_micros=1_000_000)
    body = {"model": MODEL, "stream": True, "max_output_tokens": 30,
            "input": sim_input(text="one two three four five six", **script)}
    capsys.readouterr()
    status, headers, _ = await call(http, p, body, key=secret)
    assert status == 200
    request_id = headers["x-request-id"]
    usage = await p.ledger.usage(request_id)
    metrics = await scrape(http, p)
    captured = capsys.readouterr()
    line = [ln for ln in (captured.out + captured.err).splitlines() if request_id in ln and " request " in ln][-1]
    fields = dict(re.findall(r'"?(input_tokens|output_tokens)"?[=:] ?(\d+)', line))
    assert (int(fields["input_tokens"]), int(fields["output_tokens"])) == (usage.input_tokens, usage.output_tokens)
    found = re.search(r'responses_proxy_input_tokens_total\{model="tiny-org/tiny-model"\} (\S+)', metrics)
    assert found and float(found.group(1)) == usage.input_tokens


async def test_ledger_settle_never_debits_more_than_the_hold(ledger_path):
    """Defence in depth: whatever cost a settle is handed, the debit stays within the
    request's own hold; the money held for the key's other requests stays theirs."""
    from proxy.ledger import UsageRecord, open_ledger

    async with open_ledger({"path": str(ledger_path)}) as ledger:
        _, record = await ledger.create_key("k", balance_micros=10_000)
        await ledger.hold("mine", record.key_id, 1_000, ttl_s=60)
        await ledger.hold("other", record.key_id, 5_000, ttl_s=60)
        usage = UsageRecord("mine", record.key_id, "m", 10, 0, 10**9, 0, 500_000_000_008, "completed")
        assert await ledger.settle("mine", usage)
        assert usage.debited_micros == 1_000
        assert await balance_of(ledger, record.key_id) == 9_000
        assert await ledger.available(record.key_id) == 4_000  # "other" still holds its 5,000
