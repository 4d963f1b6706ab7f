"""The idle and total timeouts of a streamed answer's upstream reads (both forwarding handlers)."""

from __future__ import annotations

import asyncio
from typing import Protocol


class _Reading(Protocol):
    @property
    def done(self) -> bool:  # the answer is whole: no read is timed any more
        ...


class ReadWatchdog:
    """The idle and total timeouts of each upstream read, as one lazy timer: an asyncio.timeout
    per read costs more than rewriting the chunk. A read only stamps its start (`since`); the
    timer, when due, re-arms itself at the stamp of the read in progress (if any) and cancels
    the task only once a read has lasted `idle` or runs past `deadline`. Same semantics as
    timeout_at(min(start + idle, deadline)) around each read; writes to the client are not timed."""

    __slots__ = ("loop", "task", "cancelling", "idle", "deadline", "rewriter", "since", "fired", "timer")

    def __init__(self, idle: float, deadline: float, rewriter: _Reading) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.loop = asyncio.get_running_loop()
        self.task = task
        self.cancelling = task.cancelling()
        self.idle = idle
        self.deadline = deadline
        self.rewriter = rewriter
        self.since: float | None = None  # start of the read in progress, None between reads
        self.fired = False
        self.timer: asyncio.TimerHandle | None = None

    def start_read(self) -> None:
        self.since = now = self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_at(min(now + self.idle, self.deadline), self._due)

    def _due(self) -> None:
        self.timer = None
        if self.since is None or self.rewriter.done:
            return  # not reading: the next read re-arms
        due = min(self.since + self.idle, self.deadline)
        if self.loop.time() >= due:
            self.fired = True
            self.task.cancel()
        else:
            self.timer = self.loop.call_at(due, self._due)

    def caused(self) -> bool:
        """Whether the CancelledError a read raised is this timer's (then it is consumed)."""
        if not self.fired or self.task.uncancel() > self.cancelling:
            return False  # not (only) ours: a real cancellation
        self.fired = False
        return True

    def message(self, total: float) -> str:
        if self.since is not None and self.since + self.idle < self.deadline:
            return f"The model server sent nothing for {self.idle:g}s (idle timeout)."
        return f"The model server did not finish within {total:g}s (total timeout)."

    def stop(self) -> None:
        # The timer re-arms itself through this object: cancelling it breaks the cycle that
        # would keep the stream's task, rewriter and response alive until the cyclic GC.
        self.since = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
