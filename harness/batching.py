"""A worker's scheduling and batching without a worker, for unit tests: ``Scheduler`` and ``Batcher`` built
from a few limits, and requests admitted to them."""

from __future__ import annotations

import dataclasses
from typing import Any

from gevent.threadpool import ThreadPool

from service.engine.batcher import Batcher
from service.engine.forwarding import RunBatch
from service.engine.preemption import Preemption
from service.engine.scheduling import Limits, Scheduler, Signals

LIMITS = Limits(max_queue=64, share=64, fetch_ahead=16, decode_threads=2, max_batch=8, max_text_batch=64,
                max_wait_s=0.005, quantum_s=0.25, across_requests=True, interject=True)


def limits(**overrides: Any) -> Limits:
    return dataclasses.replace(LIMITS, **overrides)


def scheduler(*, all_cores: bool = True, preemptible: bool = False, seconds_per_image: float = 0.05,
              **overrides: Any) -> Scheduler:
    return Scheduler(limits(**overrides), Signals(all_cores=lambda: all_cores, preemptible=lambda: preemptible,
                                                  seconds_per_image=lambda: seconds_per_image))


def batcher(run_batch: RunBatch, on: Scheduler | None = None, *, preemption: Preemption | None = None,
            start: bool = True, **overrides: Any) -> tuple[Batcher, Scheduler]:
    """An image batcher on ``on`` (else a new scheduler with these limits), started unless told not to."""
    sched = on or scheduler(preemptible=preemption is not None, **overrides)
    b = Batcher(lambda _model, batch: run_batch(batch), ThreadPool(1), sched.images, sched.image_rules(),
                preemption=preemption)
    if start:
        b.start()
    return b, sched
