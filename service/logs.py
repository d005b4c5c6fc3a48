"""Logging: ``text`` (one readable line per event, with the worker pid) or ``json`` (one object per line,
for a collector: GREENSERVE_LOG_FORMAT=json).

In JSON mode the app writes the access lines itself (``service.access``: request id, route, status, images,
stage timings, pid, bytes), gunicorn's own lines go through the same formatter (``gunicorn_logconfig``) and
its text access log is off; a traceback is never a line of its own but the ``exc_info`` field of an error.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

FORMAT = "%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s"
JSON_RENAMES = {"asctime": "time", "levelname": "level", "name": "logger", "process": "pid"}
FORMATTER = "pythonjsonlogger.json.JsonFormatter"
access_log = logging.getLogger("service.access")


# control characters (C0, DEL, C1, and the Unicode line and paragraph separators) a message may carry from a
# client (an image URL, a label): written escaped, so no client value can start a forged log line
_CONTROL = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
            for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)}


class TextFormatter(logging.Formatter):
    """One line per event: the message's control characters escaped (a traceback still follows it)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_CONTROL)
        return super().formatMessage(record)


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        return JsonFormatter(JSON_FIELDS, rename_fields=JSON_RENAMES)
    return TextFormatter(FORMAT)


def configure(level: str = "info", fmt: str = "text") -> None:
    """Send ``service.*`` logs to stderr (gunicorn's error log stream) once per process."""
    logger = logging.getLogger("service")
    logger.setLevel(level.upper())
    access_log.setLevel(logging.INFO)  # access lines whatever the level (gunicorn's access log did the same)
    if not any(getattr(h, "_greenserve", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._greenserve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    for ours in logger.handlers:
        if getattr(ours, "_greenserve", False):
            ours.setFormatter(formatter(fmt))
    if fmt == "json":
        logging.captureWarnings(True)  # library warnings as JSON lines (py.warnings, through the root logger)
        _route_gevent_tracebacks()


def gunicorn_logconfig(level: str, fmt: str) -> dict[str, Any] | None:
    """gunicorn's ``logconfig_dict``: its error log (boot, worker exits, timeouts) as JSON lines too."""
    if fmt != "json":
        return None
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"json": {"()": FORMATTER, "fmt": JSON_FIELDS, "rename_fields": JSON_RENAMES}},
            "handlers": {"json": handler},
            "root": {"level": "WARNING", "handlers": ["json"]},
            "loggers": {"gunicorn.error": {"level": level.upper(), "handlers": ["json"], "propagate": False},
                        "gunicorn.access": {"level": "CRITICAL", "handlers": [], "propagate": False}}}


def access(fields: dict[str, Any]) -> None:
    access_log.info("request", extra=fields)


def _route_gevent_tracebacks() -> None:
    """gevent prints a failed greenlet's traceback straight to stderr: as a JSON error line instead."""
    import gevent.hub

    def print_exception(hub: Any, context: Any, t: Any, v: Any, tb: Any) -> None:
        logging.getLogger("service.gevent").error("greenlet failed: %r", context, exc_info=(t, v, tb))

    gevent.hub.Hub.print_exception = print_exception
