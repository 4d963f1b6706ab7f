"""structlog, configured once: JSON lines in production, readable lines in a terminal.

The access log never carries an API key, a secret's prefix or prompt text: it is built
from the request id, the client's address (the connection's peer: X-Forwarded-For is not
believed), the key's id, the Outcome (tokens and the cost the ledger row records) and the
error envelope's code.

`access(**fields)` writes the one access-log line per request. With JSON output at level
info or below it skips structlog's processor chain: the same fields in the same order
(the caller's, then event, level, timestamp) serialised once by orjson and written through
structlog's own WriteLogger (same file, same lock, flushed). Otherwise (console output, a
level above info, or structlog never configured, as in the tests) it is `access_log.info`.
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import json
import logging
import sys
import time
from typing import Any, Callable

import orjson
import structlog

_UTC = datetime.timezone.utc
_ORJSON_OPTS = orjson.OPT_NON_STR_KEYS


def _dumps(obj: Any, default: Callable[[Any], Any] | None = None, **_: Any) -> str:
    """json.dumps-compatible for structlog's JSONRenderer; orjson, json.dumps when orjson cannot."""
    try:
        return orjson.dumps(obj, default=default, option=_ORJSON_OPTS).decode()
    except (TypeError, orjson.JSONEncodeError):  # e.g. an int wider than 64 bits
        return json.dumps(obj, default=default)


_second = [-1, ""]  # the last whole second formatted: [epoch second, "YYYY-MM-DDTHH:MM:SS"]


def _timestamp() -> str:
    """What structlog.processors.TimeStamper(fmt="iso", utc=True) writes
    ("2026-11-29T21:03:22.655384Z"; no fraction when the microseconds are 0), with the
    date and time formatted once per second."""
    now = time.time()
    second = int(now)
    if second != _second[0]:
        _second[1] = datetime.datetime.fromtimestamp(second, tz=_UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _second[0] = second
    micros = int((now - second) * 1_000_000)
    return f"{_second[1]}.{micros:06d}Z" if micros else _second[1] + "Z"


_access_writer: Callable[[dict[str, Any]], None] | None = None
_access_flush: Callable[[], None] | None = None  # writes the lines _access_writer still holds


def _flush_access() -> None:
    if _access_flush is not None:
        _access_flush()


atexit.register(_flush_access)  # once, not per configure(): it flushes whichever writer is current


def configure(fmt: str = "auto", level: str = "info") -> None:
    global _access_writer, _access_flush
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()) if fmt == "console"
                else structlog.processors.JSONRenderer(serializer=_dumps))
    threshold = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        # WriteLogger: the line and its newline in one write (PrintLogger's print() makes two
        # writes to an unbuffered stderr, two system calls per line).
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _flush_access()  # what the previous configuration still holds goes out under it
    _access_writer = _access_flush = None
    if fmt != "console" and threshold <= logging.INFO:
        printer = structlog.WriteLogger(file=sys.stderr)
        # Under load many requests end in one turn of the event loop: their lines are written
        # together at the end of it, one write and flush instead of one per request. A line
        # waits at most that turn; outside a loop it is written at once.
        pending: list[str] = []

        def flush() -> None:
            if pending:
                lines = "\n".join(pending)
                pending.clear()
                printer.msg(lines)

        def write(fields: dict[str, Any]) -> None:
            fields["event"] = "request"
            fields["level"] = "info"
            fields["timestamp"] = _timestamp()
            line = _dumps(fields)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                flush()
                printer.msg(line)
                return
            if not pending:
                loop.call_soon(flush)
            pending.append(line)

        _access_writer, _access_flush = write, flush


def access(**fields: Any) -> None:
    """One access-log line ("request" at info)."""
    writer = _access_writer
    if writer is not None:
        try:
            writer(fields)
            return
        except Exception:  # never lose the line: the structlog path below writes it
            fields.pop("event", None)
            fields.pop("level", None)
            fields.pop("timestamp", None)
    access_log.info("request", **fields)


access_log = structlog.get_logger("access")
log = structlog.get_logger("proxy")
