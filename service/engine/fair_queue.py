"""The batcher's queue: images waiting for the model, in their fair tags' order.

Images are served in their fair tags' order (``fairness.FairTags``), not the order their bytes did:
concurrent requests' images arrive interleaved (fetches overlap), and serving them in that order would share
the model between all requests (every one finishes near the end). A caller's requests are tagged one after
the other, so its first request finishes first, as a FIFO queue would; another caller's images are tagged
between them.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gevent.event import AsyncResult

from service.errors import DeadlineExceeded


class Admission(Protocol):
    """What the batcher reads of the request an image belongs to (``scheduling.Admission``)."""

    @property
    def upstream(self) -> int: ...  # the request's images still being fetched or decoded

    @property
    def caller(self) -> str: ...  # who sent it (``fairness``): its images may run inside another's forward

    @property
    def cancelled(self) -> bool: ...  # the request ended: its images are not worth a forward

    def first_at_once(self) -> bool: ...  # once, for a streamed request: its first batch goes with one image


@dataclass
class Queued:
    """One image on its way to a forward; its row (or error) is set on ``result``."""

    pixels: Any  # a crop (H, W, 3), token ids, or a JPEG for the device (``types.EncodedJpeg``)
    deadline: float | None
    admission: Admission | None = None
    rank: tuple[float, int] = (0.0, 0)  # (the image's fair tag, its submission order)
    result: AsyncResult = field(default_factory=AsyncResult)
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def caller(self) -> str:
        return self.admission.caller if self.admission is not None else ""


class FairQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[float, int], Queued]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, pixels: Any, deadline: float | None, admission: Admission | None, tag: float | None) -> Queued:
        """Queue an image with its fair ``tag`` (lower first; the time now if not given)."""
        rank = (time.monotonic() if tag is None else tag, next(self._order))
        item = Queued(pixels, deadline, admission, rank)
        heapq.heappush(self._heap, (rank, item))
        return item

    def requeue(self, items: Iterable[Queued]) -> None:
        for item in items:
            heapq.heappush(self._heap, (item.rank, item))

    def head(self) -> Queued | None:
        return self._heap[0][1] if self._heap else None

    def pop(self, admission: Admission | None = None) -> Queued | None:
        """The next image by rank, or (``admission`` given) the next of that admission's."""
        if admission is None:
            return heapq.heappop(self._heap)[1] if self._heap else None
        for i, (_, item) in enumerate(self._heap):
            if item.admission is admission:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return item
        return None

    def before(self, tag: float) -> int:
        """Queued images tagged before ``tag``."""
        return sum(1 for rank, _ in self._heap if rank[0] < tag)

    def by(self, caller: str) -> int:
        """Queued images of ``caller``'s requests."""
        return sum(1 for _, item in self._heap if item.admission is not None and item.caller == caller)

    def has_others(self, batch: Iterable[Queued]) -> bool:
        """Whether an image of a caller with no image in ``batch`` is queued (``others``, without the sort)."""
        return next(self._of_others(batch), None) is not None

    def others(self, batch: Iterable[Queued], most: int) -> list[Queued]:
        """Up to ``most`` queued images, in fair order, of callers with no image in ``batch``."""
        if most <= 0:
            return []
        return [item for _, item in sorted(self._of_others(batch))][:most]

    def _of_others(self, batch: Iterable[Queued]) -> Iterator[tuple[tuple[float, int], Queued]]:
        """The queue's entries, in no order, of callers with no image in ``batch``."""
        callers = {item.caller for item in batch}
        return (entry for entry in self._heap if entry[1].admission is not None and entry[1].caller not in callers)

    def remove(self, items: Iterable[Queued]) -> None:
        chosen = {id(item) for item in items}
        self._keep(lambda item: id(item) not in chosen)

    def drop(self, admission: Admission) -> int:
        """Drop ``admission``'s images; how many were dropped."""
        before = len(self._heap)
        self._keep(lambda item: item.admission is not admission)
        return before - len(self._heap)

    def _keep(self, keep: Callable[[Queued], bool]) -> None:
        kept = [entry for entry in self._heap if keep(entry[1])]
        if len(kept) != len(self._heap):
            heapq.heapify(kept)
            self._heap = kept


def still_due(batch: Sequence[Queued]) -> list[Queued]:
    """The batch without images whose request was cancelled while it gathered, or whose deadline passed
    (told so)."""
    now = time.monotonic()
    live = []
    for item in batch:
        if item.admission is not None and item.admission.cancelled:
            continue
        if item.deadline is not None and now >= item.deadline:
            item.result.set_exception(DeadlineExceeded(
                "the request deadline passed before this image reached the model; retry later or "
                "raise the deadline (X-Request-Timeout / GREENSERVE_REQUEST_TIMEOUT_S)"))
        else:
            live.append(item)
    return live
