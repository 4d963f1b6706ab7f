"""The fault-injection tier (`make test-faults`): a cluster of proxy replicas (separate
`python -m proxy serve` processes, JSON logs) on one PostgreSQL ledger and one Redis, in front
of the simulator, under a concurrent mixed load (tests/support/fault_load.py: JSON, SSE streams and
WebSocket turns, one client in five hanging up mid-stream); a fault of a backing server is
injected while the load runs, then repaired, then the AUDIT:

  * every answer: no 500, no `internal_error`; every refusal a 503 with Retry-After in the
    OpenAI error envelope (a socket turn: an error event, never a dropped socket); no stream
    cut without its terminal event;
  * every request served (200 and complete) has exactly one usage row, within 30 s of the
    repair (the spools replay); no spool left with records;
  * per key: balance drop == sum of debits, nothing negative; no debit above its cost; no
    request id billed twice; no hold row left past its expiry (swept);
  * no `Traceback` printed as plain text in a replica's log (JSON lines only).

The faults: PostgreSQL fast shutdown and restart after 3 s; a restart; SIGSTOP for 5 s; a
changed password (503 `ledger_fault`, /readyz cause `auth_failed`, a replica started meanwhile
exits 2 with one line); the usage table renamed away (503 `ledger_fault`, /readyz cause
`schema_missing`, no lease serving past a grace, settlements spooled and replayed, the `keys
spool` commands); too few PostgreSQL connections for the pools; Redis stopped (on_error open
and closed); Redis SIGSTOPped for 5 s (no phantom slot in the global concurrency set after).

Not in `make test` (`-m "not faults"` in setup.cfg): `make test-faults`, run by .ci/run.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import asyncpg
import pytest

from proxy.ledger.spool import decode
from tests.support.cluster import Cluster, Replica, create_keys, keys_cli, merged, replica_config
from tests.conftest import eventually, fill, tiny_tmpfs
from tests.support.fault_load import Findings, Load, check_answers, summary
from tests.support.pg_server import PgServer

pytestmark = [pytest.mark.faults, pytest.mark.timeout(150)]

BALANCE = 50_000_000  # far more than the load spends: no 402 in this tier
KEYS = {"hot": BALANCE, "k1": BALANCE, "k2": BALANCE, "k3": BALANCE}
HOLD_TTL_S = 3
APP_PASSWORD = "app-pw-1"


def fault_config(sim_url: str, dsn: str, redis_url: str, **overrides) -> dict:
    """replica_config with limits that refuse nothing under this load, Redis failing open."""
    base = replica_config(sim_url, dsn, redis_url, f"rp-{secrets.token_hex(3)}:", global_concurrency=256)
    base = merged(base, {"limits": {"redis": {"on_error": "open"}}, "balance": {"hold_ttl_s": HOLD_TTL_S}})
    return merged(base, overrides)


@asynccontextmanager
async def running(tmp: Path, sim, dsn: str, redis_url: str, *, admin_dsn: str | None = None, replicas: int = 3,
                  **overrides) -> AsyncIterator[Cluster]:
    keys = await create_keys(dsn, tmp, KEYS)
    config = fault_config(sim.url, dsn, redis_url, **overrides)
    started = [Replica(i, tmp, config) for i in range(replicas)]
    cluster = Cluster(admin_dsn or dsn, started, sim)
    cluster.keys = keys
    try:
        await asyncio.gather(*(r.start() for r in started))
        yield cluster
    finally:
        await asyncio.gather(*(r.stop() for r in cluster.replicas))


Step = Callable[[], Awaitable[object]]


async def nothing() -> None:
    return None


async def under_load(cluster: Cluster, fault: Step, repair: Step, *, during_s: float, findings: Findings,
                     meanwhile: Step = nothing, before_s: float = 1.5, after_s: float = 2.0, clients: int = 24) -> Load:
    """The load; `fault` after `before_s`; `meanwhile` (its failures noted in `findings`)
    beside a wait of `during_s`; `repair`, always; `after_s` more of load; the load stopped."""
    load = Load(cluster, clients=clients)
    load.start()
    try:
        await asyncio.sleep(before_s)  # not a wait: the phases of the load (see the docstring)
        load.t_fault = time.monotonic()
        try:
            await fault()
            await asyncio.gather(asyncio.sleep(during_s), findings.check("during the fault", meanwhile))
        finally:
            await repair()
            load.t_repair = time.monotonic()
        await asyncio.sleep(after_s)
    finally:
        await load.finish()
    return load


def pending_spool(replica: Replica) -> list[dict]:
    """The records waiting in a replica's spool (its file and the leftovers of replays)."""
    out: list[dict] = []
    for path in sorted(replica.spool_path.parent.glob(replica.spool_path.name + "*")):
        if path.is_file():
            out += decode(path.read_bytes())[0]
    for path in sorted(replica.spool_path.parent.glob(replica.spool_path.name + ".leased/*.jsonl")):
        out += decode(path.read_bytes())[0]  # a lease journal not committed yet (or not recovered)
    return out


async def served_are_billed(cluster: Cluster, load: Load, within_s: float) -> None:
    served = load.served_ids()
    assert served, "nothing was served"
    try:
        took = await cluster.wait_billed(served, within_s)
    except AssertionError as exc:
        missing = set(await cluster.unbilled(served))
        raise AssertionError(f"{exc}: {[o for o in load.outcomes if o.request_id in missing][:5]}") from None
    print(f"{len(served)} served requests all billed {took:.1f} s after the load ended")


async def spools_empty(cluster: Cluster, within_s: float = 10) -> None:
    """Every replica's spool replayed to its end (releases and hang-ups' settlements too)."""
    left: dict[int, list] = {}

    def replayed() -> bool:
        left.clear()
        left.update((replica.index, records) for replica in cluster.replicas if (records := pending_spool(replica)))
        return not left

    try:
        await eventually(replayed, within_s, what="every spool replayed", step=0.25)
    except AssertionError:
        index, records = next(iter(left.items()))
        raise AssertionError(f"replica {index}: {len(records)} records left in its spool, e.g. {records[:2]}") from None


def logs_clean(cluster: Cluster) -> None:
    for replica in cluster.replicas:
        plain = replica.plain_tracebacks()
        assert not plain, f"replica {replica.index}: {len(plain)} tracebacks outside the JSON log, e.g. {plain[:4]}"
        lines = [line for line in replica.log().splitlines() if "internal_error" in line]
        assert not lines, f"replica {replica.index} logged internal_error: {lines[:2]}"


async def audit_after(cluster: Cluster, load: Load, findings: Findings, *, within_s: float = 30) -> None:
    """Everything served is billed (spools replayed), the ledger audit, no expired hold, the
    logs; then every failure noted, at once."""
    await findings.check("every served request billed", served_are_billed, cluster, load, within_s)
    await findings.check("spools replayed", spools_empty, cluster)
    await findings.check("no hold past its expiry", cluster.wait_no_expired_holds, HOLD_TTL_S + 2)
    await findings.check("ledger audit", cluster.audit)
    await findings.check("logs", logs_clean, cluster)
    findings.done()


def refused_during(load: Load, *, grace_s: float = 1.0) -> list:
    """Refusals of requests sent between the fault (plus a grace) and the repair."""
    return [o for o in load.outcomes if o.status != 200 and load.t_fault + grace_s <= o.t0 < load.t_repair]


def codes_of(outcomes: list) -> set:
    return {(o.error or {}).get("code") for o in outcomes if "handshake" not in (o.error or {})}


def some_refused(load: Load, codes: set[str] | None = None) -> None:
    during = refused_during(load)
    assert during, "no request was refused during the fault"
    if codes is not None:
        assert codes_of(during) <= codes, codes_of(during)


async def readyz(replica: Replica) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(replica.url + "/readyz", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status, await r.json(content_type=None)


async def until_ready_is(replicas: list[Replica], status: int, body: dict | None, within_s: float) -> None:
    """Every replica's /readyz answers `status` (and exactly `body` when given) within `within_s`."""
    deadline = time.monotonic() + within_s
    for replica in replicas:
        got: list = []

        async def answers() -> bool:
            got[:] = [await readyz(replica)]
            return got[0][0] == status and (body is None or got[0][1] == body)

        try:
            await eventually(answers, max(0.0, deadline - time.monotonic()), what="/readyz", step=0.2)
        except AssertionError:
            raise AssertionError(f"replica {replica.index} /readyz: {got[0]}, want {status} {body}") from None


# ----------------------------------------------------------------------------- PostgreSQL: outages


async def test_postgres_fast_shutdown_under_load_then_restart(pg_server, pg_dsn, redis_db, sim, tmp_path):
    findings = Findings()
    async with running(tmp_path, sim, pg_dsn, redis_db.url) as cluster:
        load = await under_load(cluster, lambda: asyncio.to_thread(pg_server.stop),
                                lambda: asyncio.to_thread(pg_server.start), during_s=3, findings=findings)
        print("fast shutdown for 3 s:", summary(load.outcomes))
        await findings.check("answers", check_answers, load.outcomes)
        await findings.check("the fault bit", some_refused, load)
        await audit_after(cluster, load, findings)


async def test_postgres_restart_under_load(pg_server, pg_dsn, redis_db, sim, tmp_path):
    async def restart() -> None:
        await asyncio.to_thread(pg_server.stop)
        await asyncio.to_thread(pg_server.start)

    findings = Findings()
    async with running(tmp_path, sim, pg_dsn, redis_db.url) as cluster:
        load = await under_load(cluster, restart, nothing, during_s=2, findings=findings)
        print("restart:", summary(load.outcomes))
        await findings.check("answers", check_answers, load.outcomes)
        await audit_after(cluster, load, findings)


async def test_postgres_frozen_5s_under_load(pg_server, pg_dsn, redis_db, sim, tmp_path):
    findings = Findings()
    async with running(tmp_path, sim, pg_dsn, redis_db.url) as cluster:
        load = await under_load(cluster, lambda: asyncio.to_thread(pg_server.freeze),
                                lambda: asyncio.to_thread(pg_server.thaw), during_s=5, findings=findings)
        print("SIGSTOP for 5 s:", summary(load.outcomes))
        await findings.check("answers", check_answers, load.outcomes)
        await findings.check("the fault bit", some_refused, load)
        await audit_after(cluster, load, findings)


async def test_postgres_frozen_then_a_replica_sigkilled_bills_every_answer_served(pg_server, pg_dsn, redis_db, sim,
                                                                                 tmp_path):
    """The database frozen 3 s under load, then a replica SIGKILLed while it still is: every
    answer any replica served (leased keys among them) was on disk before its end was written
    (the replica's spool, or its lease journal), so it is billed once the database answers and
    the killed replica's restart has replayed its spool and recovered its journal. (Before: a
    leased answer's row stayed in memory while its batch waited on the database: 202 answers
    served in the freeze, 0 billed, 0 spool lines.)"""
    findings = Findings()
    async with running(tmp_path, sim, pg_dsn, redis_db.url) as cluster:
        victim = cluster.replicas[0]
        load = Load(cluster, clients=24)
        load.start()
        try:
            await asyncio.sleep(1.5)  # not a wait: load before the fault
            load.t_fault = time.monotonic()
            await asyncio.to_thread(pg_server.freeze)
            try:
                await asyncio.sleep(3)  # not a wait: the freeze lasts 3 s before the kill
                load.down.add(victim.index)
                await victim.kill()
            finally:
                await asyncio.to_thread(pg_server.thaw)
                load.t_repair = time.monotonic()
            await victim.start()  # replays the spool and recovers the journal it left, before serving
            load.down.discard(victim.index)
            await asyncio.sleep(2)  # not a wait: load after the repair
        finally:
            await load.finish()
        print("frozen 3 s, then a replica SIGKILLed:", summary(load.outcomes))
        served_by_victim = [o for o in load.outcomes if o.served and o.replica == victim.index]
        assert served_by_victim, "the killed replica served nothing"
        await findings.check("every served request billed", served_are_billed, cluster, load, 30)
        await findings.check("spools replayed", spools_empty, cluster)
        await findings.check("ledger audit", cluster.audit)
        findings.done()


class FullDiskReplica(Replica):
    """A replica whose spool is on a 64 KiB tmpfs (filled once it has started: ENOSPC)."""

    def __init__(self, index: int, tmp: Path, config: dict, disk: Path) -> None:
        super().__init__(index, tmp, config)
        self.disk = disk

    @property
    def spool_path(self) -> Path:
        return self.disk / "spool.jsonl"


async def test_a_spool_on_a_full_disk_under_load_settles_with_the_database(pg_dsn, redis_db, sim, tmp_path):
    """A replica whose spool's file system is full: every answer it serves is settled with the
    database directly (billed once), and its /readyz names spool_full until the spool can be
    written again. (Before: the settlement failed, the hold waited for its TTL, /readyz said 200:
    20 of 20 answers served and 0 billed.)"""
    findings = Findings()
    with tiny_tmpfs(tmp_path / "disk") as disk:
        keys = await create_keys(pg_dsn, tmp_path, KEYS)
        config = fault_config(sim.url, pg_dsn, redis_db.url)
        full = FullDiskReplica(0, tmp_path, config, disk)
        replicas = [full, Replica(1, tmp_path, config)]
        cluster = Cluster(pg_dsn, replicas, sim)
        cluster.keys = keys
        try:
            await asyncio.gather(*(r.start() for r in replicas))
            filler = fill(disk)
            load = Load(cluster, clients=16)
            load.start()
            try:
                await asyncio.sleep(4)  # not a wait: 4 s of load served on the full disk
                await until_ready_is([full], 503, {"status": "not_ready", "reason": "ledger", "cause": "spool_full"},
                                     10)
            finally:
                await load.finish()
            print("a spool on a full disk:", summary(load.outcomes))
            assert [o for o in load.outcomes if o.served and o.replica == 0], "the full-disk replica served nothing"
            await findings.check("answers", check_answers, load.outcomes, refusals=False)
            await findings.check("every served request billed", served_are_billed, cluster, load, 30)
            await findings.check("ledger audit", cluster.audit)
            filler.unlink()  # room again: the next settlement goes to the spool, and it is ready
            await until_ready_is([full], 200, None, 15)
            findings.done()
        finally:
            await asyncio.gather(*(r.stop() for r in replicas))


# ----------------------------------------------------------------------------- PostgreSQL: faults


@pytest.fixture
def app_pg(request):
    """A PostgreSQL of its own where the proxy connects as `app` (password auth, the owner of
    the `ledger` database) and the test as the superuser (trusted); its settings from the
    test's `pg_settings` mark. -> (server, app dsn, superuser dsn)."""
    mark = request.node.get_closest_marker("pg_settings")
    server = PgServer(settings=mark.args[0] if mark else None)
    (server.data / "pg_hba.conf").write_text("host all postgres 127.0.0.1/32 trust\n"
                                             "host all all 127.0.0.1/32 scram-sha-256\n")
    server.start()
    try:
        server.psql(f"CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}'")
        server.psql("CREATE DATABASE ledger OWNER app TEMPLATE template0")
        yield (server, f"postgresql://app:{APP_PASSWORD}@127.0.0.1:{server.port}/ledger",
               server.dsn_for("ledger"))
    finally:
        server.close()


def terminate_app_backends(server: PgServer) -> None:
    server.psql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'app'")


def late_replica_exits_2(result: tuple[int | None, str]) -> None:
    code, stderr = result
    lines = [line for line in stderr.splitlines() if line.strip()]
    print(f"a replica started during the fault: exit {code}, stderr {lines[:3]}")
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, f"exit {code}, stderr: {stderr[-2000:]}"


async def test_a_changed_password_is_a_ledger_fault_until_repaired(app_pg, redis_db, sim, tmp_path):
    server, dsn, admin = app_pg
    findings = Findings()

    async def fault() -> None:
        await asyncio.to_thread(server.psql, "ALTER ROLE app PASSWORD 'not-the-configured-one'")
        await asyncio.to_thread(terminate_app_backends, server)  # pooled connections must reconnect

    async def repair() -> None:
        await asyncio.to_thread(server.psql, f"ALTER ROLE app PASSWORD '{APP_PASSWORD}'")

    async def meanwhile() -> None:
        late = Replica(len(cluster.replicas), tmp_path, cluster.replicas[0].config)
        exited = asyncio.create_task(late.run_to_exit(within_s=20))
        await findings.check("/readyz during the fault", until_ready_is, cluster.replicas, 503,
                             {"status": "not_ready", "reason": "ledger", "cause": "auth_failed"}, within_s=5)
        await findings.check("a replica started during the fault", late_replica_exits_2, await exited)

    async with running(tmp_path, sim, dsn, redis_db.url, admin_dsn=admin) as cluster:
        load = await under_load(cluster, fault, repair, during_s=5, meanwhile=meanwhile, findings=findings)
        # Statements cut by pg_terminate_backend are an outage (ledger_unavailable); every
        # request sent after that meets the wrong password: ledger_fault.
        print("password changed for 5 s:", summary(load.outcomes))
        await findings.check("answers", check_answers, load.outcomes, codes={"ledger_fault", "ledger_unavailable"})
        await findings.check("ledger_fault during the fault", some_refused, load, {"ledger_fault"})
        await findings.check("/readyz after the repair", until_ready_is, cluster.replicas, 200, None, within_s=10)
        await audit_after(cluster, load, findings)


async def spool_waiting(replicas: list[Replica], within_s: float) -> tuple[Replica, list[dict]]:
    """The first replica with records in its spool, and those records."""
    def spooled() -> tuple[Replica, list[dict]] | None:
        return next(((replica, records) for replica in replicas if (records := pending_spool(replica))), None)

    return await eventually(spooled, within_s, what="a settlement spooled during the fault", step=0.1)


async def spool_cli_lists(holder: Replica, records: list[dict]) -> None:
    code, out, err = await keys_cli(holder, "spool", check=False)
    print(f"keys spool (replica {holder.index}, {len(records)} records waiting): exit {code}\n{out[-800:]}")
    assert code == 0, err[-2000:]
    missing = [r["request_id"] for r in records if r["request_id"] not in out]
    assert not missing, f"{len(missing)} waiting records not listed, e.g. {missing[:3]}: {out[-1000:]}"


async def spool_cli_replays(cluster: Cluster, holder: Replica, records: list[dict]) -> None:
    assert records, "the stopped replica's spool was empty (discarded?)"
    code, out, err = await keys_cli(holder, "spool", "replay", check=False)
    print(f"keys spool replay: exit {code}\n{out[-800:]}")
    assert code == 0, err[-2000:]
    assert pending_spool(holder) == [], "records left after `keys spool replay`"
    unbilled = await cluster.unbilled([r["request_id"] for r in records if r["kind"] != "release"])
    assert unbilled == [], f"replayed yet not billed: {unbilled[:3]}"


def nothing_served_from_leases(load: Load, grace_s: float) -> None:
    leased = [o for o in load.outcomes if o.served and load.t_fault + grace_s <= o.t0 < load.t_repair]
    assert not leased, f"{len(leased)} requests sent during the fault were served (from leases?), e.g. {leased[:2]}"


async def test_a_renamed_usage_table_is_a_ledger_fault_and_the_spool_keeps_every_settlement(
        pg_server, pg_dsn, redis_db, sim, tmp_path):
    """The fault lasts 5 s under load; then, the table still gone, the load stops and the
    replica with spooled settlements is stopped; the repair; `keys spool replay` on it."""
    database = pg_dsn.rsplit("/", 1)[1]
    findings = Findings()
    holder, records = None, []
    async with running(tmp_path, sim, pg_dsn, redis_db.url) as cluster:
        load = Load(cluster, clients=24)
        load.start()
        try:
            await asyncio.sleep(1.5)  # not a wait: load before the fault
            load.t_fault = time.monotonic()
            try:
                await asyncio.to_thread(pg_server.psql, "SET lock_timeout = '10s';"
                                        " ALTER TABLE usage RENAME TO usage_gone", database)
                await findings.check("/readyz during the fault", until_ready_is, cluster.replicas, 503,
                                     {"status": "not_ready", "reason": "ledger", "cause": "schema_missing"}, within_s=5)
                found = await findings.check("settlements spooled", spool_waiting, cluster.replicas, within_s=5)
                await asyncio.sleep(max(0.0, load.t_fault + 5 - time.monotonic()))  # not a wait: the fault lasts 5 s
                await load.finish()
                if found:
                    holder = found[0]
                    await findings.check("keys spool during the fault", spool_cli_lists, holder, pending_spool(holder))
                    await holder.stop()  # its spool stays on its volume
                    records = pending_spool(holder)
            finally:
                await asyncio.to_thread(pg_server.psql, "ALTER TABLE IF EXISTS usage_gone RENAME TO usage", database)
                load.t_repair = time.monotonic()
        finally:
            if not load.stopping.is_set():
                await load.finish()
        if holder is not None:
            await findings.check("keys spool replay after the repair", spool_cli_replays, cluster, holder, records)
        # Statements queued behind the rename's lock may time out (ledger_unavailable); every
        # request sent once the table is gone: ledger_fault.
        print("usage table renamed for 5 s:", summary(load.outcomes))
        await findings.check("answers", check_answers, load.outcomes, codes={"ledger_fault", "ledger_unavailable"})
        await findings.check("ledger_fault during the fault", some_refused, load, {"ledger_fault"})
        await findings.check("no lease serving past 2 s", nothing_served_from_leases, load, 2.0)
        await audit_after(cluster, load, findings)


@pytest.mark.pg_settings({"max_connections": "15", "superuser_reserved_connections": "3"})
async def test_too_few_database_connections_for_the_pools(app_pg, redis_db, sim, tmp_path):
    """12 connections for `app`, 4 replicas whose pools want up to 4 each plus a listener: under
    load some connections are refused (TooManyConnections: "too many clients" in the server's
    log). The fault: every `app` connection terminated, and the test takes up to 8 of the 12
    as they free up, for 4 s; the repair: it gives them back."""
    server, dsn, admin = app_pg
    hogs: list = []
    findings = Findings()

    async def hog() -> None:
        # On a superuser's connection opened before the load: the slots reserved for
        # superusers are taken for moments by the replicas' refused attempts.
        await superuser.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'app'")
        deadline = time.monotonic() + 1.0
        while len(hogs) < 8 and time.monotonic() < deadline:
            try:
                hogs.append(await asyncpg.connect(dsn, timeout=2))
            except asyncpg.exceptions.TooManyConnectionsError:
                await asyncio.sleep(0.01)  # not a wait: retried until a slot frees, within the second

    async def give_back() -> None:
        await asyncio.gather(*(conn.close() for conn in hogs), return_exceptions=True)
        await superuser.close()

    def refused_connections() -> None:
        assert "too many clients" in server.log.read_text(), "PostgreSQL refused no connection"

    async with running(tmp_path, sim, dsn, redis_db.url, admin_dsn=admin, replicas=4,
                       ledger={"pool_max": 4}) as cluster:
        superuser = await asyncpg.connect(admin, timeout=5)
        load = await under_load(cluster, hog, give_back, during_s=4, clients=32, findings=findings)
        print(f"connections exhausted ({len(hogs)} taken by the test for 4 s):", summary(load.outcomes))
        await findings.check("answers", check_answers, load.outcomes)
        await findings.check("the fault bit", refused_connections)
        await audit_after(cluster, load, findings)


# ----------------------------------------------------------------------------- Redis


@pytest.mark.parametrize("on_error", ["open", "closed"])
async def test_redis_stopped_under_load(on_error, pg_dsn, redis_db, sim, tmp_path):
    findings = Findings()
    async with running(tmp_path, sim, pg_dsn, redis_db.url, limits={"redis": {"on_error": on_error}}) as cluster:
        load = await under_load(cluster, lambda: asyncio.to_thread(redis_db.stop),
                                lambda: asyncio.to_thread(redis_db.start), during_s=3, findings=findings)
        print(f"Redis stopped for 3 s, on_error {on_error}:", summary(load.outcomes))
        if on_error == "open":  # admitted on each replica's own counts meanwhile
            await findings.check("answers", check_answers, load.outcomes, refusals=False)
        else:
            await findings.check("answers", check_answers, load.outcomes, codes={"limits_unavailable"})
            await findings.check("the fault bit", some_refused, load)
        await audit_after(cluster, load, findings)


def live_slots(redis_server, key: str) -> int:
    """Members of a concurrency ZSET whose expiry (the score, ms) is still ahead."""
    reply = redis_server.command("ZCOUNT", key, str(int(time.time() * 1000)), "+inf")
    assert reply.startswith(b":"), reply
    return int(reply[1:].strip())


async def no_phantom_slots(redis_server, key: str, thawed: float, within_s: float) -> None:
    await eventually(lambda: live_slots(redis_server, key) == 0, max(0.0, thawed + within_s - time.monotonic()),
                     what=f"no slot left in {key} after SIGCONT, the load ended", step=0.1)
    print(f"global slots 0 {time.monotonic() - thawed:.1f} s after SIGCONT")


async def test_redis_frozen_5s_leaves_no_phantom_slot(pg_dsn, redis_db, sim, tmp_path):
    """slot_ttl_s 20: a slot taken by an admission that timed out during the freeze (Redis runs
    it after SIGCONT), or one whose release was skipped, would count for 20 s."""
    prefix = f"rp-{secrets.token_hex(3)}:"
    findings = Findings()

    async def freeze() -> None:
        os.kill(redis_db.proc.pid, signal.SIGSTOP)

    async def thaw() -> None:
        os.kill(redis_db.proc.pid, signal.SIGCONT)

    async with running(tmp_path, sim, pg_dsn, redis_db.url,
                       limits={"redis": {"key_prefix": prefix, "slot_ttl_s": 20}}) as cluster:
        load = await under_load(cluster, freeze, thaw, during_s=5, after_s=0, findings=findings)
        # The load ends within ~1 s of SIGCONT (its requests in flight finish): then no slot is left.
        await findings.check("no phantom slot", no_phantom_slots, redis_db, prefix + "conc:global",
                             load.t_repair, within_s=3.0)
        print("Redis frozen for 5 s:", summary(load.outcomes))
        # on_error open admits meanwhile; a refusal, if any, is a 503 limits_unavailable.
        await findings.check("answers", check_answers, load.outcomes, codes={"limits_unavailable"})
        await audit_after(cluster, load, findings)
