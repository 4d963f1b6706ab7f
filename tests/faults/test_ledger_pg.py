"""The PostgreSQL ledger under the database faults an operator meets, each on a real server
(tests/support/pg_server.py): every driver error is classified (proxy/ledger/postgres/errors.py) as
unavailable (503 ledger_unavailable, spooled, retried) or a fault the operator must fix
(503 ledger_fault naming it, /readyz says the cause, exit 2 at start-up), nothing reaches a
client as 500, and no settlement is ever dropped: what cannot be written waits in the spool
until a replay after the repair applies it, exactly once."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import asyncpg
import pytest
import yaml
from asyncpg import exceptions as pgx

from proxy.ledger import LedgerFault, LedgerUnavailable, open_ledger
from proxy.ledger.lease import Leases
from proxy.ledger.postgres.errors import FAULT, RETRY, UNAVAILABLE, classify
from proxy.ledger.spool import settle_record
from tests.support.live import free_port
from tests.ledger.test_postgres import pg_section, usage_for, wait_for
from tests.support.paths import REPO as ROOT


async def ready(session, proxy) -> bool:
    async with session.get(proxy.url + "/readyz") as r:
        return r.status == 200

MODEL = "tiny-org/tiny-model"


def test_every_driver_error_family_has_a_class_and_none_is_left_to_a_500():
    cases = [
        (pgx.InternalClientError("cannot switch to state 15; another operation is in progress"), UNAVAILABLE),
        (pgx.ConnectionDoesNotExistError("connection was closed in the middle of operation"), UNAVAILABLE),
        (asyncpg.InterfaceError("pool is closing"), UNAVAILABLE),
        (pgx.AdminShutdownError("terminating connection due to administrator command"), UNAVAILABLE),
        (pgx.CannotConnectNowError("the database system is starting up"), UNAVAILABLE),
        (pgx.TooManyConnectionsError("sorry, too many clients already"), UNAVAILABLE),
        (ConnectionRefusedError(111, "refused"), UNAVAILABLE),
        (asyncio.TimeoutError(), UNAVAILABLE),
        (pgx.InvalidPasswordError("password authentication failed"), FAULT),
        (pgx.InvalidAuthorizationSpecificationError('role "x" is not permitted to log in'), FAULT),
        (pgx.UndefinedTableError('relation "usage" does not exist'), FAULT),
        (pgx.UndefinedColumnError("column does not exist"), FAULT),
        (pgx.InvalidCatalogNameError('database "x" does not exist'), FAULT),
        (pgx.InsufficientPrivilegeError("permission denied for table keys"), FAULT),
        (pgx.ReadOnlySQLTransactionError("cannot execute INSERT in a read-only transaction"), FAULT),
        (pgx.DataError("something unforeseen"), FAULT),  # the unforeseen: the operator is told
        (pgx.DeadlockDetectedError("deadlock detected"), RETRY),
        (pgx.InvalidCachedStatementError("cached plan must not change result type"), RETRY),
    ]
    for exc, kind in cases:
        failure = classify(exc)
        assert failure is not None and failure.kind == kind, (exc, failure)
    assert classify(pgx.InvalidPasswordError("x")).cause == "auth_failed"
    assert classify(pgx.UndefinedTableError("x")).cause == "schema_missing"
    assert classify(ValueError("ours")) is None and classify(KeyError("ours")) is None


async def psql(server, sql: str, database: str = "postgres") -> str:
    """psql off the event loop: an ALTER waiting for a lock the ledger's transaction holds must
    not also stop the loop that would finish that transaction."""
    return await asyncio.to_thread(server.psql, sql, database)


def _dsn_as(dsn: str, user: str) -> str:
    return dsn.replace("postgresql://postgres@", f"postgresql://{user}@", 1)


def _database(dsn: str) -> str:
    return dsn.rsplit("/", 1)[1]


async def test_a_start_refused_by_the_database_exits_2_with_one_line(pg_dsn, pg_server, tmp_path):
    """A role that may not log in (what a changed password or a wrong user looks like to the
    proxy): `serve` says why on one line and exits 2, no traceback; a missing database too."""
    await psql(pg_server, "CREATE ROLE rp_locked NOLOGIN")
    try:
        for dsn, words in ((_dsn_as(pg_dsn, "rp_locked"), "rejected the proxy's credentials"),
                           (pg_dsn.rsplit("/", 1)[0] + "/no_such_database", "does not exist")):
            config = tmp_path / "proxy.yaml"
            config.write_text(yaml.safe_dump({"ledger": {"backend": "postgres", "dsn": dsn,
                                                         "spool_path": str(tmp_path / "spool.jsonl")}}))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(free_port()), cwd=ROOT,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            text = err.decode()
            assert proc.returncode == 2, (proc.returncode, text[-2000:])
            lines = [line for line in text.splitlines() if line.strip() and not line.startswith("{")]  # not logs
            assert len(lines) == 1 and words in lines[0] and "Traceback" not in text, text[-2000:]
            assert lines[0].startswith("responses-proxy: cannot start: the ledger database")
            assert "password" not in lines[0].lower() or "authentication" in lines[0].lower()
    finally:
        await psql(pg_server, "DROP ROLE IF EXISTS rp_locked")


async def test_a_renamed_table_is_a_fault_settlements_wait_in_the_spool_and_apply_after_the_repair(
        pg_dsn, tmp_path, pg_server):
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    led.replay_interval_s = 0.2
    db = _database(pg_dsn)
    try:
        secret, key = await led.create_key("fault", 10_000)
        await led.hold("before-0", key.key_id, 1_000, ttl_s=60)
        await led.hold("before-1", key.key_id, 1_000, ttl_s=60)
        await psql(pg_server, "ALTER TABLE usage RENAME TO usage_gone", db)
        try:
            # A request that was running settles: never dropped, never raised.
            assert await led.settle("before-0", usage_for("before-0", key.key_id, 400))
            assert led.fault == "schema_missing"
            assert [r["request_id"] for r in led.spool.records()] == ["before-0"]
            with pytest.raises(LedgerFault) as info:  # no new money is reserved meanwhile
                await led.hold("new", key.key_id, 1, ttl_s=60)
            assert info.value.cause == "schema_missing"
            await asyncio.sleep(0.6)  # replays meanwhile fail their probe: the record stays
            assert [r["request_id"] for r in led.spool.records()] == ["before-0"]
            assert not led.spool.rejected()
            assert await led.settle("before-1", usage_for("before-1", key.key_id, 300))
        finally:
            await psql(pg_server, "ALTER TABLE usage_gone RENAME TO usage", db)
        assert await wait_for(lambda: not led.spool.pending() and led.fault is None, 10.0)
        assert (await led.get_key(key.key_id)).balance_micros == 10_000 - 400 - 300
        assert [(await led.usage(r)).debited_micros for r in ("before-0", "before-1")] == [400, 300]
        assert await led.holds() == []
        assert all(balance == expected for _, balance, expected in await led.audit())
        await led.hold("after", key.key_id, 1, ttl_s=60)  # serving again
    finally:
        if pg_server.proc is None:
            pg_server.start()
        await led.close()


async def test_a_driver_error_outside_the_old_list_is_unavailable_and_its_settlement_spooled(
        pg_dsn, tmp_path, monkeypatch):
    """asyncpg's InternalClientError ("cannot switch to state 15"), raised under a fast shutdown,
    was neither unavailable nor caught: a lost settlement and a 500."""
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    led.replay_interval_s = 0.2
    try:
        secret, key = await led.create_key("state15", 10_000)
        await led.hold("s-0", key.key_id, 1_000, ttl_s=60)
        real = asyncpg.connection.Connection.fetchrow

        async def broken(self, *args, **kwargs):
            raise pgx.InternalClientError("cannot switch to state 15; another operation is in progress")

        monkeypatch.setattr(asyncpg.connection.Connection, "fetchrow", broken)
        with pytest.raises(LedgerUnavailable) as info:
            await led.lookup_key(secret)
        assert not isinstance(info.value, LedgerFault) and led.fault is None
        assert await led.settle("s-0", usage_for("s-0", key.key_id, 250))
        assert [r["request_id"] for r in led.spool.records()] == ["s-0"]
        monkeypatch.setattr(asyncpg.connection.Connection, "fetchrow", real)
        assert await wait_for(lambda: not led.spool.pending(), 10.0)
        assert (await led.usage("s-0")).debited_micros == 250
    finally:
        await led.close()


async def test_a_spool_record_that_cannot_apply_waits_and_a_malformed_one_is_set_aside(pg_dsn, tmp_path):
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    try:
        _, key = await led.create_key("spool", 10_000)
        good = settle_record("good", usage_for("good", key.key_id, 100))
        orphan = settle_record("orphan", usage_for("orphan", "key_that_is_gone", 100))
        broken = settle_record("broken", usage_for("broken", key.key_id, 100))
        broken["usage"]["cost_micros"] = -5  # never a valid settlement
        led.spool.append_many([orphan, broken, good])
        assert await led.replay_spool() == 1
        assert (await led.usage("good")).debited_micros == 100
        assert [r["request_id"] for r in led.spool.records()] == ["orphan"]  # waits, is not dropped
        assert [json.loads(line)["request_id"] for line in led.spool.rejected()] == ["broken"]
        assert await led.replay_spool() == 0 and [r["request_id"] for r in led.spool.records()] == ["orphan"]
    finally:
        await led.close()


async def _keys_cli(config: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "keys", "--config", str(config), *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


async def test_keys_spool_shows_what_waits_and_replays_it_after_the_repair(pg_dsn, tmp_path, pg_server):
    section = pg_section(pg_dsn, tmp_path)
    config = tmp_path / "proxy.yaml"
    config.write_text(yaml.safe_dump({"ledger": section}))
    led = open_ledger(section)
    await led.start()
    db = _database(pg_dsn)
    try:
        _, key = await led.create_key("cli", 10_000)
        await led.hold("w-0", key.key_id, 1_000, ttl_s=60)
        await psql(pg_server, "ALTER TABLE usage RENAME TO usage_gone", db)
        try:
            assert await led.settle("w-0", usage_for("w-0", key.key_id, 600))
        finally:
            await led.close()  # the replica is gone; its spool stays on disk
        code, out, err = await _keys_cli(config, "spool")
        assert code == 0 and "w-0" in out and "1 waiting" in err, (out, err)
        code, out, err = await _keys_cli(config, "spool", "replay")  # still broken: it stays, exit 1
        assert code == 1 and "w-0" in (out + err), (out, err)
        assert [r["request_id"] for r in led.spool.records()] == ["w-0"]
        await psql(pg_server, "ALTER TABLE usage_gone RENAME TO usage", db)
        code, out, err = await _keys_cli(config, "spool", "replay")
        assert code == 0 and "0 waiting" in err, (out, err)
        assert not led.spool.pending()
        check = open_ledger(section)
        await check.start()
        try:
            assert (await check.usage("w-0")).debited_micros == 600
            assert (await check.get_key(key.key_id)).balance_micros == 10_000 - 600
        finally:
            await check.close()
    finally:
        await psql(pg_server, "ALTER TABLE IF EXISTS usage_gone RENAME TO usage", db)


async def test_leases_are_not_spent_while_the_ledger_has_a_fault(pg_dsn, tmp_path, pg_server):
    led = open_ledger(pg_section(pg_dsn, tmp_path))
    await led.start()
    leases = Leases(led, hold_ttl_s=60, max_micros=1_000_000, seconds=2, min_rate=1, idle_s=30, ttl_s=30,
                    linger_s=0.005)
    db = _database(pg_dsn)
    try:
        _, key = await led.create_key("leased", 5_000_000)
        for i in range(20):  # busy: the key gets a lease
            hold = await leases.hold_up_to(f"l-{i}", key.key_id, 10, 100)
            leases.finish(hold, usage_for(f"l-{i}", key.key_id, 10))
            await asyncio.sleep(0.01)  # not a wait: paced traffic, busy enough for a lease
        await leases.flush()
        served = leases.stats["lease_holds"]
        last = await leases.hold_up_to("l-last", key.key_id, 10, 100)
        assert served > 0 and leases.stats["lease_holds"] == served + 1  # from the lease, in memory
        await psql(pg_server, "ALTER TABLE usage RENAME TO usage_gone", db)
        try:
            leases.finish(last, usage_for("l-last", key.key_id, 10))
            await leases.flush()  # its usage row fails to commit: spooled, and the fault is known
            assert led.fault == "schema_missing"
            served = leases.stats["lease_holds"]
            with pytest.raises(LedgerFault):
                await leases.hold_up_to("l-during", key.key_id, 10, 100)
            assert leases.stats["lease_holds"] == served
        finally:
            await psql(pg_server, "ALTER TABLE usage_gone RENAME TO usage", db)
        await led.replay_spool()
        assert not led.spool.pending()
        rows = await led.list_usage(key.key_id, limit=100)
        assert len(rows) == 21 and len({r.request_id for r in rows}) == 21
    finally:
        await leases.close()
        await led.close()


async def test_through_the_proxy_a_fault_is_503_ledger_fault_and_readyz_names_it(make_proxy, pg_dsn, tmp_path,
                                                                                 pg_server):
    proxy = await make_proxy({"ledger": pg_section(pg_dsn, tmp_path),
                              "balance": {"lease_max_micros": 0}, "auth": {"key_cache_ttl_s": 60}})
    proxy.ledger.replay_interval_s = 0.2
    secret, key = await proxy.ledger.create_key("http", 50_000_000)
    body = {"model": MODEL, "input": "Hi.", "max_output_tokens": 8}
    auth = {"Authorization": f"Bearer {secret}"}
    db = _database(pg_dsn)
    async with aiohttp.ClientSession() as s:
        # A stream running when the table goes: served whole, its settlement waits in the spool.
        slow = {**body, "stream": True, "max_output_tokens": 64, "input": "Hi. SIM:" + json.dumps({"text": "a b c d e f g h", "delay": 0.1})}
        first = await s.post(proxy.url + "/v1/responses", json=slow, headers=auth)
        assert first.status == 200
        served_id = first.headers["x-request-id"]
        await psql(pg_server, "ALTER TABLE usage RENAME TO usage_gone", db)
        try:
            raw = await first.read()
            assert b"event: response.completed" in raw, raw.decode()[-3000:]
            for _ in range(3):
                refused = await s.post(proxy.url + "/v1/responses", json=body, headers=auth)
                assert refused.status == 503, await refused.text()
                error = (await refused.json())["error"]
                assert error["code"] == "ledger_fault" and "tables" in error["message"]
                assert set(error) == {"message", "type", "param", "code"} and "Retry-After" in refused.headers
                assert "usage_gone" not in error["message"] and "127.0.0.1" not in error["message"]
            readyz = await s.get(proxy.url + "/readyz")
            assert readyz.status == 503 and await readyz.json() == {"status": "not_ready", "reason": "ledger",
                                                                    "cause": "schema_missing"}
        finally:
            await psql(pg_server, "ALTER TABLE usage_gone RENAME TO usage", db)
        await wait_for(lambda: ready(s, proxy), 10.0, what="/readyz 200 after the repair")
        again = await s.post(proxy.url + "/v1/responses", json=body, headers=auth)
        assert again.status == 200
    assert await wait_for(lambda: not proxy.ledger.spool.pending(), 10.0)
    assert (await proxy.ledger.usage(served_id)) is not None
    assert all(balance == expected for _, balance, expected in await proxy.ledger.audit())


async def test_over_the_websocket_the_handshake_and_a_turn_get_503_and_an_error_event_not_500(
        make_proxy, pg_dsn, tmp_path, pg_server):
    """The socket's two doors: its handshake (auth: a key lookup) while the database is down is
    a 503 in the envelope, and a turn on an open socket during a fault is an error event with
    the same code; the socket stays open and serves the next turn after the repair."""
    from tests.http.test_websocket import turn

    proxy = await make_proxy({"ledger": pg_section(pg_dsn, tmp_path), "balance": {"lease_max_micros": 0},
                              "auth": {"key_cache_ttl_s": 60}})
    proxy.ledger.replay_interval_s = 0.2
    secret, _ = await proxy.ledger.create_key("ws", 50_000_000)
    other, _ = await proxy.ledger.create_key("ws-uncached", 50_000_000)
    body = {"model": MODEL, "input": "Hi.", "max_output_tokens": 8}
    db = _database(pg_dsn)
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(proxy.url + "/v1/responses", headers={"Authorization": f"Bearer {secret}"}) as ws:
            assert (await turn(ws, body))[-1]["type"] in ("response.completed", "response.incomplete")
            await psql(pg_server, "ALTER TABLE usage RENAME TO usage_gone", db)
            try:
                events = await turn(ws, body)
                assert events[-1]["type"] == "error", events
                assert events[-1]["error"]["code"] == "ledger_fault"
            finally:
                await psql(pg_server, "ALTER TABLE usage_gone RENAME TO usage", db)
            await wait_for(lambda: ready(s, proxy), 10.0, what="/readyz 200")
            assert (await turn(ws, body))[-1]["type"] in ("response.completed", "response.incomplete")
        await asyncio.to_thread(pg_server.stop)
        try:
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                async with s.ws_connect(proxy.url + "/v1/responses", headers={"Authorization": f"Bearer {other}"}):
                    pass
            assert info.value.status == 503
        finally:
            await asyncio.to_thread(pg_server.start)
