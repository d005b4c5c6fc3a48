"""Urgent forwards: a short forward a person waits on gets the cores. Three are: a streamed answer's first
row, and another caller's images run inside an album's forward (``preemption``) or while its batch gathers.

While one runs, no decode starts (``Scheduler._may_decode``) and the hub reads no fetched body
(``Urgency.turn``, between chunks); what is under way finishes. Beside a 30-photo album being fetched and
decoded, the first row's one-image forward took 220-390 ms instead of ~100: torch's threads wait for each
other at every layer, and the hub (nice 0) receiving 4.7 MB photos, or a decode thread, on one of their
cores delays them all. With both held it took 98 ms; a one-photo caller beside 4 albums saw its p99 at
1.57x idle instead of 1.94x (docs/SCHEDULING.md, "Urgent forwards").
Reads wait at most ``HOLD_MAX_S`` per forward, so a slow model never stalls the fetches for long.
"""

from __future__ import annotations

import time

import gevent
from gevent.event import Event

HOLD_MAX_S = 0.5


class Urgency:
    def __init__(self) -> None:
        self._running = 0
        self._reads = Event()  # set: the hub may read
        self._reads.set()
        self._until = 0.0

    @property
    def active(self) -> bool:
        """Whether an urgent forward runs now."""
        return self._running > 0

    def begin(self) -> None:
        self._running += 1
        self._reads.clear()
        self._until = time.monotonic() + HOLD_MAX_S

    def end(self) -> None:
        self._running -= 1
        if not self._running:
            self._reads.set()

    def turn(self) -> None:
        """Between two chunks of a fetched body, on the hub: let the other greenlets run (a socket that
        holds data never makes its reader wait), and wait while an urgent forward runs."""
        left = self._until - time.monotonic()
        if not self._reads.is_set() and left > 0:
            self._reads.wait(left)
        else:
            gevent.sleep(0)
