"""The one read loop of every streamed answer (the Responses rewriter's and the pass-through's).

`relay` writes what the last read made, reads the next bytes under the stream's watchdog, and
hands them to the stream's core (`feed`: the StreamRewriter's or the SSEScanner's, sans-I/O),
until the core says the answer is done or the upstream ends or fails. Each caller then ends
its own dialect's way (a Responses terminal event, an SSE error event). The upstream's
transport errors are mapped here once: a lost connection is DISCONNECTED (the worker's failure
recorded), a read the watchdog stopped is TIMEOUT (its message still readable from the dog), an
event the core cannot hold is TOO_LARGE, the end of the body is EOF.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from proxy.http.watchdog import ReadWatchdog
from proxy.upstream.client import BadResponse, Disconnected

EOF = "eof"
TIMEOUT = "timeout"
DISCONNECTED = "disconnected"
TOO_LARGE = "too_large"


class _Core(Protocol):
    @property
    def done(self) -> bool:  # nothing more is to be read
        ...


async def relay(read: Callable[[], Awaitable[bytes]], write: Callable[[bytes], Awaitable[None]],
                feed: Callable[[bytes], bytes], core: _Core, dog: ReadWatchdog, pending: bytes,
                lost: Callable[[], object]) -> tuple[bytes, str | None]:
    """-> (what is still to be written, None when the core is done, else how the reading ended).
    One write per upstream read, none for a read that completed no event."""
    while not core.done:
        if pending:
            await write(pending)
            pending = b""
        dog.start_read()
        try:
            data = await read()
        except asyncio.CancelledError:
            if not dog.caused():
                raise
            return pending, TIMEOUT  # dog.since still says which timeout: the caller reads its message
        except (Disconnected, BadResponse):
            dog.since = None
            lost()
            return pending, DISCONNECTED
        dog.since = None
        if not data:
            return pending, EOF
        try:
            pending = feed(data)
        except ValueError:
            return pending, TOO_LARGE
    return pending, None
