"""The worker's scheduling state, and the mechanism that carries out ``rules``' decisions.

``Scheduler`` holds what the rules read (the admitted requests, the callers, the two queues for the model,
the decode threads, the urgent holds), builds a ``rules.WorkerView`` of it for each decision and does what
the decision says. It decides nothing itself. The batchers take their queue and their ``BatchRules`` from it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from gevent.event import Event

from service import metrics
from service.engine.scheduling import rules
from service.engine.scheduling.admission import Admission, Callers
from service.engine.scheduling.order import FairQueue, Queued, RankedSlots
from service.engine.scheduling.urgency import Urgency
from service.engine.scheduling.view import BatchPlan, CallerView, Forming, Limits, Run, Verdict, WorkerView
from service.errors import Overloaded, OverShare

NOT_READY_RETRY_S = 5


@dataclass(frozen=True)
class Signals:
    """What the worker's other parts tell the rules: whether the next forward has every core
    (``cores.CorePlan``), the measured time per image (``forwarding.BatchStats``), whether a running
    forward can be interrupted (``preemption.Preemption``), and each model's image forward's cost per image by
    batch size (its precision trial's, ``TowerChoice.per_image_ms``)."""

    all_cores: Callable[[], bool] = lambda: True
    seconds_per_image: Callable[[], float] = lambda: 0.05
    preemptible: Callable[[], bool] = lambda: False
    image_costs: Callable[[], Mapping[str, Mapping[int, float]]] = dict


@dataclass(frozen=True)
class BatchRules:
    """What a batcher asks while it forms and runs batches (``batcher.Batcher``)."""

    plan: Callable[[Forming], BatchPlan]
    interjection: Callable[[Forming, int], Run]
    taken: Callable[[Sequence[Queued]], None]
    urgent: Callable[[], contextlib.AbstractContextManager[None]]


class Scheduler:
    def __init__(self, limits: Limits, signals: Signals) -> None:
        self.limits = limits
        self._signals = signals
        self.images = FairQueue()  # images waiting for the model
        self.texts = FairQueue()  # texts waiting for the model: their own batches
        self.urgency = Urgency()
        self._callers = Callers()
        self._requests: dict[int, Admission] = {}
        self._admitted = 0
        self._upstream = 0  # admitted images not yet at the batcher
        self._settling = Event()  # set (and replaced) whenever images settle or a request ends
        self._decode = RankedSlots(limits.decode_threads, ready=lambda rank: rules.may_decode(self.view(), rank))
        self._decoding_by: dict[str, int] = {}  # images decoding or waiting to, per caller
        self._spare_busy = False
        self.texts_coming = 0  # texts being tokenised

    def view(self) -> WorkerView:
        """The worker now, as the rules read it."""
        queue, queued = self.images.waiting(), self.images.by_caller
        callers = {caller: CallerView(self._callers.admitted.get(caller, 0), self._decoding_by.get(caller, 0),
                                      queued.get(caller, 0))
                   for caller in {*self._callers.admitted, *self._decoding_by, *queued}}
        return WorkerView(
            now=time.monotonic(), limits=self.limits, admitted=self._admitted, upstream=self._upstream,
            requests={k: a.view() for k, a in self._requests.items()}, callers=callers,
            recent=dict(self._callers.seen), queue=queue, decoding=sum(self._decoding_by.values()),
            decode_free=self._decode.free(), spare_busy=self._spare_busy, all_cores=self._signals.all_cores(),
            urgent=self.urgency.active, last_arrival=self.images.last_arrival, urgent_ended=self.urgency.ended,
            seconds_per_image=self._signals.seconds_per_image(), preemptible=self._signals.preemptible(),
            texts_coming=self.texts_coming, image_costs=self._signals.image_costs())

    # ------------------------------------------------------------------ admit

    @contextlib.contextmanager
    def admit(self, n_images: int, *, coming: int | None = None, arrived: float | None = None, caller: str = "",
              ready: bool = True, streamed: bool = False, model: str = "", lane: int = 0) -> Iterator[Admission]:
        """Reserve ``n_images`` (of which ``coming`` will travel to the batcher; default all) for ``caller``,
        or refuse (``rules.admission``). A request that ends with an exception has its queued images dropped."""
        self._refuse(rules.admission(self.view(), caller, n_images, ready), caller)
        now = time.monotonic()
        coming = n_images if coming is None else coming
        start = self._callers.admit(caller, n_images, now)
        admission = Admission(coming, now if arrived is None else arrived, start, caller, streamed=streamed,
                              model=model, lane=lane, settled=self.settle)
        self._admitted += n_images
        self._upstream += coming
        self._requests[admission.key] = admission
        metrics.QUEUE_IMAGES.inc(n_images)
        metrics.CALLERS_TRACKED.set(self._callers.tracked())
        try:
            yield admission
        except BaseException:
            admission.cancelled = True  # failed, timed out or its client left
            self.images.drop(admission)
            self.texts.drop(admission)
            raise
        finally:
            self._admitted -= n_images
            self._callers.release(caller, n_images)
            del self._requests[admission.key]
            self.settle(admission.upstream)  # images that never came (killed on the way)
            admission.upstream = 0
            metrics.QUEUE_IMAGES.dec(n_images)
            metrics.CALLERS_TRACKED.set(self._callers.tracked())

    def _refuse(self, verdict: Verdict, caller: str) -> None:
        """The error for a refusal, with when to retry (the images ahead × the measured time per image)."""
        if verdict is Verdict.ADMIT:
            return
        per_image = self._signals.seconds_per_image()
        if verdict is Verdict.OVER_SHARE:
            metrics.OVER_SHARE.inc()
            mine = self._callers.admitted.get(caller, 0)
            raise OverShare(f"this caller has {mine} image(s) queued or running on this worker (its share: "
                            f"{self.limits.share}); retry after ~{mine * per_image:.1f}s or send fewer images at a "
                            "time", retry_after_s=mine * per_image)
        if verdict is Verdict.NOT_READY:
            metrics.OVERLOADED.labels("not_ready").inc()
            raise Overloaded("the model is still loading on this worker; retry shortly",
                             retry_after_s=NOT_READY_RETRY_S, code="not_ready")
        metrics.OVERLOADED.labels("queue_full").inc()
        wait = self._admitted * per_image
        raise Overloaded(f"this worker has {self._admitted} image(s) queued or running (limit "
                         f"{self.limits.max_queue}); retry after ~{wait:.1f}s or spread load over more "
                         "workers/replicas", retry_after_s=wait)

    def settle(self, n: int) -> None:
        """``n`` admitted images reached the batcher or failed on the way."""
        self._upstream -= n
        if n and not self._upstream:
            self.images.wake()  # a batch waiting for more images need not wait any longer
        settling, self._settling = self._settling, Event()
        settling.set()

    def admitted(self) -> int:
        """Images admitted (queued or running) on this worker."""
        return self._admitted

    # ------------------------------------------------------------------ fetch and decode

    def wait_to_fetch(self, admission: Admission) -> None:
        """Until ``rules.may_fetch`` lets the request fetch."""
        while not rules.may_fetch(self.view(), admission.key):
            self._settling.wait()

    @contextlib.contextmanager
    def decode_slot(self, admission: Admission | None = None, index: int = 0) -> Iterator[bool]:
        """A decode thread's turn (``rules.decode_turn``), holding the reads if ``rules.first_decode`` says so;
        yields whether to run on the spare thread. Without ``admission``: unranked work, first."""
        view = self.view()
        request = admission.view() if admission is not None else None
        turn = rules.decode_turn(view, request, index)
        hold = rules.first_decode(view, request)
        caller = admission.caller if admission is not None else ""
        if admission is not None:
            admission.decodes += 1
        self._decoding_by[caller] = self._decoding_by.get(caller, 0) + 1
        self._spare_busy |= turn.spare
        try:
            with self.urgency.reads_held() if hold else contextlib.nullcontext(), \
                    contextlib.nullcontext() if turn.spare else self._decode.take(turn.rank):
                yield turn.spare
        finally:
            left = self._decoding_by.pop(caller) - 1
            if left:
                self._decoding_by[caller] = left
            if turn.spare:
                self._spare_busy = False

    # ------------------------------------------------------------------ batches

    def image_rules(self) -> BatchRules:
        return BatchRules(lambda forming: rules.batch_plan(self.view(), forming),
                          lambda running, left: rules.interjection(self.view(), running, left),
                          self.taken, self.urgent)

    def text_rules(self) -> BatchRules:
        return BatchRules(lambda forming: rules.text_plan(self.view(), forming), lambda running, left: Run(),
                          self.taken, contextlib.nullcontext)

    def taken(self, items: Sequence[Queued]) -> None:
        """Images left a queue for a forward: fair time moves on to them, and a held-back decode may go now."""
        for item in items:
            item.admission.taken += 1
            self._callers.tags.taken(item.waiting.tag)
        self._decode.recheck()

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """Around an urgent forward: no decode starts and no fetched body is read meanwhile."""
        try:
            with self.urgency.forward():
                yield
        finally:
            self._decode.recheck()
