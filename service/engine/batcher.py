"""Micro-batching: images from concurrent requests gathered into one forward on the inference thread.

Greenlets queue one image each (``order.FairQueue``, the scheduler's) and wait on its ``AsyncResult``; one
collector greenlet forms a batch step by step as ``BatchRules.plan`` says (``rules.batch_plan``: how many,
whose, how long to wait, whether it is urgent), runs it on the 1-thread pool and routes the rows back.
While a forward runs, the images ``BatchRules.interjection`` names run between its blocks
(``preemption``). The pool's single thread *is* the worker-local lock, so the hub never waits on a real
lock. A batch that raises fails its own images only; images whose request ended, or whose deadline
passed, are dropped before they reach the model (``order.still_due``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any

import gevent
from gevent.event import AsyncResult
from gevent.threadpool import ThreadPool

from service.engine.forwarding import BatchStats, Outcome, RunBatch, RunModel, forward_stacked
from service.engine.preemption import Preemption
from service.engine.scheduling.admission import Admission
from service.engine.scheduling.order import FairQueue, Queued, still_due
from service.engine.scheduling.scheduler import BatchRules
from service.engine.scheduling.view import BatchPlan, Forming, Run
from service.engine.types import Row
from service.errors import InferenceFailed

log = logging.getLogger(__name__)


class Batcher:
    def __init__(self, run_model: RunModel, pool: ThreadPool, queue: FairQueue, rules: BatchRules, *,
                 preemption: Preemption | None = None, offers: Preemption | None = None,
                 stats: BatchStats | None = None) -> None:
        """``preemption``: this batcher's forwards can be interrupted at the model's points; ``offers``: its
        batches may run inside another batcher's forward when a plan says ``interject``."""
        self._run_model = run_model
        self._pool = pool
        self._queue = queue
        self._rules = rules
        self._preemption = preemption
        self._offers = offers
        self._running: Forming | None = None
        self._interject_left = 0
        self._interjecting = False
        self._loop: gevent.Greenlet | None = None
        self.stats = stats or BatchStats()

    def start(self) -> None:
        if self._loop is None:
            self._loop = gevent.spawn(self._collect_forever)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.kill()
            self._loop = None

    def submit(self, pixels: Any, deadline: float | None, admission: Admission) -> AsyncResult:
        """Queue the request's next image; ``.get()`` the result to wait for its ``Row``."""
        item = self._queue.push(pixels, deadline, admission)
        self._interject_soon()
        return item.result

    def _collect_forever(self) -> None:
        while True:
            batch, plan = self._collect()
            if not (live := still_due(batch)):
                continue
            if plan.interject and self._offers is not None and self._offered(live):
                continue
            self._run(live, plan.urgent)

    def _collect(self) -> tuple[list[Queued], BatchPlan]:
        """The next batch, formed as the plans say, and the last plan (is it urgent? may it interject?)."""
        while not (head := self._queue.pop()):
            self._queue.arrived.clear()
            self._queue.arrived.wait()
        started = time.monotonic()
        batch = self._took([head])
        while True:
            plan = self._rules.plan(Forming(started, tuple(item.waiting for item in batch)))
            if len(batch) >= plan.cap:
                break
            if plan.others.members:
                self._run_now(plan.others)
                continue
            if plan.closed:
                break
            if (item := self._queue.pop(plan.own, plan.model)) is not None:
                batch += self._took([item])
                continue
            remaining = plan.wait_until - time.monotonic()
            if remaining <= 0:
                break
            self._queue.arrived.clear()
            self._queue.arrived.wait(remaining)
        return batch, plan

    def _took(self, items: list[Queued]) -> list[Queued]:
        self._rules.taken(items)
        return items

    def _run_now(self, run: Run) -> None:
        if live := still_due(self._queue.take(run.members)):
            self._run(self._took(live), run.urgent)

    def _offered(self, batch: list[Queued]) -> bool:
        """Run ``batch`` between the blocks of the forward running now (``offers``); False when none runs."""
        assert self._offers is not None
        job = self._offers.offer(forward_stacked, self._forward_for(batch), [it.pixels for it in batch])
        if job is None:
            return False
        started = time.monotonic()
        self._deliver(batch, job.get(), started, time.monotonic() - started)
        return True

    def _run(self, batch: list[Queued], urgent: bool) -> None:
        """One forward, interruptible at the model's points when there are any."""
        started = time.monotonic()
        pixels = [it.pixels for it in batch]
        forward = self._forward_for(batch)
        interjected = 0.0
        self._running = Forming(started, tuple(item.waiting for item in batch))
        self._interject_left = len(batch)
        self._interject_soon()  # images already due go at its first point
        try:
            with self._urgent(urgent):
                if self._preemption is not None:
                    self._preemption.expect()
                    outcome, interjected = self._pool.apply(self._preemption.run, (forward_stacked, forward, pixels))
                else:
                    outcome = self._pool.apply(forward_stacked, (forward, pixels))
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

    def _forward_for(self, batch: list[Queued]) -> RunBatch:
        """The forward of the batch's model (a batch holds one model's images)."""
        return functools.partial(self._run_model, batch[0].waiting.model)

    def _urgent(self, urgent: bool) -> contextlib.AbstractContextManager[None]:
        return self._rules.urgent() if urgent else contextlib.nullcontext()

    # ------------------------------------------------------------------ interjections

    def _interject_soon(self) -> None:
        if self._running is not None and not self._interjecting and self._due().members:
            self._interjecting = True
            gevent.spawn(self._interject)

    def _due(self) -> Run:
        return self._rules.interjection(self._running, self._interject_left) if self._running else Run()

    def _interject(self) -> None:
        """Offer the images due to the running forward, as one short forward of their own, until none is due
        or the forward ends (then they lead the next batch as usual)."""
        assert self._preemption is not None
        try:
            while (run := self._due()).members:
                live = still_due(self._queue.take(run.members))
                if not live:
                    continue
                job = self._preemption.offer(forward_stacked, self._forward_for(live), [it.pixels for it in live])
                if job is None:  # the forward ended meanwhile: they lead the next batch
                    self._queue.requeue(live)
                    return
                self._interject_left -= len(live)
                if self.stats.on_interjected:
                    self.stats.on_interjected(len(live))
                self._took(live)
                started = time.monotonic()  # its inference time counts from the offer
                with self._urgent(run.urgent):
                    outcome = job.get()
                self._deliver(live, outcome, started, time.monotonic() - started)
        finally:
            self._interjecting = False
