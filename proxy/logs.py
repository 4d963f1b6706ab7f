"""structlog, configured once: JSON lines in production, readable lines in a terminal.

The access log never carries an API key, a secret's prefix or prompt text: it is built
from the request id, the client's address (the connection's peer: X-Forwarded-For is not
believed), the key's id, the answer's report and bill (tokens and the cost the ledger row records) and the
error envelope's code.

`access(**fields)` writes the one access-log line per request. With JSON output at level
info or below it skips structlog's processor chain: the same fields in the same order
(the caller's, then event, level, timestamp) serialised once by orjson and written through
structlog's own WriteLogger (same file, same lock, flushed). Otherwise (console output, a
level above info, or structlog never configured, as in the tests) it is `access_log.info`.

An exception (`log.exception(...)`, `exc_info=True`, `exc_info=exc`) is three fields of a JSON
line: `exc_type`, `exc_message` and `exc_traceback` (the formatted traceback, chained causes
included, as one string); the console format prints its readable traceback. The standard
library's loggers (`logging.getLogger("proxy.ledger")`, aiohttp's, asyncio's) are written by a
handler on the root logger through the same renderer, so their lines are JSON lines with the
same fields (and `logger`: the logger's name) too.
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable, MutableMapping
from typing import Any

import orjson
import structlog

_UTC = datetime.UTC
_ORJSON_OPTS = orjson.OPT_NON_STR_KEYS


def _dumps(obj: Any, default: Callable[[Any], Any] | None = None, **_: Any) -> str:
    """json.dumps-compatible for structlog's JSONRenderer; orjson, json.dumps when orjson cannot."""
    try:
        return orjson.dumps(obj, default=default, option=_ORJSON_OPTS).decode()
    except (TypeError, orjson.JSONEncodeError):  # e.g. an int wider than 64 bits
        return json.dumps(obj, default=default)


_second: list[Any] = [-1, ""]  # the last whole second formatted: [epoch second, "YYYY-MM-DDTHH:MM:SS"]


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


def _exception_fields(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """exc_info (True: the exception being handled; an exception; a sys.exc_info() tuple) as
    exc_type, exc_message and exc_traceback, for the JSON renderer (it would write
    `"exc_info": true`)."""
    exc_info = event.pop("exc_info", None)
    if not exc_info:
        return event
    if isinstance(exc_info, BaseException):
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    elif not isinstance(exc_info, tuple):
        exc_info = sys.exc_info()
    kind, exc, tb = exc_info
    if kind is None or exc is None:  # exc_info=True outside an except block: nothing to write
        return event
    module = kind.__module__
    event["exc_type"] = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    event["exc_message"] = str(exc)
    event["exc_traceback"] = "".join(traceback.format_exception(kind, exc, tb))
    return event


_stdlib_handler: logging.Handler | None = None  # configure()'s handler on the root logger


def _route_stdlib(renderer: Any, threshold: int, json_lines: bool) -> None:
    """The standard library's log records through `renderer` (replacing the handler an
    earlier configure() installed); the `proxy` loggers (proxy.ledger) at `threshold`."""
    global _stdlib_handler
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.processors.add_log_level,
                           structlog.processors.TimeStamper(fmt="iso", utc=True)],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *([_exception_fields] if json_lines else []), renderer])
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.setLevel(threshold)
    root = logging.getLogger()
    if _stdlib_handler is not None:
        root.removeHandler(_stdlib_handler)
    root.addHandler(handler)
    _stdlib_handler = handler
    logging.getLogger("proxy").setLevel(threshold)


def reset() -> None:
    """Back to unconfigured (tests): structlog's defaults, no access writer, no handler of
    ours on the root logger."""
    global _access_writer, _access_flush, _stdlib_handler
    structlog.reset_defaults()
    _access_writer = _access_flush = None
    if _stdlib_handler is not None:
        logging.getLogger().removeHandler(_stdlib_handler)
        _stdlib_handler = None
        logging.getLogger("proxy").setLevel(logging.NOTSET)


_access_writer: Callable[[dict[str, Any]], None] | None = None
_access_flush: Callable[[], None] | None = None  # writes the lines _access_writer still holds


def _flush_access() -> None:
    if _access_flush is not None:
        _access_flush()


atexit.register(_flush_access)  # once, not per configure(): it flushes whichever writer is current


def configure(fmt: str, level: str) -> None:  # server.log_format, server.log_level
    global _access_writer, _access_flush
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    json_lines = fmt != "console"
    renderer = (structlog.processors.JSONRenderer(serializer=_dumps) if json_lines
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    threshold = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *([_exception_fields] if json_lines else []),  # the console renderer prints the traceback
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        # WriteLogger: the line and its newline in one write (PrintLogger's print() makes two
        # writes to an unbuffered stderr, two system calls per line).
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _route_stdlib(renderer, threshold, json_lines)
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
