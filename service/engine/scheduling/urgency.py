"""Holding the hub's reads while urgent work runs: ``Urgency``.

While a forward someone waits on runs (``rules.holds``), the hub reads no fetched body: ``turn`` waits
between two chunks of a body, at most ``HOLD_MAX_S`` per hold, so a slow model never stalls the fetches
for long. Decodes are held by the rules (``rules.may_decode`` reads ``active``). Why: docs/SCHEDULING.md,
"urgent" and "first-decode".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import gevent
from gevent.event import Event

HOLD_MAX_S = 0.5


class Urgency:
    def __init__(self) -> None:
        self._forwards = 0  # urgent forwards running: decodes wait too
        self._holds = 0  # what holds the reads now: each urgent forward, each first decode
        self._reads = Event()  # set: the hub may read
        self._reads.set()
        self._until = 0.0
        self.ended = 0.0  # when the last urgent forward ended

    @property
    def active(self) -> bool:
        """Whether an urgent forward runs now."""
        return self._forwards > 0

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around an urgent forward: reads wait, and ``active`` holds the decodes."""
        self._forwards += 1
        self._hold()
        try:
            yield
        finally:
            self._forwards -= 1
            self._release()
            self.ended = time.monotonic()

    @contextlib.contextmanager
    def reads_held(self) -> Iterator[None]:
        """Around a streamed answer's first decode: the reads wait, the other decodes go on."""
        self._hold()
        try:
            yield
        finally:
            self._release()

    def turn(self) -> None:
        """Between two chunks of a fetched body, on the hub: let the other greenlets run (a socket that
        holds data never makes its reader wait), and wait while something urgent runs."""
        left = self._until - time.monotonic()
        if not self._reads.is_set() and left > 0:
            self._reads.wait(left)
        else:
            gevent.sleep(0)

    def _hold(self) -> None:
        self._holds += 1
        self._reads.clear()
        self._until = time.monotonic() + HOLD_MAX_S

    def _release(self) -> None:
        self._holds -= 1
        if not self._holds:
            self._reads.set()
