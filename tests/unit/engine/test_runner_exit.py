"""A worker's exit: ``Runner.close`` ends the model's native threads before the interpreter finalizes (a
thread still in torch then is ended by ``pthread_exit``, which aborts the process), and says when one is
still busy so the worker exits without finalizing."""

from __future__ import annotations

import threading
import time

import numpy as np

from harness.fakes import FakeModel
from harness.polling import quiet, until
from service.engine.runner import Runner
from service.settings import Settings


def test_an_idle_runner_ends_its_threads() -> None:
    runner = Runner(Settings(), model=FakeModel(), cores=2)
    runner.start()
    with runner.admit(1) as admission:
        assert runner.offload(lambda: 1) == 1
        runner.infer(np.zeros((32, 32, 3), np.uint8), None, admission).get(timeout=10)
    assert runner._infer_pool.size == 1 and runner._decode_pool.size == 1
    assert runner.close(2.0)
    assert runner._infer_pool.size == 0 and runner._decode_pool.size == 0


def test_a_load_not_begun_never_starts() -> None:
    loads: list[int] = []
    runner = Runner(Settings(), loader=lambda: loads.append(1) or FakeModel())  # type: ignore[func-returns-value]
    runner.start()  # the load greenlet is spawned, not yet run: the exit comes first (a SIGTERM at boot)
    assert runner.close(2.0)
    quiet()  # the killed load greenlet would have run by now
    assert loads == [] and runner._infer_pool.size == 0


def test_a_load_in_progress_is_waited_for_then_reported_busy() -> None:
    release, loading = threading.Event(), threading.Event()

    def slow_load() -> FakeModel:
        loading.set()
        release.wait(10)
        return FakeModel()

    runner = Runner(Settings(), loader=slow_load)
    runner.start()
    until(loading.is_set, what="the load is in its thread")
    started = time.monotonic()
    assert not runner.close(0.3)  # still in the model's code: the worker must not finalize
    assert 0.25 < time.monotonic() - started < 2.0
    release.set()
    assert runner.close(5.0)  # once it is done, the thread ends
    assert runner._infer_pool.size == 0
