"""Waiters served by tag: the images waiting for the model (``FairQueue``) and the decode threads'
waiters (``RankedSlots``), each lowest tag first."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gevent.event import AsyncResult, Event

from service.engine.scheduling.admission import Admission
from service.engine.scheduling.view import Rank, Waiting
from service.errors import DeadlineExceeded


@dataclass(eq=False)
class Queued:
    """One image (or text) on its way to a forward; its row (or error) is set on ``result``."""

    pixels: Any  # a crop (H, W, 3), token ids, or a JPEG for the device (``types.EncodedJpeg``)
    deadline: float | None
    admission: Admission
    waiting: Waiting  # its place: tag, arrival, request, caller
    result: AsyncResult = field(default_factory=AsyncResult)
    enqueued: float = field(default_factory=time.monotonic)


class FairQueue:
    """Images waiting for the model, taken lowest tag first (``rules.Waiting`` orders them)."""

    def __init__(self) -> None:
        self._heap: list[tuple[Waiting, Queued]] = []
        self._order = itertools.count()
        self._snapshot: tuple[Waiting, ...] | None = ()  # ``waiting()``, kept until the queue changes
        self.by_caller: Counter[str] = Counter()  # queued images per caller
        self.by_model: Counter[str] = Counter()  # queued images per model
        self.arrived = Event()  # set when an image comes, or when a waiting collector should look again
        self.last_arrival = 0.0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, pixels: Any, deadline: float | None, admission: Admission) -> Queued:
        """Queue the request's next image with its next tag."""
        waiting = Waiting(admission.lane, admission.next_tag(), next(self._order), admission.key, admission.caller,
                          admission.model)
        item = Queued(pixels, deadline, admission, waiting)
        heapq.heappush(self._heap, (waiting, item))
        self._changed(waiting, 1)
        self.last_arrival = item.enqueued
        self.arrived.set()
        return item

    def waiting(self) -> tuple[Waiting, ...]:
        """What is queued, in no order (a ``rules.WorkerView``'s queue)."""
        if self._snapshot is None:
            self._snapshot = tuple(entry[0] for entry in self._heap)
        return self._snapshot

    def pop(self, request: int | None = None, model: str | None = None) -> Queued | None:
        """The lowest-tagged image, or that of ``request``, or of ``model``, when given."""
        if request is None and (model is None or self.by_model[model] == len(self._heap)):
            if not self._heap:
                return None
            item = heapq.heappop(self._heap)[1]
            self._changed(item.waiting, -1)
            return item
        mine = [entry for entry in self._heap if (entry[0].request == request if request is not None
                                                   else entry[0].model == model)]
        if not mine:
            return None
        entry = min(mine)
        self._keep(lambda item: item is not entry[1])
        return entry[1]

    def take(self, chosen: Iterable[Waiting]) -> list[Queued]:
        """Take the chosen images out of the queue, in tag order."""
        wanted = set(chosen)
        items = sorted((entry for entry in self._heap if entry[0] in wanted), key=lambda entry: entry[0])
        self._keep(lambda item: item.waiting not in wanted)
        return [item for _, item in items]

    def requeue(self, items: Iterable[Queued]) -> None:
        for item in items:
            heapq.heappush(self._heap, (item.waiting, item))
            self._changed(item.waiting, 1)

    def drop(self, admission: Admission) -> int:
        """Drop ``admission``'s images; how many were dropped."""
        before = len(self._heap)
        self._keep(lambda item: item.admission is not admission)
        return before - len(self._heap)

    def by(self, caller: str) -> int:
        return self.by_caller[caller]

    def wake(self) -> None:
        """Make a collector waiting for images look again."""
        self.arrived.set()

    def _keep(self, keep: Callable[[Queued], bool]) -> None:
        kept = [entry for entry in self._heap if keep(entry[1])]
        if len(kept) != len(self._heap):
            heapq.heapify(kept)
            self._heap = kept
            self._snapshot = None
            self.by_caller = Counter(entry[0].caller for entry in kept)
            self.by_model = Counter(entry[0].model for entry in kept)

    def _changed(self, waiting: Waiting, n: int) -> None:
        self._snapshot = None
        for counts, key in ((self.by_caller, waiting.caller), (self.by_model, waiting.model)):
            counts[key] += n
            if not counts[key]:
                del counts[key]


def still_due(batch: Sequence[Queued]) -> list[Queued]:
    """drop: the batch without images whose request was cancelled, or whose deadline passed (told so)."""
    now = time.monotonic()
    live = []
    for item in batch:
        if item.admission.cancelled:
            continue
        if item.deadline is not None and now >= item.deadline:
            item.result.set_exception(DeadlineExceeded(
                "the request deadline passed before this image reached the model; retry later or "
                "raise the deadline (X-Request-Timeout / GREENSERVE_REQUEST_TIMEOUT_S)"))
        else:
            live.append(item)
    return live


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
