"""structlog, configured once: JSON lines in production, readable lines in a terminal.

The access log never carries an API key or prompt text: it is built from the Outcome
and the request id only.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "auto", level: str = "info") -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()) if fmt == "console"
                else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


access_log = structlog.get_logger("access")
log = structlog.get_logger("proxy")
