"""The access-log line: JSON output at info goes around structlog's processor chain, with
the same fields, in the same order, as structlog's JSONRenderer would write."""

from __future__ import annotations

import json
import logging
import re

import aiohttp
import structlog

from proxy import logs
from tests.conftest import eventually, only


def test_json_access_line_has_the_structlog_fields(capsys):
    # Only logs.access() runs while configured: a structlog logger used now would cache this
    # configuration (cache_logger_on_first_use) for the rest of the session.
    try:
        logs.configure("json", "info")
        capsys.readouterr()
        logs.access(request_id="req_" + "0" * 24, method="POST", path="/v1/responses", model="m", status=200,
                    latency_ms=1.25, upstream="w", outcome="completed", input_tokens=3, cached_tokens=0,
                    output_tokens=2, ttfb_ms=None)
        lines = capsys.readouterr().err.splitlines()
    finally:
        logs.reset()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert list(line) == ["request_id", "method", "path", "model", "status", "latency_ms", "upstream", "outcome",
                          "input_tokens", "cached_tokens", "output_tokens", "ttfb_ms", "event", "level", "timestamp"]
    assert line["event"] == "request" and line["level"] == "info" and line["ttfb_ms"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z", line["timestamp"])


def test_structlog_writes_the_access_line_for_console_output_or_a_level_above_info():
    try:
        for fmt, level in (("json", "warning"), ("console", "info")):
            logs.configure(fmt, level)
            assert logs._access_writer is None, (fmt, level)
    finally:
        logs.reset()


def test_timestamp_is_structlogs_iso_utc_format():
    stamp = logs._timestamp()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z", stamp)


def test_configure_registers_no_exit_hook_of_its_own(monkeypatch, capsys):
    """One exit hook for the process (it flushes the current access writer), however often
    logging is configured: no hook, and no writer with its buffer, piles up per configure."""
    registered = []
    monkeypatch.setattr(logs.atexit, "register", registered.append)
    try:
        for _ in range(3):
            logs.configure("json", "info")
        assert registered == []
        logs.access(request_id="req_1", status=200)  # no running loop: written at once
        logs._flush_access()
    finally:
        logs.reset()
    assert len(capsys.readouterr().err.splitlines()) == 1


class _Recorder:
    """A stderr that records each write(): one per line is one system call on a real one."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_a_line_and_its_newline_are_one_write(monkeypatch):
    err = _Recorder()
    monkeypatch.setattr(logs.sys, "stderr", err)
    try:
        logs.configure("json", "info")
        logs.access(request_id="req_1", status=200)  # no running loop: written at once
        logs._flush_access()
    finally:
        logs.reset()
    assert len(err.writes) == 1 and err.writes[0].endswith("}\n") and err.writes[0].count("\n") == 1
    assert json.loads(err.writes[0])["request_id"] == "req_1"


async def _json_lines_of_two_requests(make_proxy, monkeypatch, mode: str, then=None) -> list[dict]:
    """The JSON log lines of a real app with tests/support/fault_mw.py in `mode`, answering one JSON and
    one stream request (and of `then()`, called after them)."""
    err = _Recorder()
    monkeypatch.setattr(logs.sys, "stderr", err)
    try:
        logs.configure("json", "info")
        structlog.configure(cache_logger_on_first_use=False)  # `log` must not keep this stderr after the test
        proxy = await make_proxy(only("stateless", before_handler=[{"tests.support.fault_mw:create": {"mode": mode}}]))
        async with aiohttp.ClientSession() as http:
            for stream in (False, True):
                body = {"model": "tiny-org/tiny-model", "input": "hello", "max_output_tokens": 8, "stream": stream}
                async with http.post(proxy.url + "/v1/responses", json=body) as r:
                    await r.read()

        def both_logged() -> bool:  # the access lines of answers aiohttp finishes after the handler
            logs._flush_access()
            return sum('"event":"request"' in line.replace(" ", "") for write in err.writes
                       for line in write.splitlines()) >= 2

        await eventually(both_logged, what="the two requests' access lines")
        if then is not None:
            then()
        logs._flush_access()
    finally:
        logs.reset()
    return [json.loads(line) for write in err.writes for line in write.splitlines() if line.startswith("{")]


def _ledger_settlement_fails() -> None:
    raise LookupError("no such hold")


async def test_json_lines_carry_the_exception(make_proxy, monkeypatch):
    """An exception raised in a real app's middleware (tests/support/fault_mw.py raise_after), logged by
    log.exception (a non-stream answer: 500) and by log.error(exc_info=exc) (a stream whose
    answer had started), and a stdlib logger's .exception (as proxy/ledger logs): each is one
    JSON line with exc_type, exc_message and exc_traceback, the traceback naming the raiser."""
    def ledger_logs() -> None:
        try:
            _ledger_settlement_fails()
        except LookupError:
            logging.getLogger("proxy.ledger").exception("settlement failed (request %s)", "req_1")

    lines = await _json_lines_of_two_requests(make_proxy, monkeypatch, "raise_after", ledger_logs)
    by_event = {line["event"]: line for line in lines}
    cases = (("unhandled error", "RuntimeError", "failed after the handler returned", "fault"),
             ("error after the answer started", "RuntimeError", "failed after the handler returned", "fault"),
             ("settlement failed (request req_1)", "LookupError", "no such hold", "_ledger_settlement_fails"))
    for event, kind, message, raiser in cases:
        assert event in by_event, (event, [w[:200] for w in err.writes])
        line = by_event[event]
        assert "exc_info" not in line, line
        assert (line["exc_type"], line["exc_message"]) == (kind, message), line
        trace = line["exc_traceback"]
        assert trace.startswith("Traceback (most recent call last):") and f", in {raiser}\n" in trace, trace
        assert trace.rstrip().endswith(f"{kind}: {message}"), trace
        assert line["level"] == "error", line
    assert by_event["settlement failed (request req_1)"]["logger"] == "proxy.ledger"
    assert by_event["unhandled error"]["request_id"].startswith("req_")


def test_the_console_format_keeps_its_readable_traceback(monkeypatch):
    err = _Recorder()
    monkeypatch.setattr(logs.sys, "stderr", err)
    try:
        logs.configure("console", "info")
        structlog.configure(cache_logger_on_first_use=False)
        try:
            _ledger_settlement_fails()
        except LookupError:
            logs.log.exception("unhandled error", request_id="req_1")
            logging.getLogger("proxy.ledger").exception("settlement failed")
    finally:
        logs.reset()
    text = "".join(err.writes)
    for event in ("unhandled error", "settlement failed"):
        assert event in text, text
    assert text.count("Traceback (most recent call last)") == 2 and "_ledger_settlement_fails" in text, text
    assert "exc_type" not in text, text


async def test_a_write_to_a_client_that_hung_up_logs_no_error(make_proxy, monkeypatch):
    """A client that drops its connection while its answer is written is the client's doing,
    not the proxy's: no error line (aiohttp logs an exception raised out of the handler as a
    500 "Error handling request" with its traceback), only the access line. The write's
    ConnectionResetError is played by tests/support/fault_mw.py (reset_after): in a real hang-up it is
    a race between the write and aiohttp cancelling the handler."""
    lines = await _json_lines_of_two_requests(make_proxy, monkeypatch, "reset_after")
    errors = [line for line in lines if line.get("level") in ("error", "critical") or "exc_traceback" in line]
    assert errors == [], errors[:3]
    assert len([line for line in lines if line.get("event") == "request"]) == 2


def test_asyncpg_pool_warnings_are_said_once_a_minute(caplog):
    """While the database is away asyncpg's pool warns each time it re-opens its floor of
    connections (every 1-2 s): the PostgreSQL ledger lets one through a minute, without its traceback."""
    import logging

    from proxy.ledger.postgres import ledger as postgres

    postgres._quiet_asyncpg()
    pool_log = logging.getLogger("asyncpg.pool")
    with caplog.at_level(logging.WARNING, logger="asyncpg.pool"):
        for _ in range(20):
            try:
                raise ConnectionRefusedError("refused")
            except ConnectionRefusedError:
                pool_log.warning("Failed to restore the pool connection", exc_info=True)
    said = [r for r in caplog.records if r.name == "asyncpg.pool"]
    assert len(said) == 1 and said[0].exc_info is None
