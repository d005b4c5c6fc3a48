"""Fair request-order scheduling: a worker serves each caller's requests first come, first served, and
interleaves callers image by image, at every stage.

    admit    a request reserves its images of the worker's queue (GREENSERVE_MAX_QUEUE_IMAGES), or is
             refused with 503 + Retry-After before any work; a caller over its own share of the queue
             (GREENSERVE_MAX_CALLER_IMAGES) is refused with 429 + Retry-After
    order    each image gets a tag (``fairness.FairTags``, start-time fair queueing over images): a caller's
             requests follow each other, and a caller with nothing queued starts at the image now being
             taken, so its first image goes next whatever another caller has queued
    fetch    a request starts fetching once the requests tagged before it have at most
             GREENSERVE_FETCH_CONCURRENCY images still to fetch or decode (``wait_to_fetch``)
    decode   decode slots go in tag order; a later image waits while the model already has as many images
             tagged before it queued as there are decode threads
    batch    a batch led by a request that still has images on their way holds only that request's
             images, and ends when another caller's image tagged before its next one is queued; while
             the forward runs on every core it keeps gathering them (``gather``)

Served in the order their bytes arrive, concurrent requests would share the cores and all finish late
together; in order the first finishes first, as a queue of requests would. Callers interleaved, one caller
with a 1,000-photo backfill does not hold back another's one photo. The figures are in docs/SCHEDULING.md.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Iterator
from typing import Protocol

from gevent.event import Event

from service import metrics
from service.engine.fairness import Callers
from service.engine.slots import Rank, RankedSlots
from service.engine.urgency import Urgency
from service.errors import Overloaded
from service.settings import Settings

FIRST: Rank = (float("-inf"), 0)  # unranked work (a big JSON body) and a caller's first image: before any image
NOT_READY_RETRY_S = 5


class Gather(enum.Enum):
    """What a batch whose request still has images on their way does (see ``Scheduler.gather``)."""

    NO = "no"  # go with what is there
    BRIDGE_GAPS = "bridge_gaps"  # wait across short gaps between arrivals (decode idle, fetches behind)
    WHILE_DECODING = "while_decoding"  # wait: the next image is being decoded


class Queue(Protocol):
    """What the scheduler reads of the batcher."""

    def queued_before(self, arrived: float) -> int: ...

    def queued_by(self, caller: str) -> int: ...

    def wake(self) -> None: ...

    def cancel(self, group: Admission) -> int: ...


class CorePlan(Protocol):
    """Whether the next forward runs on every core (``cores.CorePlan``)."""

    def all_cores(self) -> bool: ...


class Admission:
    """One admitted request's place: when it arrived, its fair start tag, its caller, how many of its
    images are still on their way (being fetched or decoded), and whether it ended early."""

    __slots__ = ("arrived", "start", "caller", "upstream", "cancelled", "streamed", "_submitted", "_scheduler")

    def __init__(self, scheduler: Scheduler, upstream: int, arrived: float, start: float = 0.0,
                 caller: str = "") -> None:
        self._scheduler = scheduler
        self.arrived = arrived
        self.start = start
        self.caller = caller
        self.upstream = upstream
        self.cancelled = False
        self.streamed = False  # its answer is streamed: its first row should not wait for a gathered batch
        self._submitted = 0

    def first_at_once(self) -> bool:
        """True once for a streamed request, when its first batch forms: that batch goes with one image."""
        if not self.streamed:
            return False
        self.streamed = False
        return True

    @contextlib.contextmanager
    def image(self) -> Iterator[None]:
        """One image's way to the batcher: on leaving, it reached the batcher or failed, once."""
        try:
            yield
        finally:
            self.upstream -= 1
            self._scheduler.settle(1)

    def rank(self, index: int) -> Rank:
        """Image ``index``'s place for a decode slot."""
        return (self.start + index, index)

    def next_tag(self) -> float:
        """The tag of the request's next image to reach the batcher (in the order they come)."""
        self._submitted += 1
        return self.start + self._submitted - 1

    def upstream_before(self, tag: float) -> int:
        """Of its images still on their way, about how many are tagged before ``tag`` (they come roughly in
        index order, each tagged as it reaches the batcher)."""
        return max(0, min(self.upstream, int(tag - (self.start + self._submitted))))


class Scheduler:
    def __init__(self, settings: Settings, decode_threads: int, cores: CorePlan) -> None:
        self._max_queue = settings.max_queue_images
        self._callers = Callers(settings)
        self._fetch_ahead = settings.fetch_concurrency
        self._decode_threads = decode_threads
        self._cores = cores
        self._queue: Queue | None = None
        self._admitted = 0
        self._upstream = 0  # admitted images not yet at the batcher
        self._admissions: list[Admission] = []  # in arrival order
        self._settling = Event()  # set (and replaced) whenever images settle or a request ends
        self._decode = RankedSlots(decode_threads, ready=self._may_decode)
        self._decoding = 0  # tasks waiting for or holding a decode slot
        self._decoding_by: dict[str, int] = {}  # images decoding or waiting to, per caller
        self._spare_busy = False  # the spare decode thread (``decode_slot``)
        self.urgency = Urgency()  # a short forward someone waits on runs now (``urgent``)

    def watch(self, queue: Queue) -> None:
        self._queue = queue

    # ------------------------------------------------------------------ admit

    @contextlib.contextmanager
    def admit(self, n_images: int, *, coming: int | None = None, arrived: float | None = None, caller: str = "",
              ready: bool = True, seconds_per_image: float = 0.05) -> Iterator[Admission]:
        """Reserve ``n_images`` (of which ``coming`` will travel to the batcher; default all) for ``caller``,
        or refuse with 503 (the worker is full) or 429 (the caller is over its share). A request that
        ends with an exception has its queued images dropped."""
        self._refuse_beyond(n_images, ready, seconds_per_image)
        start = self._callers.admit(caller, n_images, seconds_per_image)  # or 429: over its share
        coming = n_images if coming is None else coming
        admission = Admission(self, coming, time.monotonic() if arrived is None else arrived, start, caller)
        self._admitted += n_images
        self._upstream += coming
        self._admissions.append(admission)
        metrics.QUEUE_IMAGES.inc(n_images)
        try:
            yield admission
        except BaseException:
            admission.cancelled = True  # failed, timed out or its client left
            if self._queue is not None:
                self._queue.cancel(admission)
            raise
        finally:
            self._admitted -= n_images
            self._callers.release(caller, n_images)
            self._admissions.remove(admission)
            self.settle(admission.upstream)  # images that never came (killed on the way)
            admission.upstream = 0
            metrics.QUEUE_IMAGES.dec(n_images)

    def batch_cap(self, seconds_per_image: float) -> int | None:
        """Fewer images per forward while callers share the worker (``Callers.batch_cap``)."""
        return self._callers.batch_cap(seconds_per_image)

    def _refuse_beyond(self, n_images: int, ready: bool, seconds_per_image: float) -> None:
        """503 while loading or with the worker full. Alone, a request bigger than the bound is admitted: it
        could never run otherwise."""
        if not ready:
            metrics.OVERLOADED.labels("not_ready").inc()
            raise Overloaded("the model is still loading on this worker; retry shortly",
                             retry_after_s=NOT_READY_RETRY_S, code="not_ready")
        if self._admitted and self._admitted + n_images > self._max_queue:
            metrics.OVERLOADED.labels("queue_full").inc()
            wait = self._admitted * seconds_per_image
            raise Overloaded(f"this worker has {self._admitted} image(s) queued or running (limit "
                             f"{self._max_queue}); retry after ~{wait:.1f}s or spread load over more "
                             "workers/replicas", retry_after_s=wait)

    def settle(self, n: int) -> None:
        """``n`` admitted images reached the batcher or failed on the way."""
        self._upstream -= n
        if n and not self._upstream and self._queue is not None:
            self._queue.wake()  # a batch waiting for more images need not wait any longer
        settling, self._settling = self._settling, Event()
        settling.set()

    # ------------------------------------------------------------------ fetch

    def wait_to_fetch(self, admission: Admission) -> None:
        """Until earlier requests have at most ``fetch_concurrency`` images still on their way. Fetching
        every queued request's images at once held all their bytes (8 albums: 733 MB) and kept the hub
        reading when it should answer; starting just before they are needed hides the hosts' latency.
        A caller's only request, if small (at most ``fetch_concurrency`` images), never waits: its bytes are
        few, and a one-photo call tagged just after another caller's albums waited for them (~300 ms)."""
        if admission.upstream <= self._fetch_ahead and not any(
                a.caller == admission.caller for a in self._admissions if a is not admission):
            return
        while sum(a.upstream_before(admission.start) for a in self._admissions
                  if a is not admission) > self._fetch_ahead:
            self._settling.wait()

    # ------------------------------------------------------------------ decode

    @contextlib.contextmanager
    def decode_slot(self, rank: Rank | None, caller: str = "") -> Iterator[bool]:
        """A decode thread's turn, in rank order (unranked work, such as a big JSON body, first).

        A caller with nothing of its own decoding (or waiting to) or queued for the model (a one-photo call, an
        album's first image) goes first and is never held back (``_may_decode``), and when every decode thread is busy
        it takes the spare one (yields True) rather than wait. Beside an album, a one-photo caller's image
        was tagged just after two of the album's and waited for them to be batched (up to a whole forward),
        then for a decode thread busy with a 12 MP photo while the forward took the cores."""
        first = bool(caller) and not self._decoding_by.get(caller) and not (
            self._queue is not None and self._queue.queued_by(caller))
        if first or rank is None:
            rank = FIRST
        spare = first and not self._spare_busy and not self._decode.free()
        self._decoding += 1
        self._spare_busy |= spare
        try:
            with self._holding(caller), contextlib.nullcontext() if spare else self._decode.take(rank):
                yield spare
        finally:
            self._decoding -= 1
            if spare:
                self._spare_busy = False

    @contextlib.contextmanager
    def _holding(self, caller: str) -> Iterator[None]:
        self._decoding_by[caller] = self._decoding_by.get(caller, 0) + 1
        try:
            yield
        finally:
            left = self._decoding_by.pop(caller) - 1
            if left:
                self._decoding_by[caller] = left

    def _may_decode(self, rank: Rank) -> bool:
        """Not while the model already has ``decode_threads`` images of earlier requests queued: decoding
        sooner would only take the cores from their forwards. The earliest request never waits, but for an
        urgent forward (``urgent``); a caller's first image never does."""
        if self.urgency.active and rank != FIRST:
            return False
        return self._queue is None or self._queue.queued_before(rank[0]) < self._decode_threads

    # ------------------------------------------------------------------ batch (what the batcher asks)

    def upstream(self) -> int:
        """Admitted images still being fetched or decoded: with none, a batch need not wait."""
        return self._upstream

    def admitted(self) -> int:
        """Images admitted (queued or running) on this worker."""
        return self._admitted

    def gather(self) -> Gather:
        """Only while the forward runs on every core (a lone worker): then small forwards started while
        decode runs would stall it and be stalled (torch's threads wait for each other every layer)."""
        if not self._cores.all_cores():
            return Gather.NO
        return Gather.WHILE_DECODING if self._decoding else Gather.BRIDGE_GAPS

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """Around a short forward someone waits on (``urgency``): no decode starts and no fetched body is
        read meanwhile. Only when the forward runs on every core: else cores are left to the rest."""
        if not self._cores.all_cores():
            yield
            return
        self.urgency.begin()
        try:
            yield
        finally:
            self.urgency.end()
            self._decode.recheck()

    def first_decode(self) -> contextlib.AbstractContextManager[None]:
        """Around a streamed answer's first image's decode: the hub reads no fetched body meanwhile
        (``urgency``), on every core only, as ``urgent``."""
        return self.urgency.reads_held() if self._cores.all_cores() else contextlib.nullcontext()

    def taken(self, tag: float) -> None:
        """An image tagged ``tag`` left the batcher's queue for a batch: fair time moves on to it, and a
        held-back decode may go now."""
        self._callers.taken(tag)
        self._decode.recheck()
