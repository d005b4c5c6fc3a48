"""Micro-batching: images from concurrent requests are gathered into one forward on the inference thread.

Greenlets ``submit`` one image each and wait on its ``AsyncResult``; one collector greenlet takes what
is queued (up to ``max_batch``; waiting at most ``max_wait_s`` for a non-full batch), runs it on the
1-thread pool and routes rows back. The pool's single thread *is* the worker-local lock, so the hub
never waits on a real lock. A batch that raises fails its own images only; images whose deadline
passed while queued are dropped before they reach the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import gevent
import numpy as np
from gevent.event import AsyncResult, Event
from gevent.threadpool import ThreadPool

from service.engine.fair_queue import Admission, FairQueue, Queued, still_due
from service.engine.forwarding import Outcome, RunBatch, forward_stacked
from service.engine.preemption import Preemption
from service.engine.scheduling import Gather
from service.errors import InferenceFailed

log = logging.getLogger(__name__)

GATHER_GAP_S = 0.05  # with decode idle, a gathering batch goes once no image has arrived for this long
GATHER_MAX_S = 2.0  # a gathering batch goes after this long whatever comes (a bound, not a tuning)


class BatchPolicy(Protocol):
    """What the batcher asks of the worker's scheduling (``scheduling.Scheduler``)."""

    def upstream(self) -> int: ...  # admitted images still being fetched or decoded

    def gather(self) -> Gather: ...  # whether a batch whose request has images on their way waits for them

    def taken(self, tag: float) -> None: ...  # an image with this fair tag just left the queue for a batch

    def batch_cap(self, seconds_per_image: float) -> int | None: ...  # fewer per forward (callers sharing)

    def urgent(self) -> AbstractContextManager[None]: ...  # around a short forward someone waits on


@dataclass(frozen=True)
class Row:
    """One item's outputs, with how long it queued and how long its batch ran."""

    features: np.ndarray | None
    logits: np.ndarray | None
    queue_s: float
    inference_s: float
    batch_size: int


@dataclass
class BatchStats:
    """Running figures the runner uses for Retry-After and metrics."""

    batches: int = 0
    seconds_per_image: float = 0.05  # refined by an exponential average of real batches
    on_batch: Callable[[int, float], None] | None = None
    on_interjected: Callable[[int], None] | None = None  # images run inside another caller's forward

    def record(self, n: int, seconds: float) -> None:
        self.batches += 1
        per_image = seconds / max(1, n)
        self.seconds_per_image = per_image if self.batches == 1 else 0.8 * self.seconds_per_image + 0.2 * per_image
        if self.on_batch:
            self.on_batch(n, seconds)


class Batcher:
    def __init__(self, run_batch: RunBatch, pool: ThreadPool, *, max_batch: int, max_wait_s: float,
                 across_requests: bool = True, policy: BatchPolicy | None = None,
                 preemption: Preemption | None = None) -> None:
        self._run_batch = run_batch
        self._pool = pool
        # other callers' images run between the blocks of the running forward instead of after it
        # (``preemption``); a caller's own next images wait for it
        self._preemption = preemption
        self._running: list[Queued] | None = None
        self._interject_left = 0
        self._interjecting = False
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        # False: a forward only holds images of one request (with max_wait_s=0: exactly the plain lock)
        self.across_requests = across_requests
        # None (unit tests): a non-full batch waits max_wait_s for more, and never gathers
        self._policy = policy
        self._last_submit = 0.0
        self._queue = FairQueue()  # in fair order (``fair_queue``)
        self._arrived = Event()
        self._loop: gevent.Greenlet | None = None
        self.stats = BatchStats()

    def queued_before(self, tag: float) -> int:
        """Queued images tagged before ``tag``."""
        return self._queue.before(tag)

    def queued_by(self, caller: str) -> int:
        """Queued images of ``caller``'s requests."""
        return self._queue.by(caller)

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
        item = self._queue.push(pixels, deadline, admission, tag)
        self._last_submit = item.enqueued
        self._arrived.set()
        self._interject_soon()
        return item.result

    def wake(self) -> None:
        """Make a waiting collector look again (at ``upstream``, say)."""
        self._arrived.set()

    def cancel(self, admission: Admission) -> int:
        """Drop ``admission``'s queued images (a batch already running finishes); how many were dropped."""
        dropped = self._queue.drop(admission)
        if dropped:
            log.debug("dropped %d queued image(s) of a cancelled request", dropped)
        return dropped

    def _collect_forever(self) -> None:
        while True:
            batch, first_row = self._collect()
            live = still_due(batch)
            if live:
                self._run(live, urgent=first_row)

    def _collect(self) -> tuple[list[Queued], bool]:
        """The next batch, and whether it is a streamed request's first row (urgent: ``_run``)."""
        while not (head := self._queue.pop()):
            self._arrived.clear()
            self._arrived.wait()
        first = self._take(head)
        batch = [first]
        if first.admission is not None and first.admission.first_at_once():
            return batch, True  # a streamed request's first row, as soon as its image is here
        # while callers share the worker, a forward that cannot be interrupted holds one quantum of images;
        # one that can (``preemption``) stays the size that runs fastest
        preemptible = self._preemption is not None and self._preemption.points > 0
        shared = self._policy.batch_cap(self.stats.seconds_per_image) if self._policy and not preemptible else None
        cap = min(self.max_batch, shared or self.max_batch)
        until = time.monotonic() + self.max_wait_s
        gather_until = time.monotonic() + GATHER_MAX_S
        while len(batch) < cap:
            if due := self._due_while_gathering(batch, cap, gather_until):
                self._run_due(due)
                continue
            if self._overtaken(first.admission, batch[-1]):
                # another request's image is due before this one's next (an earlier request's, or another
                # caller's): it leads the next batch. Waiting on would also risk waiting for images whose
                # decode is held back behind it (``Scheduler._may_decode``)
                break
            item = self._queue.pop(first.admission if self._exclusive(first.admission) else None)
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
        return batch, False

    def _take(self, item: Queued) -> Queued:
        if self._policy is not None:
            self._policy.taken(item.rank[0])
        return item

    def _overtaken(self, leader: Admission | None, last: Queued) -> bool:
        """Whether the queue's first image is another request's, tagged no later than the batch's last."""
        head = self._queue.head()
        return head is not None and head.admission is not leader and head.rank[0] <= last.rank[0] \
            and self._exclusive(leader)

    def _exclusive(self, admission: Admission | None) -> bool:
        """Whether a batch led by ``admission``'s image may only hold that admission's images.

        Always without cross-request batching. With it, while the admission still has images on their way
        (``admission.upstream`` > 0, see ``Runner.Admission``): on a CPU an image costs the same in any batch,
        so filling the batch with a later request's images would only delay the earlier request, and
        the next batch will hold more of its images anyway. Tiny requests (nothing upstream) still
        share forwards.
        """
        return not self.across_requests or _upstream(admission) > 0

    def _run(self, batch: list[Queued], urgent: bool = False) -> None:
        """One forward. ``urgent``: a short one a person waits on (``urgency``: a streamed answer's first row,
        another caller's images while a batch gathers): decodes and reads wait until it ends."""
        started = time.monotonic()
        pixels = [it.pixels for it in batch]
        interjected = 0.0
        self._running = batch
        self._interject_left = len(batch)  # other callers get at most as many images as it has, meanwhile
        self._interject_soon()  # another caller's images already queued go at its first point
        try:
            with self._urgent(urgent):
                if self._preemption is not None:
                    self._preemption.expect()
                    outcome, interjected = self._pool.apply(self._preemption.run,
                                                            (forward_stacked, self._run_batch, pixels))
                else:
                    outcome = self._pool.apply(forward_stacked, (self._run_batch, pixels))
        finally:
            self._running = None
        self._deliver(batch, outcome, started, time.monotonic() - started - interjected)

    def _deliver(self, batch: list[Queued], outcome: list[Outcome] | BaseException, started: float,
                 seconds: float) -> None:
        if isinstance(outcome, BaseException):  # the model raised: fail these images, keep serving
            log.error("inference failed on a batch of %d image(s)", len(batch), exc_info=outcome)
            err = InferenceFailed(f"the model failed on a batch of {len(batch)} image(s) "
                                  f"({type(outcome).__name__}); the request can be retried")
            for item in batch:
                item.result.set_exception(err)
            return
        log.debug("batch of %d image(s) in %.3fs", len(batch), seconds)
        self.stats.record(len(batch), seconds)
        for item, row in zip(batch, outcome, strict=True):
            if isinstance(row, Exception):
                item.result.set_exception(row)
            else:
                item.result.set(Row(row[0], row[1], started - item.enqueued, seconds, len(batch)))

    @contextmanager
    def _urgent(self, urgent: bool) -> Iterator[None]:
        if not urgent or self._policy is None:
            yield
            return
        with self._policy.urgent():
            yield
        # reads and decodes were held, so nothing could arrive: a gathering batch's gap starts now (else the
        # album's next batch went with the 2 images decoded before the hold, as if its fetches were behind)
        self._last_submit = time.monotonic()

    # ------------------------------------------------------------------ interjections

    def _interject_soon(self) -> None:
        if (self._preemption is not None and self._running is not None and len(self._running) > 1
                and self._interject_left > 0 and not self._interjecting
                and self._queue.has_others(self._running)):
            self._interjecting = True
            gevent.spawn(self._interject)

    def _due(self, batch: list[Queued], most: int) -> list[Queued]:
        """Up to ``most`` queued images of callers with no image in ``batch`` (running or gathering): they
        should not wait for all of it. A caller's own next request waits: its images would cut the caller's
        own batch into small forwards."""
        return self._queue.others(batch, most)

    def _due_while_gathering(self, batch: list[Queued], most: int, until: float) -> list[Queued]:
        """Other callers' images while ``batch`` waits for its own request's (``_due``): the model is idle,
        they run now, until GATHER_MAX_S. Only requests with all their images here (a one-photo call): another
        album still decoding gathers its own batch rather than run a photo at a time."""
        if self._preemption is None or _upstream(batch[0].admission) <= 0 or time.monotonic() >= until:
            return []
        return [item for item in self._due(batch, most) if _upstream(item.admission) <= 0]

    def _unqueue(self, items: list[Queued]) -> list[Queued]:
        """Take ``items`` out of the queue; those still worth a forward."""
        self._queue.remove(items)
        return still_due(items)

    def _run_due(self, due: list[Queued]) -> None:
        live = self._unqueue(due)
        for item in live:
            self._take(item)
        if live:
            self._run(live, urgent=True)

    def _interject(self) -> None:
        """Offer the images due (``_due``) to the running forward, as one short forward of their own, until
        none is due or the forward ends (then they lead the next batch as usual)."""
        assert self._preemption is not None
        try:
            while self._running is not None and (due := self._due(self._running, self._interject_left)):
                live = self._unqueue(due)
                if not live:
                    continue
                job = self._preemption.offer(forward_stacked, self._run_batch, [it.pixels for it in live])
                if job is None:  # the forward ended meanwhile: they lead the next batch
                    self._queue.requeue(live)
                    return
                self._interject_left -= len(live)
                if self.stats.on_interjected:
                    self.stats.on_interjected(len(live))
                for item in live:
                    self._take(item)
                # its inference time counts from the offer: it waits for the running forward's next point
                started = time.monotonic()
                with self._urgent(True):
                    outcome = job.get()
                self._deliver(live, outcome, started, time.monotonic() - started)
        finally:
            self._interjecting = False


def _upstream(admission: Admission | None) -> int:
    return admission.upstream if admission is not None else 0
