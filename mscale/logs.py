"""structlog set-up: JSON lines to stdout (journald), readable console on a terminal.

Called by entry points only; importing mscale configures nothing.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(level: str = "info", *, json: bool | None = None, stream=None) -> None:
    stream = stream or sys.stdout
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def debug_wanted() -> bool:
    """Whether the library's routine debug lines (one per in-memory snapshot...) should be
    logged. The library configures no logging: where the application configured structlog, its
    level filter decides (True here); unconfigured, structlog prints every level, so they are
    logged only when asked for with MSCALE_LOG_LEVEL=debug."""
    return structlog.is_configured() or os.environ.get("MSCALE_LOG_LEVEL", "").lower() == "debug"
