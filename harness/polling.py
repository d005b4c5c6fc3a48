"""Waiting in tests without guessing a duration: poll a condition until it holds, or let every ready
greenlet run until it waits."""

from __future__ import annotations

import time
from collections.abc import Callable

import gevent

POLL_S = 0.002


def until(holds: Callable[[], object], timeout_s: float = 2.0, what: str = "") -> None:
    """Poll ``holds`` every POLL_S until it is true; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not holds():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what or holds}")
        gevent.sleep(POLL_S)


def quiet() -> None:
    """Let every greenlet that can run, run, until each waits (an event, a socket, a native thread)."""
    gevent.idle()
    gevent.idle()
