"""Urgent work: what a person waits on gets the cores. Three forwards are urgent: a streamed answer's first
row, and another caller's images run inside an album's forward (``preemption``) or while its batch gathers.
So is the decode of a streamed answer's first image, for the hub's reads only.

While an urgent forward runs, no decode starts (``Scheduler._may_decode``) and the hub reads no fetched body
(``Urgency.turn``, between chunks); what is under way finishes. Beside a 30-photo album being fetched and
decoded, the first row's one-image forward took 220-390 ms instead of ~100: torch's threads wait for each
other at every layer, and the hub (nice 0) receiving 4.7 MB photos, or a decode thread, on one of their
cores delays them all. With both held it took 98 ms; a one-photo caller beside 4 albums saw its p99 at
1.57x idle instead of 1.94x. Holding the reads while the first image decodes too brought the first line
from ~+40 ms to ~+13 ms over one photo alone (docs/SCHEDULING.md, "Urgent forwards"). Reads wait at most
``HOLD_MAX_S`` per hold, so a slow model never stalls the fetches for long.
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

    @property
    def active(self) -> bool:
        """Whether an urgent forward runs now."""
        return self._forwards > 0

    def begin(self) -> None:
        self._forwards += 1
        self._hold()

    def end(self) -> None:
        self._forwards -= 1
        self._release()

    @contextlib.contextmanager
    def reads_held(self) -> Iterator[None]:
        """Around a streamed answer's first decode: the reads wait, the other decodes go on (on 2 cores the
        first decode and one more each have a core once the hub stops receiving)."""
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
