"""The settlement spool: settlements a backend could not reach its database with, kept in a
local append-only file until they can be replayed. Usable by any backend.

    spool = Spool("data/ledger-spool.jsonl")
    spool.append(settle_record(request_id, usage))      # flush + fsync before it returns
    done = await spool.replay(apply)                     # apply(record) per line, in order

One JSON object per line: {"kind": "settle" | "lease_usage" | "release", "request_id": ...,
"usage": {...UsageRecord fields...}, "lease_id": ...}. The format is the pure half of this
module (`encode`, `decode`, `settle_record`, `usage_of`: bytes and dicts, no I/O); `Spool` is
the file half.

Replay never loses a line written meanwhile: it first renames the spool to
`<path>.replay-<pid>-<n>` (atomic; the next append makes a fresh spool file), replays that
file, and deletes it only once every line of it was applied. A replay cut short (the
database went away again, a fault, the process died) leaves the renamed file in place,
rewritten (atomically) to the lines not applied yet; the next replay takes it again, first.
`apply` must therefore be idempotent: backends replay by request id (UNIQUE: a row already
recorded is skipped, never debited twice).

`apply(record)` answers APPLIED, KEPT (it cannot be applied now, say its key is missing
after a dropped table: it stays and is tried again at every replay, the others go on) or
REJECTED (it can never be: not a valid settlement); an exception stops the replay and this
record and the rest stay. Nothing is ever discarded: a rejected record, like a line that
is not a JSON spool record, is moved to `<path>.rejected` for the operator (`keys spool`).
A torn last line (a crash in the middle of a write: it was never acknowledged) goes there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from proxy.ledger.base import UsageRecord

log = logging.getLogger("proxy.ledger")

KINDS = ("settle", "lease_usage", "release")
APPLIED, KEPT, REJECTED = "applied", "kept", "rejected"  # what apply() says of a record
_USAGE_FIELDS = tuple(f.name for f in fields(UsageRecord))
_serial = itertools.count(1)


# ----------------------------------------------------------------------------- the format (pure)


def settle_record(request_id: str, usage: UsageRecord, *, lease_id: str | None = None) -> dict[str, Any]:
    """A settle (or, with lease_id, a leased usage row) as a spool record."""
    data = asdict(usage)
    data["debited_micros"] = None  # the ledger decides it at replay
    record: dict[str, Any] = {"kind": "lease_usage" if lease_id else "settle", "request_id": request_id,
                              "usage": data}
    if lease_id:
        record["lease_id"] = lease_id
    return record


def release_record(request_id: str) -> dict[str, Any]:
    return {"kind": "release", "request_id": request_id}


def usage_of(record: dict[str, Any]) -> UsageRecord:
    """The UsageRecord of a settle / lease_usage record (unknown fields ignored)."""
    data = record["usage"]
    return UsageRecord(**{name: data[name] for name in _USAGE_FIELDS if name in data})


def encode_any(record: Any) -> bytes:
    """A line for the rejected file: the record as it was, whatever it holds."""
    return json.dumps(record, separators=(",", ":"), sort_keys=True, default=str).encode()


def encode(record: dict[str, Any]) -> bytes:
    if record.get("kind") not in KINDS or not record.get("request_id"):
        raise ValueError(f"not a spool record: {record!r}")
    return json.dumps(record, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def decode(data: bytes) -> tuple[list[dict[str, Any]], list[bytes]]:
    """(the records of a spool file's bytes, the lines that are not spool records)."""
    records: list[dict[str, Any]] = []
    bad: list[bytes] = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad.append(line)
            continue
        if isinstance(record, dict) and record.get("kind") in KINDS and record.get("request_id"):
            records.append(record)
        else:
            bad.append(line)
    return records, bad


# ----------------------------------------------------------------------------- the file


class Spool:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.rejected_path = self.path.with_name(self.path.name + ".rejected")
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._replaying = asyncio.Lock()  # binds to no loop until first used (Python >= 3.10)
        self._waiting: list[tuple[list[dict[str, Any]], asyncio.Future]] = []  # group commit
        self._writer: asyncio.Task | None = None
        self.stats = {"appended": 0, "replayed": 0, "skipped": 0, "fsyncs": 0}

    def __repr__(self) -> str:
        return f"Spool({str(self.path)!r})"

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """Appends share the lock; moving the spool aside takes it alone. Else an append that
        opened the file before the rename could land after the replay read it, and be lost
        with the replayed file. A lock file of its own (flock per open: other threads and
        other processes sharing the spool, as --workers do, wait alike)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    def append(self, record: dict[str, Any]) -> None:
        """Append one record; returns once it is on disk (write, flush, fsync)."""
        self.append_many([record])

    def append_many(self, records: list[dict[str, Any]]) -> None:
        """Append records in one write and one fsync; returns once they are on disk.
        Blocking: async callers use `write` (an fsync must not stall the event loop)."""
        if not records:
            return
        data = b"".join(encode(record) for record in records)
        with self._locked(exclusive=False):
            self._append_bytes(self.path, data)
        self.stats["appended"] += len(records)

    async def write(self, records: list[dict[str, Any]]) -> None:
        """append_many from the event loop, group-committed: the records of every caller
        that arrives while a write is on its way go out in the next one, under one fsync.
        Returns once these records are on disk; raises what the write raised (OSError)."""
        for record in records:
            encode(record)  # a bad record fails its own caller, not the group
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((records, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_waiting())
        await asyncio.shield(done)  # a caller that goes away does not take the write with it

    async def _write_waiting(self) -> None:
        while self._waiting:
            group, self._waiting = self._waiting, []
            try:
                await asyncio.to_thread(self.append_many, [r for records, _ in group for r in records])
                self.stats["fsyncs"] += 1
            except BaseException as exc:  # each caller gets the error; none is left waiting
                for _, done in group:
                    if not done.done():
                        done.set_exception(exc if isinstance(exc, Exception) else OSError(str(exc)))
                if not isinstance(exc, Exception):
                    raise
                continue
            for _, done in group:
                if not done.done():
                    done.set_result(None)

    def _append_bytes(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            written = os.write(fd, data)  # O_APPEND: one write, never interleaved with another's
            if written != len(data):
                raise OSError(f"short write to the ledger spool {path}")
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:
            self._sync_dir()  # the file's name is durable too

    def _set_aside(self, lines: list[bytes]) -> None:
        """Lines that can never be applied, kept for the operator (never deleted)."""
        if lines:
            self._append_bytes(self.rejected_path, b"".join(line.rstrip(b"\n") + b"\n" for line in lines))
            self.stats["skipped"] += len(lines)
            log.error("ledger spool: %d line(s) that cannot be applied moved to %s (see `keys spool`)",
                      len(lines), self.rejected_path)

    def _rewrite(self, path: Path, kept: list[dict[str, Any]]) -> None:
        """The replayed file becomes its lines not applied yet (atomically), or goes."""
        if not kept:
            path.unlink(missing_ok=True)
        else:
            tmp = path.with_name(path.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                data = b"".join(encode(record) for record in kept)
                if os.write(fd, data) != len(data):
                    raise OSError(f"short write to {tmp}")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        # No directory fsync: an unlink or a replace lost in a crash brings back lines already
        # applied, and a replay of those changes nothing (idempotent by request id).

    def _sync_dir(self) -> None:
        try:
            fd = os.open(self.path.parent, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _leftovers(self) -> list[Path]:
        """Renamed spools of replays that did not finish, oldest first."""
        found = self.path.parent.glob(self.path.name + ".replay-*") if self.path.parent.is_dir() else []
        return sorted(found, key=lambda p: (p.stat().st_mtime, p.name))

    def pending(self) -> bool:
        """True when there is anything to replay."""
        try:
            if self.path.stat().st_size > 0:
                return True
        except FileNotFoundError:
            pass
        return bool(self._leftovers())

    def records(self) -> list[dict[str, Any]]:
        """Every record waiting (leftovers first, then the spool); for tests and tools."""
        out: list[dict[str, Any]] = []
        for path in [*self._leftovers(), self.path]:
            if path.exists():
                out.extend(decode(path.read_bytes())[0])
        return out

    def rejected(self) -> list[bytes]:
        """The lines set aside as never applicable (kept for the operator)."""
        try:
            return [line for line in self.rejected_path.read_bytes().split(b"\n") if line.strip()]
        except FileNotFoundError:
            return []

    def _rotate(self) -> None:
        """Move the spool aside (atomic rename): appends from now on start a new file."""
        with self._locked(exclusive=True):
            if self.path.exists() and self.path.stat().st_size > 0:
                target = self.path.with_name(f"{self.path.name}.replay-{os.getpid()}-{next(_serial)}")
                # No directory fsync (on the appends' path, under their lock): lost in a
                # crash, the rename leaves the lines under the spool's name, replayed as well.
                os.rename(self.path, target)

    async def replay(self, apply: Callable[[list[dict[str, Any]]], Awaitable[list[str]]],
                     batch: int = 256) -> int:
        """Apply every waiting record in order, `batch` at a time: apply(records) answers a
        verdict per record (APPLIED, KEPT, REJECTED; anything else counts as applied).
        Returns how many were applied. An exception from apply stops the replay (that batch
        and the rest wait for the next one) and propagates."""
        async with self._replaying:
            await asyncio.to_thread(self._rotate)
            done = 0
            for path in self._leftovers():
                try:
                    data = await asyncio.to_thread(path.read_bytes)
                except FileNotFoundError:  # another process sharing this spool replayed it
                    continue
                records, bad = decode(data)
                kept: list[dict[str, Any]] = []
                rejected = list(bad)
                index = 0
                try:
                    for index in range(0, len(records), max(1, batch)):
                        part = records[index:index + max(1, batch)]
                        for record, verdict in zip(part, await apply(part)):
                            if verdict == KEPT:
                                kept.append(record)
                            elif verdict == REJECTED:
                                rejected.append(encode_any(record))
                            else:
                                done += 1
                                self.stats["replayed"] += 1
                    index = len(records)
                finally:
                    kept.extend(records[index:])
                    if rejected or not kept or len(kept) != len(records):
                        await asyncio.to_thread(self._settle_file, path, kept, rejected)
            return done

    def _settle_file(self, path: Path, kept: list[dict[str, Any]], rejected: list[bytes]) -> None:
        self._set_aside(rejected)
        self._rewrite(path, kept)


__all__ = ["Spool", "settle_record", "release_record", "usage_of", "encode", "decode", "KINDS", "APPLIED", "KEPT",
           "REJECTED"]
