"""The access-log line: JSON output at info goes around structlog's processor chain, with
the same fields, in the same order, as structlog's JSONRenderer would write."""

from __future__ import annotations

import json
import re

import structlog

from proxy.runtime import logs


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
        structlog.reset_defaults()
        logs._access_writer = logs._access_flush = None
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
        structlog.reset_defaults()
        logs._access_writer = logs._access_flush = None


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
        structlog.reset_defaults()
        logs._access_writer = logs._access_flush = None
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
        structlog.reset_defaults()
        logs._access_writer = logs._access_flush = None
    assert len(err.writes) == 1 and err.writes[0].endswith("}\n") and err.writes[0].count("\n") == 1
    assert json.loads(err.writes[0])["request_id"] == "req_1"
