"""The Redis limits backend under Redis faults: a slot is held only by a live request.

A real redis-server (tests/support/redis_server.py), frozen with SIGSTOP (a stalled host: the
connection stays open, nothing is answered, and what the clients sent meanwhile runs when it
resumes), and a TCP relay in front of it that holds what a client sends (a network that
delays one direction), to order a late ADMIT before or after the cleanup at will. slot_ttl_s
is 30 here, so a phantom slot (taken by no live request) would still be there when the
assertions look, a few seconds later.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
import redis.asyncio as aioredis

from proxy.limits.base import GLOBAL, Ask, Refused
from proxy.limits.redis_backend import RedisCounter, RedisTicket
from tests.conftest import eventually as until

PREFIX = "t:"
GLOBAL_ZSET = PREFIX + "conc:global"
KEY_ZSET = PREFIX + "key:k1:conc"
ASK = Ask("k1", 3, 3, None, None)


def _counter(url: str) -> RedisCounter:
    return RedisCounter({"url": url, "key_prefix": PREFIX, "slot_ttl_s": 30, "socket_timeout_ms": 200})


@pytest.fixture
async def peek(redis_db):
    """(global zset members, key zset members), read on a connection of the test's own."""
    client = aioredis.Redis.from_url(redis_db.url, socket_timeout=2)

    async def members() -> tuple[set[str], set[str]]:
        return ({m.decode() for m in await client.zrange(GLOBAL_ZSET, 0, -1)},
                {m.decode() for m in await client.zrange(KEY_ZSET, 0, -1)})

    yield members
    await client.aclose()


@contextlib.contextmanager
def frozen(server):
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


async def _holding_exactly(peek, slots: set[str], timeout: float = 2.0) -> None:
    """Within `timeout` the global and the key's ZSET hold exactly `slots` (0: now)."""
    seen: list = []

    async def holding() -> bool:
        seen[:] = [await peek()]
        return seen[0] == (slots, slots)

    try:
        await until(holding, timeout, what=f"the ZSETs holding exactly the live slots {slots}")
    except AssertionError:
        pytest.fail(f"the ZSETs hold {seen[0]}; the live slots: {slots}")


async def test_after_a_freeze_redis_holds_only_the_live_requests_slots(redis_db, peek):
    """Admissions timed out and cancelled in a freeze (their ADMITs run when Redis resumes), a
    release made while Redis was down, a renewal queued in the freeze: within 2 s of SIGCONT
    the ZSETs hold the one live request's slot, and nothing once it ended."""
    counter = _counter(redis_db.url)
    async with counter.running():
        # together: two pooled connections, so both ADMITs below are sent on open connections
        # (a new one would wait on its handshake and send nothing)
        live, ended = await asyncio.gather(counter.admit(ASK), counter.admit(ASK))
        assert isinstance(live, RedisTicket) and isinstance(ended, RedisTicket)
        with frozen(redis_db):
            unlimited = ASK._replace(global_limit=None, key_limit=None)  # each late ADMIT would take its slot
            cancelled = asyncio.ensure_future(counter.admit(unlimited))
            timed_out = asyncio.ensure_future(counter.admit(unlimited))
            await asyncio.sleep(0.05)  # both ADMITs are in Redis's socket buffers now
            cancelled.cancel()
            fallback = await timed_out  # socket_timeout_ms: admitted on this process's own counts
            assert not isinstance(fallback, RedisTicket)
            await counter.release(ended, 7)  # Redis is down: not sent now
            await counter.release(fallback, 7)
            await counter.renew()  # times out; its RENEW of both slots runs when Redis resumes
            await asyncio.sleep(0.5)  # not a wait: Redis stays frozen a while longer
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await _holding_exactly(peek, {live.slot})
        # the cleanup is in Redis; its reply ends the outage here a moment later
        await until(lambda: not counter.down, what="the outage over for the counter")
        more = [await counter.admit(ASK) for _ in range(3)]  # the global limit of 3: one is live
        assert [type(t) for t in more] == [RedisTicket, RedisTicket, Refused] and more[2].scope == GLOBAL
        for ticket in (live, *more[:2]):
            await counter.release(ticket, 1)
        await _holding_exactly(peek, set(), timeout=0)


class _Conn:
    def __init__(self, open_: bool) -> None:
        self.gate = asyncio.Event()
        if open_:
            self.gate.set()
        self.sent = bytearray()  # what the client sent, delivered or not
        self.replies = bytearray()
        self.replied = asyncio.Event()
        self.tasks: list[asyncio.Task] = []


class Relay:
    """A TCP relay in front of redis-server. hold(): what clients send from now on waits in the
    relay (the connections open now and those opened later); pass_new(): connections opened
    from now on pass, the held ones still wait; deliver(conn): a held connection's bytes reach
    Redis now, even though its client gave up and closed, and Redis's reply is returned."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conns: list[_Conn] = []
        self.open_new = True

    async def __aenter__(self) -> "Relay":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for conn in self.conns:
            for task in conn.tasks:
                task.cancel()
        await asyncio.gather(*(t for c in self.conns for t in c.tasks), return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(self.open_new)
        self.conns.append(conn)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def upstream() -> None:
            while data := await reader.read(65536):
                conn.sent += data
                await conn.gate.wait()
                up_writer.write(data)
                await up_writer.drain()
            # the client closed: Redis's side stays open, so the replies of held bytes are seen

        async def downstream() -> None:
            try:
                while data := await up_reader.read(65536):
                    conn.replies += data
                    conn.replied.set()
                    with contextlib.suppress(Exception):
                        writer.write(data)
            finally:
                up_writer.close()
                writer.close()

        conn.tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]

    def hold(self) -> None:
        self.open_new = False
        for conn in self.conns:
            conn.gate.clear()

    def pass_new(self) -> None:
        self.open_new = True

    def held_with(self, marker: bytes) -> _Conn:
        held = [c for c in self.conns if not c.gate.is_set() and marker in c.sent]
        assert len(held) == 1, [bytes(c.sent[:80]) for c in held]
        return held[0]

    async def deliver(self, conn: _Conn) -> bytes:
        conn.replies.clear()
        conn.replied.clear()
        conn.gate.set()
        await asyncio.wait_for(conn.replied.wait(), 2)
        await asyncio.sleep(0.05)
        return bytes(conn.replies)


async def _late_admit(relay: Relay, counter: RedisCounter):
    """A live slot, then an admission whose ADMIT the relay holds: the client times out and
    admits on its own counts; the ADMIT has not reached Redis. -> (live ticket, held conn)."""
    live = await counter.admit(ASK)
    assert isinstance(live, RedisTicket)
    relay.hold()
    fallback = await counter.admit(ASK)
    assert not isinstance(fallback, RedisTicket)
    await counter.release(fallback, None)
    return live, relay.held_with(counter.admit_script.sha.encode())


async def _shared_again(counter: RedisCounter) -> None:
    """An admission through Redis again; then the doubtful slots forgotten (this tree's
    heartbeat does it at once)."""
    async def shared() -> bool:
        ticket = await counter.admit(Ask(None, None, None, None, None))
        await counter.release(ticket, None)
        return isinstance(ticket, RedisTicket)

    await until(shared, 3)
    await until(lambda: _true(not getattr(counter, "doubtful", None)), 2)


async def _true(value: bool) -> bool:
    return value


async def test_a_late_admit_run_before_the_cleanup_is_undone(redis_db, peek):
    async with Relay(redis_db.port) as relay:
        counter = _counter(relay.url)
        async with counter.running():
            live, held = await _late_admit(relay, counter)
            reply = await relay.deliver(held)  # Redis runs it before the counter can reach Redis
            assert reply == b"*2\r\n:0\r\n:0\r\n"  # admitted: a slot nobody owns, for now
            global_now, _ = await peek()
            assert len(global_now - {live.slot}) == 1
            relay.pass_new()  # the network heals: the counter's next call gets through
            await _holding_exactly(peek, {live.slot})
            await counter.release(live, None)
            await _holding_exactly(peek, set(), timeout=0)


async def test_a_late_admit_run_after_the_cleanup_takes_nothing(redis_db, peek):
    async with Relay(redis_db.port) as relay:
        counter = _counter(relay.url)
        async with counter.running():
            live, held = await _late_admit(relay, counter)
            relay.pass_new()  # new connections pass; the ADMIT is still on its way
            await _shared_again(counter)
            await _holding_exactly(peek, {live.slot}, timeout=0)
            reply = await relay.deliver(held)  # it reaches Redis after the cleanup
            await _holding_exactly(peek, {live.slot}, timeout=0)
            assert reply == b"*2\r\n:5\r\n:0\r\n"  # fenced: nothing taken, no bucket touched
            await counter.release(live, None)
            await _holding_exactly(peek, set(), timeout=0)
