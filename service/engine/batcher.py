"""Micro-batching: images from concurrent requests are gathered into one forward on the inference thread.

Greenlets ``submit`` one image each and wait on its ``AsyncResult``; one collector greenlet takes what
is queued (up to ``max_batch``; waiting at most ``max_wait_s`` for a non-full batch), runs it on the
1-thread pool and routes rows back. The pool's single thread *is* the worker-local lock, so the hub
never waits on a real lock. A batch that raises fails its own images only; images whose deadline
passed while queued are dropped before they reach the model.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import gevent
import numpy as np
from gevent.event import AsyncResult, Event
from gevent.threadpool import ThreadPool

from service.engine.scheduling import Gather
from service.errors import DeadlineExceeded, InferenceFailed, OutOfMemory

log = logging.getLogger(__name__)

# Forward function: a stacked batch (uint8 (N, H, W, 3) crops, or (N, context) token ids) → (features or
# None, logits or None) with row i for item i, or ``Outputs`` when some items got no row.
RunBatch = Callable[[Any], "tuple[Any, Any] | Outputs"]
GATHER_GAP_S = 0.05  # with decode idle, a gathering batch goes once no image has arrived for this long
GATHER_MAX_S = 2.0  # a gathering batch goes after this long whatever comes (a bound, not a tuning)


class Admission(Protocol):
    """What the batcher reads of the request an image belongs to (``scheduling.Admission``)."""

    @property
    def upstream(self) -> int: ...  # the request's images still being fetched or decoded

    @property
    def cancelled(self) -> bool: ...  # the request ended: its images are not worth a forward

    def first_at_once(self) -> bool: ...  # once, for a streamed request: its first batch goes with one image


class BatchPolicy(Protocol):
    """What the batcher asks of the worker's scheduling (``scheduling.Scheduler``)."""

    def upstream(self) -> int: ...  # admitted images still being fetched or decoded

    def gather(self) -> Gather: ...  # whether a batch whose request has images on their way waits for them

    def taken(self, tag: float) -> None: ...  # an image with this fair tag just left the queue for a batch

    def batch_cap(self, seconds_per_image: float) -> int | None: ...  # fewer per forward (callers sharing)


@dataclass(frozen=True)
class Row:
    """One item's outputs, with how long it queued and how long its batch ran."""

    features: np.ndarray | None
    logits: np.ndarray | None
    queue_s: float
    inference_s: float
    batch_size: int


@dataclass(frozen=True)
class Outputs:
    """A forward's rows (row i for item i) and the items that got none, each with its reason."""

    features: np.ndarray | None
    logits: np.ndarray | None
    failed: dict[int, Exception] = field(default_factory=dict)


# One item's outcome from the inference thread: its (features row, logits row), or why it has none
_Outcome = tuple[np.ndarray | None, np.ndarray | None] | Exception


@dataclass
class _Item:
    pixels: Any  # a crop (H, W, 3), token ids, or a JPEG for the device (``types.EncodedJpeg``)
    deadline: float | None
    admission: Admission | None = None
    rank: tuple[float, int] = (0.0, 0)  # (the image's fair tag, its submission order)
    result: AsyncResult = field(default_factory=AsyncResult)
    enqueued: float = field(default_factory=time.monotonic)


@dataclass
class BatchStats:
    """Running figures the runner uses for Retry-After and metrics."""

    batches: int = 0
    seconds_per_image: float = 0.05  # refined by an exponential average of real batches
    on_batch: Callable[[int, float], None] | None = None

    def record(self, n: int, seconds: float) -> None:
        self.batches += 1
        per_image = seconds / max(1, n)
        self.seconds_per_image = per_image if self.batches == 1 else 0.8 * self.seconds_per_image + 0.2 * per_image
        if self.on_batch:
            self.on_batch(n, seconds)


class Batcher:
    def __init__(self, run_batch: RunBatch, pool: ThreadPool, *, max_batch: int, max_wait_s: float,
                 across_requests: bool = True, policy: BatchPolicy | None = None) -> None:
        self._run_batch = run_batch
        self._pool = pool
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        # False: a forward only holds images of one request (with max_wait_s=0: exactly the plain lock)
        self.across_requests = across_requests
        # None (unit tests): a non-full batch waits max_wait_s for more, and never gathers
        self._policy = policy
        self._last_submit = 0.0
        # Images are served in their fair tags' order (``fairness.FairTags``), not the order their bytes
        # did: concurrent requests' images arrive interleaved (fetches overlap), and serving them in that
        # order would share the model between all requests (every one finishes near the end). A caller's
        # requests are tagged one after the other, so its first request finishes first, as a FIFO queue
        # would; another caller's images are tagged between them.
        self._items: list[tuple[tuple[float, int], _Item]] = []
        self._order = itertools.count()
        self._arrived = Event()
        self._loop: gevent.Greenlet | None = None
        self.stats = BatchStats()

    def queued_before(self, tag: float) -> int:
        """Queued images tagged before ``tag``."""
        return sum(1 for rank, _ in self._items if rank[0] < tag)

    def start(self) -> None:
        if self._loop is None:
            self._loop = gevent.spawn(self._collect_forever)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.kill()
            self._loop = None

    def submit(self, pixels: Any, deadline: float | None = None, admission: Admission | None = None,
               tag: float | None = None) -> AsyncResult:
        """Queue one image of request ``admission`` with its fair ``tag`` (lower first; the time now if not
        given); ``.get()`` the result to wait for its ``Row``."""
        rank = (time.monotonic() if tag is None else tag, next(self._order))
        item = _Item(pixels, deadline, admission, rank)
        heapq.heappush(self._items, (rank, item))
        self._last_submit = item.enqueued
        self._arrived.set()
        return item.result

    def wake(self) -> None:
        """Make a waiting collector look again (at ``upstream``, say)."""
        self._arrived.set()

    def cancel(self, admission: Admission) -> int:
        """Drop ``admission``'s queued images (a batch already running finishes); how many were dropped."""
        kept = [entry for entry in self._items if entry[1].admission is not admission]
        dropped = len(self._items) - len(kept)
        if dropped:
            heapq.heapify(kept)
            self._items = kept
            log.debug("dropped %d queued image(s) of a cancelled request", dropped)
        return dropped

    def _collect_forever(self) -> None:
        while True:
            batch = self._collect()
            live = self._drop_expired(batch)
            if live:
                self._run(live)

    def _collect(self) -> list[_Item]:
        while not self._items:
            self._arrived.clear()
            self._arrived.wait()
        first = self._take(heapq.heappop(self._items)[1])
        batch = [first]
        if first.admission is not None and first.admission.first_at_once():
            return batch  # a streamed request's first row, as soon as its image is here
        shared = self._policy.batch_cap(self.stats.seconds_per_image) if self._policy else None
        cap = min(self.max_batch, shared or self.max_batch)
        until = time.monotonic() + self.max_wait_s
        gather_until = time.monotonic() + GATHER_MAX_S
        while len(batch) < cap:
            if self._overtaken(first.admission, batch[-1]):
                # another request's image is due before this one's next (an earlier request's, or another
                # caller's): it leads the next batch. Waiting on would also risk waiting for images whose
                # decode is held back behind it (``Scheduler._may_decode``)
                break
            item = self._pop(first.admission if self._exclusive(first.admission) else None)
            if item is not None:
                batch.append(self._take(item))
                continue
            if self._policy is not None and self._policy.upstream() <= 0:
                break
            now = time.monotonic()
            remaining = until - now
            if self._policy is not None and _upstream(first.admission) > 0:
                gather = self._policy.gather()
                if gather is Gather.WHILE_DECODING:  # its next image is being decoded: wait for it
                    remaining = max(remaining, GATHER_GAP_S)
                elif gather is Gather.BRIDGE_GAPS:  # decode idle for now (the fetch is behind)
                    remaining = max(remaining, self._last_submit + GATHER_GAP_S - now)
                remaining = min(remaining, max(until, gather_until) - now)
            if remaining <= 0:
                break
            self._arrived.clear()
            self._arrived.wait(remaining)
        return batch

    def _take(self, item: _Item) -> _Item:
        if self._policy is not None:
            self._policy.taken(item.rank[0])
        return item

    def _overtaken(self, leader: Admission | None, last: _Item) -> bool:
        """Whether the queue's first image is another request's, tagged no later than the batch's last."""
        if not self._items:
            return False
        tag, head = self._items[0][0][0], self._items[0][1]
        return head.admission is not leader and tag <= last.rank[0] and self._exclusive(leader)

    def _exclusive(self, admission: Admission | None) -> bool:
        """Whether a batch led by ``admission``'s image may only hold that admission's images.

        Always without cross-request batching. With it, while the admission still has images on their way
        (``admission.upstream`` > 0, see ``Runner.Admission``): on a CPU an image costs the same in any batch,
        so filling the batch with a later request's images would only delay the earlier request, and
        the next batch will hold more of its images anyway. Tiny requests (nothing upstream) still
        share forwards.
        """
        return not self.across_requests or _upstream(admission) > 0

    def _pop(self, admission: Admission | None) -> _Item | None:
        """The next image by rank, or (``admission`` given) the next of that admission's."""
        if admission is None:
            return heapq.heappop(self._items)[1] if self._items else None
        for i, (_, item) in enumerate(self._items):
            if item.admission is admission:
                self._items[i] = self._items[-1]
                self._items.pop()
                heapq.heapify(self._items)
                return item
        return None

    @staticmethod
    def _drop_expired(batch: Sequence[_Item]) -> list[_Item]:
        """The batch without images whose request was cancelled while it gathered, or whose deadline passed."""
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

    def _run(self, batch: list[_Item]) -> None:
        started = time.monotonic()
        outcome = self._pool.apply(_forward_stacked, (self._run_batch, [it.pixels for it in batch]))
        if isinstance(outcome, BaseException):  # the model raised: fail these images, keep serving
            log.error("inference failed on a batch of %d image(s)", len(batch), exc_info=outcome)
            err = InferenceFailed(f"the model failed on a batch of {len(batch)} image(s) "
                                  f"({type(outcome).__name__}); the request can be retried")
            for item in batch:
                item.result.set_exception(err)
            return
        seconds = time.monotonic() - started
        log.debug("batch of %d image(s) in %.3fs", len(batch), seconds)
        self.stats.record(len(batch), seconds)
        for item, row in zip(batch, outcome, strict=True):
            if isinstance(row, Exception):
                item.result.set_exception(row)
            else:
                item.result.set(Row(row[0], row[1], started - item.enqueued, seconds, len(batch)))


def _upstream(admission: Admission | None) -> int:
    return admission.upstream if admission is not None else 0


def _stacked(items: list[Any]) -> Any:
    """Crops or token ids stacked into one array; a batch holding JPEGs for the device stays a list
    (``LoadedModel.forward_items``)."""
    return np.stack(items) if all(isinstance(item, np.ndarray) for item in items) else items


def _forward_stacked(run_batch: RunBatch, pixels: list[Any]) -> list[_Outcome] | Exception:
    """In the inference thread: stack, forward, hand back each item's numpy rows, or the model's exception
    (which the collector logs once; raising here would make gevent print it as a crashed task too).

    A batch that runs out of device memory is split and its halves retried, down to single items; an
    item that does not fit alone gets the ``OutOfMemory`` (503 + Retry-After) and the rest their rows."""
    try:
        out = run_batch(_stacked(pixels))
    except OutOfMemory as exc:
        if len(pixels) == 1:
            log.warning("out of memory on a single item: %s", exc)
            return [exc]
        half = len(pixels) // 2
        log.warning("out of memory on a batch of %d: retrying it as %d + %d", len(pixels), half, len(pixels) - half)
        first, second = _forward_stacked(run_batch, pixels[:half]), _forward_stacked(run_batch, pixels[half:])
        if isinstance(first, Exception) or isinstance(second, Exception):
            return first if isinstance(first, Exception) else second
        return first + second
    except Exception as exc:
        return exc
    if not isinstance(out, Outputs):
        out = Outputs(*out)
    feats = None if out.features is None else np.asarray(out.features)
    logits = None if out.logits is None else np.asarray(out.logits)
    return [out.failed[i] if i in out.failed else (None if feats is None else feats[i], None if logits is None else logits[i])
            for i in range(len(pixels))]
