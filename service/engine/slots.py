"""Decode threads handed out in rank order: ``RankedSlots``."""

from __future__ import annotations

import contextlib
import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from gevent.event import Event

Rank = tuple[float, int]  # (the image's fair tag, the image's index): lower goes first


class RankedSlots:
    """At most ``n`` holders at a time; waiting greenlets get a slot in rank order, lowest first.

    ``ready(rank)`` (optional) may hold a rank back even with a slot free; it must be monotonic (if it
    holds a rank back, it holds back every later rank too). Call ``recheck()`` when its answer may have
    changed.
    """

    def __init__(self, n: int, ready: Callable[[Rank], bool] | None = None) -> None:
        self._free = n
        self._ready = ready
        self._waiting: list[list[Any]] = []  # heap of [rank, seq, event, still waiting]
        self._seq = itertools.count()

    @contextlib.contextmanager
    def take(self, rank: Rank) -> Iterator[None]:
        entry = [rank, next(self._seq), Event(), True]
        heapq.heappush(self._waiting, entry)
        self.recheck()
        try:
            entry[2].wait()
        except BaseException:  # killed (deadline): give up the place, or the slot handed over
            entry[3] = False
            if entry[2].is_set():
                self._release()
            raise
        try:
            yield
        finally:
            self._release()

    def recheck(self) -> None:
        """Hand free slots to the best waiters that are ready."""
        while self._free and self._waiting:
            entry = self._waiting[0]
            if not entry[3]:  # killed while waiting
                heapq.heappop(self._waiting)
                continue
            if self._ready is not None and not self._ready(entry[0]):
                return  # held back, and so is every later rank
            heapq.heappop(self._waiting)
            entry[3] = False
            self._free -= 1
            entry[2].set()

    def free(self) -> int:
        """Slots no one holds."""
        return self._free

    def _release(self) -> None:
        self._free += 1
        self.recheck()
