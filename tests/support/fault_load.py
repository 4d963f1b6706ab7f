"""The mixed load of the fault-injection tier (tests/faults/test_backends.py) and what is
checked of each answer.

    load = Load(cluster, clients=24)
    load.start()                       # every client loops: one request, its Outcome, the next
    ...                                # the fault, its repair
    await load.finish()                # clients end their current request; bounded
    print(summary(load.outcomes))      # {"served json": 40, "hung up": 12, "503 ledger_unavailable": 7, ...}
    check_answers(load.outcomes, codes={"ledger_unavailable"})

Clients: JSON requests, SSE streams and WebSocket turns (one socket per client, a turn at a
time: {"type": "response.create", ...}), and one client in five hanging up mid-stream (an SSE
stream dropped after its first bytes, or a socket closed after its first deltas). Half the
clients spend one hot key (on every replica: it runs on leases), the others a few keys of
their own. Each answer is an Outcome: served (200 and complete), refused (its status and
error object), or a problem: a socket dropped instead of an error event, a stream cut without
a terminal event, a transport error from a replica that was not stopped on purpose.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import orjson
from aiohttp import WSMsgType

from tests.support.cluster import MODEL, SHORT, Cluster, Replica

KINDS = ("json", "sse", "ws", "sse", "hangup_sse", "json", "ws", "sse", "ws", "hangup_ws")
TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")
HTTP_ENVELOPE = {"message", "type", "param", "code"}
WS_ENVELOPE = {"message", "type", "code"}


@dataclass
class Outcome:
    kind: str
    replica: int
    key: str
    t0: float  # time.monotonic() when sent
    t1: float = 0.0
    status: int = 0  # the HTTP status; a socket turn: 200 when answered, else its error event's status
    retry_after: str | None = None
    error: dict[str, Any] | None = None  # the error object of a refusal (or of a failed answer)
    request_id: str | None = None
    served: bool = False  # 200 and complete: response.completed, or a JSON body "completed"
    problem: str | None = None  # what must never happen
    raw: bytes = b""

    def __repr__(self) -> str:
        return (f"Outcome({self.kind} r{self.replica} {self.status} served={self.served} "
                f"problem={self.problem!r} error={self.error!r} raw={self.raw[:200]!r})")


def request_body(stream: bool, script: dict) -> dict[str, Any]:
    return {"model": MODEL, "stream": stream, "max_output_tokens": 40, "input": "hello SIM:" + json.dumps(script)}


def sse_events(raw: bytes) -> list[dict]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            try:
                out.append(orjson.loads(line[6:]))
            except orjson.JSONDecodeError:
                pass
    return out


def request_id_of_response(response: Any) -> str | None:
    """A response's id is "resp_" + the request id's hex ("req_" + hex)."""
    rid = response.get("id") if isinstance(response, dict) else None
    return "req_" + rid.removeprefix("resp_") if isinstance(rid, str) and rid.startswith("resp_") else None


@dataclass
class Load:
    cluster: Cluster
    clients: int = 24
    script: dict = field(default_factory=lambda: dict(SHORT))
    hot_share: int = 2  # every `hot_share`-th client spends the hot key
    down: set[int] = field(default_factory=set)  # replicas stopped on purpose: their errors are expected
    outcomes: list[Outcome] = field(default_factory=list)
    t_fault: float = float("inf")  # time.monotonic() of the fault and of its repair, set by the test
    t_repair: float = float("inf")

    def __post_init__(self) -> None:
        self.stopping = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self.http: aiohttp.ClientSession | None = None
        self.own_keys = [name for name in self.cluster.keys if name != "hot"]

    def start(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=20))
        self.tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]

    async def finish(self, within_s: float = 30) -> list[Outcome]:
        """Stop the clients after their current request; every task ends within `within_s`."""
        self.stopping.set()
        done, pending = await asyncio.wait(self.tasks, timeout=within_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.close()
        assert not pending, f"{len(pending)} clients still busy {within_s} s after the load was stopped"
        for task in done:
            if task.exception() is not None:
                raise task.exception()
        return self.outcomes

    def live(self) -> list[Replica]:
        return [r for r in self.cluster.replicas if r.index not in self.down]

    def served_ids(self) -> list[str]:
        return [o.request_id for o in self.outcomes if o.served and o.request_id]

    async def _client(self, i: int) -> None:
        kind = KINDS[i % len(KINDS)]
        key = "hot" if i % self.hot_share == 0 or not self.own_keys else self.own_keys[i % len(self.own_keys)]
        secret = self.cluster.keys[key][1]
        sockets: dict[int, aiohttp.ClientWebSocketResponse] = {}
        n = 0
        try:
            while not self.stopping.is_set():
                live = self.live()
                replica = live[(i + (0 if kind == "ws" else n)) % len(live)]
                n += 1
                outcome = Outcome(kind, replica.index, key, time.monotonic())
                try:
                    async with asyncio.timeout(20):
                        await self._one(kind, replica, secret, outcome, sockets)
                except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
                    if replica.index not in self.down:
                        outcome.problem = f"{type(exc).__name__}: {exc}"
                    sockets.pop(replica.index, None)
                outcome.t1 = time.monotonic()
                self.outcomes.append(outcome)
                # A hang-up ends at once: its client pauses about a request's length, so that
                # one client in five stays about one request in five.
                await asyncio.sleep(0.3 if outcome.kind.startswith("hangup") else 0.01 if outcome.served else 0.1)
        finally:
            for ws in sockets.values():
                await ws.close()

    async def _one(self, kind: str, replica: Replica, secret: str, outcome: Outcome,
                   sockets: dict[int, aiohttp.ClientWebSocketResponse]) -> None:
        if kind in ("json", "sse", "hangup_sse"):
            await self._http(replica, secret, outcome, stream=kind != "json", hang_up=kind == "hangup_sse")
            return
        if kind == "hangup_ws":
            ws = await self._connect(replica, secret, outcome)
            if ws is not None:
                try:
                    await self._turn(ws, outcome, hang_up=True)
                finally:
                    await ws.close()
            return
        ws = sockets.get(replica.index)
        if ws is None or ws.closed:
            ws = await self._connect(replica, secret, outcome)
            if ws is None:
                return
            sockets[replica.index] = ws
        await self._turn(ws, outcome, hang_up=False)

    async def _http(self, replica: Replica, secret: str, outcome: Outcome, *, stream: bool, hang_up: bool) -> None:
        assert self.http is not None
        async with self.http.post(replica.url + "/v1/responses", data=orjson.dumps(request_body(stream, self.script)),
                                  headers={"Authorization": f"Bearer {secret}",
                                           "Content-Type": "application/json"}) as r:
            outcome.status = r.status
            outcome.retry_after = r.headers.get("Retry-After")
            outcome.request_id = r.headers.get("x-request-id")
            if r.status == 200 and hang_up:
                outcome.raw = await r.content.readany()
                r.close()  # dropped, not returned to the pool
                return
            outcome.raw = await r.read()
        judge_http(outcome, stream)

    async def _connect(self, replica: Replica, secret: str, outcome: Outcome) -> aiohttp.ClientWebSocketResponse | None:
        assert self.http is not None
        try:
            return await self.http.ws_connect(replica.url + "/v1/responses",
                                              headers={"Authorization": f"Bearer {secret}"})
        except aiohttp.WSServerHandshakeError as exc:  # refused before the upgrade: an HTTP answer
            outcome.status = exc.status
            outcome.retry_after = (exc.headers or {}).get("Retry-After")
            outcome.error = {"handshake": exc.message}
            return None

    async def _turn(self, ws: aiohttp.ClientWebSocketResponse, outcome: Outcome, *, hang_up: bool) -> None:
        await ws.send_str(orjson.dumps({"type": "response.create", **request_body(True, self.script)}).decode())
        deltas = 0
        while True:
            msg = await ws.receive()
            if msg.type != WSMsgType.TEXT:
                outcome.problem = f"socket dropped mid-turn ({msg.type.name}, {msg.data!r}, {msg.extra!r})"
                return
            outcome.raw += msg.data.encode() + b"\n"
            event = orjson.loads(msg.data)
            kind = event.get("type")
            if kind == "response.created":
                outcome.request_id = request_id_of_response(event.get("response"))
            deltas += kind == "response.output_text.delta"
            if hang_up and deltas >= 2:
                outcome.status = 200
                return  # the caller closes the socket mid-turn
            if kind in TERMINAL:
                judge_turn(outcome, event)
                return


def judge_http(outcome: Outcome, stream: bool) -> None:
    """served / error / problem of an HTTP answer read whole."""
    if outcome.status != 200:
        try:
            outcome.error = orjson.loads(outcome.raw).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            outcome.error = None
        return
    if not stream:
        body = orjson.loads(outcome.raw)
        outcome.served = body.get("status") == "completed"
        outcome.error = body.get("error") or None
        outcome.request_id = request_id_of_response(body) or outcome.request_id
        return
    events = sse_events(outcome.raw)
    terminal = [e for e in events if e.get("type") in TERMINAL]
    if not terminal:
        outcome.problem = "stream cut without a terminal event"
        return
    last = terminal[-1]
    outcome.served = last["type"] == "response.completed"
    if not outcome.served:
        response = last.get("response") if isinstance(last.get("response"), dict) else {}
        outcome.error = last.get("error") or response.get("error")


def judge_turn(outcome: Outcome, event: dict[str, Any]) -> None:
    if event["type"] == "error":
        outcome.status = int(event.get("status") or 0)
        outcome.error = event.get("error")
        return
    outcome.status = 200
    outcome.served = event["type"] == "response.completed"
    outcome.request_id = request_id_of_response(event.get("response")) or outcome.request_id
    if not outcome.served:
        outcome.error = (event.get("response") or {}).get("error")


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    """Counts by outcome: served (by kind), hung up, refused (by status and code), problems."""
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.problem:
            label = "PROBLEM"
        elif o.status == 200:
            label = f"served {o.kind}" if o.served else ("hung up" if o.kind.startswith("hangup") else "not completed")
        elif "handshake" in (o.error or {}):
            label = f"{o.status} handshake"
        else:
            label = f"{o.status} {(o.error or {}).get('code')}"
        counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items()))


def check_answers(outcomes: list[Outcome], *, codes: set[str] | None = None, refusals: bool = True) -> None:
    """No problem, no 500, no internal_error anywhere; every refusal a 503 with Retry-After in
    the OpenAI error envelope (a socket turn: an error event with status 503), its code one of
    `codes` when given. refusals=False: nothing refused at all."""
    problems = [o for o in outcomes if o.problem]
    assert not problems, f"{len(problems)} problems, e.g. {problems[:3]}"
    internal = [o for o in outcomes if o.status == 500 or b"internal_error" in o.raw]
    assert not internal, f"{len(internal)} answers 500 / internal_error, e.g. {internal[:3]}"
    for o in outcomes:
        if o.status == 200:
            continue
        assert refusals, f"a refusal where none is allowed: {o!r}"
        assert o.status == 503, o
        error = o.error or {}
        if "handshake" in error:  # a refused upgrade: its status and headers are all a client gets
            assert o.retry_after, o
            continue
        if o.kind.endswith("ws"):
            assert WS_ENVELOPE <= set(error), o
        else:
            assert o.retry_after, o
            assert HTTP_ENVELOPE <= set(error), o
        if codes is not None:
            assert error.get("code") in codes, o
    not_completed = [o for o in outcomes if o.status == 200 and not o.served and not o.kind.startswith("hangup")]
    assert not not_completed, f"answers that began and did not complete: {not_completed[:3]}"


class Findings:
    """Checks that each run to its end: a failed one is noted, the next ones still run, and
    done() fails with all of them (a fault often breaks several promises at once)."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    async def check(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
            return (await result) if inspect.isawaitable(result) else result
        except AssertionError as exc:
            self.failed.append(f"{what}: {str(exc)[:3000]}")
            print(f"FAILED {what}: {str(exc)[:1000]}")
            return None

    def done(self) -> None:
        assert not self.failed, f"{len(self.failed)} checks failed:\n" + "\n".join(self.failed)
