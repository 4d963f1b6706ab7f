"""The lease journal (proxy/ledger/lease_journal.py): a leased request's usage row is on local
disk before its answer's end, and a process that dies before the row's commit leaves it for
the next start, which commits it exactly once.

Real SQLite ledgers in tmp_path, real files, a real fsync thread; a "death" is a journal whose
owner let go of its lock without committing (what the kernel does for a SIGKILLed process: the
subprocess test in tests/integration/test_durability.py kills one for real)."""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import orjson
import pytest

from proxy.ledger import UsageRecord
from proxy.ledger.lease import LeaseHold, Leases
from proxy.ledger.lease_journal import LeaseJournal, recover
from proxy.ledger.sqlite.ledger import SQLiteLedger
from tests.conftest import eventually, fill, tiny_tmpfs


@pytest.fixture
async def ledger(tmp_path):
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    await ledger.start()
    yield ledger
    await ledger.close()


def _usage(request_id: str, key_id: str, cost: int) -> UsageRecord:
    return UsageRecord(request_id=request_id, key_id=key_id, model="m", input_tokens=3, cached_tokens=0,
                       output_tokens=2, reasoning_tokens=0, cost_micros=cost, status="completed")


async def _leased(ledger, journal: str = "fsync", **kw) -> tuple[Leases, str]:
    """Leases whose commits never come by themselves (an hour, a million rows), and a key leased."""
    _, key = await ledger.create_key("busy", 10_000_000)
    leases = Leases(ledger, hold_ttl_s=60, min_rate=1, idle_s=3600, linger_s=3600, commit_rows=1_000_000,
                    journal=journal, **kw)
    warm = iter(range(1_000_000))

    async def leased() -> bool:
        hold = await leases.hold_up_to(f"warm-{next(warm)}", key.key_id, 1, 1000)
        leases.finish(hold, None)
        return isinstance(hold, LeaseHold)

    await eventually(leased, what="the key leased")
    return leases, key.key_id


def _journal_rows(folder: Path) -> list[str]:
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        out += [orjson.loads(line)["request_id"] for line in path.read_bytes().split(b"\n") if line.strip()]
    return out


async def _used(ledger, key_id) -> dict[str, int]:
    return {u.request_id: u.debited_micros for u in await ledger.list_usage(key_id, limit=10_000)}


async def test_a_leased_row_is_in_the_journal_when_its_future_resolves_and_not_yet_in_the_ledger(ledger):
    leases, key_id = await _leased(ledger)
    folder = Path(ledger.lease_journal_path)
    for i in range(5):
        hold = await leases.hold_up_to(f"r{i}", key_id, 1, 1000)
        assert isinstance(hold, LeaseHold)
        durable = leases.finish(hold, _usage(f"r{i}", key_id, 100), waited=True)
        assert durable is not None
        await durable
        assert f"r{i}" in _journal_rows(folder)  # on disk before the caller writes the answer's end
    assert await _used(ledger, key_id) == {}  # the commit has not come: the journal alone holds them
    await leases.close()
    assert set(await _used(ledger, key_id)) == {f"r{i}" for i in range(5)}
    assert list(folder.iterdir()) == []  # committed: segments and the lock gone


async def test_a_process_that_died_leaves_rows_the_next_start_commits_exactly_once(ledger, tmp_path):
    leases, key_id = await _leased(ledger)
    before = (await ledger.get_key(key_id)).balance_micros
    for i in range(7):
        hold = await leases.hold_up_to(f"d{i}", key_id, 1, 1000)
        await leases.finish(hold, _usage(f"d{i}", key_id, 10 + i), waited=True)
    journal = leases.journal
    assert journal is not None
    # The process "dies": its lock let go, nothing committed (a SIGKILL frees the flock the same way).
    os.close(journal._lock_fd)
    journal._lock_fd = None
    assert await _used(ledger, key_id) == {}
    assert await recover(ledger.lease_journal_path, ledger) == 7
    used = await _used(ledger, key_id)
    assert used == {f"d{i}": 10 + i for i in range(7)}
    assert before - (await ledger.get_key(key_id)).balance_micros == sum(10 + i for i in range(7))
    assert await recover(ledger.lease_journal_path, ledger) == 0  # nothing left, nothing twice
    assert list(Path(ledger.lease_journal_path).glob("*.jsonl")) == []


async def test_rows_committed_before_the_death_are_not_debited_twice_by_the_recovery(ledger):
    leases, key_id = await _leased(ledger)
    for i in range(4):
        hold = await leases.hold_up_to(f"c{i}", key_id, 1, 1000)
        await leases.finish(hold, _usage(f"c{i}", key_id, 50), waited=True)
    folder = Path(ledger.lease_journal_path)
    kept = {p: p.read_bytes() for p in folder.glob("*.jsonl")}
    await leases.flush()  # committed: its segment removed...
    assert not list(folder.glob("*.jsonl"))
    for path, data in kept.items():  # ...and put back, as a crash between the commit and the unlink leaves it
        path.write_bytes(data)
    os.close(leases.journal._lock_fd)
    leases.journal._lock_fd = None
    balance = (await ledger.get_key(key_id)).balance_micros
    assert await recover(folder, ledger) == 0
    assert (await ledger.get_key(key_id)).balance_micros == balance


async def test_a_live_process_journal_is_left_alone(ledger):
    leases, key_id = await _leased(ledger)
    hold = await leases.hold_up_to("live", key_id, 1, 1000)
    await leases.finish(hold, _usage("live", key_id, 5), waited=True)
    assert await recover(ledger.lease_journal_path, ledger) == 0  # its owner holds the lock
    assert await _used(ledger, key_id) == {}
    assert _journal_rows(Path(ledger.lease_journal_path)) == ["live"]
    await leases.close()
    assert set(await _used(ledger, key_id)) == {"live"}


async def test_a_torn_last_line_is_dropped_and_the_rest_recovered(ledger, tmp_path):
    _, key = await ledger.create_key("torn", 1_000_000)
    folder = Path(ledger.lease_journal_path)
    folder.mkdir()
    rows = [orjson.dumps({"kind": "lease_usage", "request_id": f"t{i}", "lease_id": "lease:gone",
                          "usage": _usage(f"t{i}", key.key_id, 7)}) for i in range(3)]
    (folder / "999-dead.0.jsonl").write_bytes(b"\n" + b"\n".join(rows) + b'\n{"kind":"lease_usage","requ')
    assert await recover(folder, ledger) == 3
    assert set(await _used(ledger, key.key_id)) == {"t0", "t1", "t2"}
    assert list(folder.iterdir()) == []


async def test_write_mode_waits_for_nothing_and_the_row_is_in_the_file(ledger):
    leases, key_id = await _leased(ledger, journal="write")
    hold = await leases.hold_up_to("w", key_id, 1, 1000)
    assert leases.finish(hold, _usage("w", key_id, 9), waited=True) is None
    assert _journal_rows(Path(ledger.lease_journal_path)) == ["w"]
    await leases.close()
    assert set(await _used(ledger, key_id)) == {"w"}


async def test_off_keeps_no_journal(ledger):
    leases, key_id = await _leased(ledger, journal="off")
    assert leases.journal is None
    hold = await leases.hold_up_to("o", key_id, 1, 1000)
    assert leases.finish(hold, _usage("o", key_id, 9), waited=True) is None
    assert not Path(ledger.lease_journal_path).exists()
    await leases.close()


async def test_a_journal_on_a_full_disk_waits_for_the_ledger_commit_instead(tmp_path):
    """ENOSPC: the row cannot be kept on disk, so its answer waits for the commit with the
    ledger, started at once; when the future resolves, the row is in the ledger."""
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    await ledger.start()
    try:
        with tiny_tmpfs(tmp_path / "journal") as folder:
            ledger.lease_journal_path = str(folder / "leased")
            leases, key_id = await _leased(ledger)
            hold = await leases.hold_up_to("ok", key_id, 1, 1000)
            await leases.finish(hold, _usage("ok", key_id, 3), waited=True)
            assert await _used(ledger, key_id) == {}  # the journal took it
            await leases.flush()  # the next row opens a segment of its own: on a full disk
            filler = fill(folder)
            for i in range(3):
                hold = await leases.hold_up_to(f"full{i}", key_id, 1, 1000)
                durable = leases.finish(hold, _usage(f"full{i}", key_id, 3), waited=True)
                assert durable is not None
                await asyncio.wait_for(durable, 10)
                assert f"full{i}" in await _used(ledger, key_id)  # in the ledger before the answer's end
            assert isinstance(leases.journal.fault, OSError)
            filler.unlink()
            await leases.close()
            assert set(await _used(ledger, key_id)) == {"ok", "full0", "full1", "full2"}
    finally:
        await ledger.close()


async def test_a_journal_lock_is_exclusive_to_its_process(tmp_path):
    journal = LeaseJournal(tmp_path / "j")
    journal.write(_usage("x", "k", 1), "lease:x", wait=False)
    fd = os.open(tmp_path / "j" / f"{journal.owner}.lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    journal.done(journal.cut(), True)
    await journal.close()
    assert list((tmp_path / "j").iterdir()) == []
