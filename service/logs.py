"""Logging: one line per event, with the worker pid; request ids are passed explicitly in messages."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s"


def configure(level: str = "info") -> None:
    """Send ``service.*`` logs to stderr (gunicorn's error log stream) once per process."""
    logger = logging.getLogger("service")
    logger.setLevel(level.upper())
    if not any(getattr(h, "_greenserve", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._greenserve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
