"""The runner's own parts: ranked decode slots, the decode lookahead, the nice value of compute threads, the
accept gate and borrowing idle cores."""

from __future__ import annotations

import os
import sys
import threading

import gevent
import numpy as np
import pytest

from service.engine.runner import Admission, RankedSlots, Runner, lower_priority
from service.settings import Settings
from tests.fakes import FakeModel


def test_waiters_get_slots_in_rank_order_not_arrival_order() -> None:
    slots = RankedSlots(1)
    order: list[str] = []

    def task(name: str, rank: tuple[float, int]) -> None:
        with slots.take(rank):
            order.append(name)
            gevent.sleep(0.01)

    first = gevent.spawn(task, "holder", (0.0, 0))
    gevent.sleep(0)  # the holder has the slot; the rest queue in this order...
    later = [gevent.spawn(task, name, rank) for name, rank in
             (("late request", (3.0, 0)), ("early request, image 1", (1.0, 1)), ("early request, image 0", (1.0, 0)))]
    gevent.joinall([first, *later], raise_error=True)
    assert order == ["holder", "early request, image 0", "early request, image 1", "late request"]


def test_a_killed_waiter_gives_up_its_place_and_no_slot_is_lost() -> None:
    slots = RankedSlots(1)
    done: list[str] = []

    def task(name: str, rank: tuple[float, int]) -> None:
        with slots.take(rank):
            gevent.sleep(0.02)
            done.append(name)

    holder = gevent.spawn(task, "holder", (0.0, 0))
    gevent.sleep(0)
    doomed = gevent.spawn(task, "doomed", (1.0, 0))
    survivor = gevent.spawn(task, "survivor", (2.0, 0))
    gevent.sleep(0)
    doomed.kill()
    gevent.joinall([holder, survivor], raise_error=True, timeout=2)
    assert done == ["holder", "survivor"]
    with gevent.Timeout(1):  # the slot came back
        with slots.take((0.0, 0)):
            pass


def test_a_rank_held_back_by_ready_waits_for_recheck_and_earlier_ranks_pass_it() -> None:
    limit = [3.0]  # ranks from this arrival on are held back
    slots = RankedSlots(2, ready=lambda rank: rank[0] < limit[0])
    order: list[str] = []

    def task(name: str, rank: tuple[float, int]) -> None:
        with slots.take(rank):
            order.append(name)

    late = gevent.spawn(task, "late", (5.0, 0))
    gevent.sleep(0.02)
    assert order == []  # two slots free, still held back
    early = gevent.spawn(task, "early", (1.0, 0))
    gevent.joinall([early], timeout=1)
    assert order == ["early"]  # came after, was not held back, went past
    limit[0] = 10.0
    slots.recheck()
    gevent.joinall([late], raise_error=True, timeout=1)
    assert order == ["early", "late"]


def test_a_later_requests_decode_waits_while_the_model_has_enough_earlier_images() -> None:
    """Two decode threads: with two of request 1's images queued for the model, request 2's images wait
    to decode (request 1's own do not) until a batch takes request 1's images."""
    settings = Settings.from_env({"GREENSERVE_DECODE_THREADS": "2", "GREENSERVE_MAX_BATCH_WAIT_MS": "0"})
    runner = Runner(settings, model=FakeModel(), cores=2)
    pixels = np.zeros((32, 32, 3), np.uint8)
    rows = [runner.infer(pixels, arrived=1.0) for _ in range(2)]  # request 1's, the batcher not started
    decoded: list[str] = []

    def decode(name: str, rank: tuple[float, int]) -> None:
        runner.offload(decoded.append, name, rank=rank)

    later = gevent.spawn(decode, "request 2, image 0", (2.0, 0))
    own = gevent.spawn(decode, "request 1, image 2", (1.0, 2))
    gevent.joinall([own], raise_error=True, timeout=2)
    gevent.sleep(0.05)
    assert decoded == ["request 1, image 2"]
    runner.batcher.start()  # the model takes request 1's images
    try:
        gevent.joinall([later, *rows], raise_error=True, timeout=2)
        assert decoded == ["request 1, image 2", "request 2, image 0"]
    finally:
        runner.batcher.stop()


def test_a_batch_gathering_a_later_requests_images_goes_when_an_earlier_requests_images_wait() -> None:
    """One worker on every core gathers: the later request's first image leads a batch that waits for
    its second, whose decode is held back by the earlier request's waiting images. The batch must go
    (and the earlier request be served first), not wait for an image that cannot come."""
    settings = Settings.from_env({"GREENSERVE_WORKERS": "1", "GREENSERVE_DECODE_THREADS": "2"})
    runner = Runner(settings, model=FakeModel(), cores=2)
    pixels = np.zeros((32, 32, 3), np.uint8)
    done: list[str] = []

    def image(admission: Admission, arrived: float, index: int) -> None:
        crop = runner.offload(pixels.copy, rank=(arrived, index))
        admission.settle()
        runner.infer(crop, group=admission, arrived=arrived).get()
        done.append(f"{arrived:.0f}/{index}")

    runner.batcher.start()
    try:
        with runner.admit(2) as later, runner.admit(2) as earlier:
            first = gevent.spawn(image, later, 2.0, 0)
            while later.upstream == 2:  # decoded and queued: the collector takes it and gathers
                gevent.sleep(0.001)
            gevent.sleep(0.01)
            rest = [gevent.spawn(image, earlier, 1.0, i) for i in range(2)]
            gevent.sleep(0.01)
            rest.append(gevent.spawn(image, later, 2.0, 1))
            gevent.joinall([first, *rest], raise_error=True, timeout=3)
        assert sorted(done) == ["1/0", "1/1", "2/0", "2/1"]
        assert done.index("1/1") < done.index("2/1")
    finally:
        runner.batcher.stop()


def test_a_later_request_fetches_once_earlier_requests_have_few_images_on_their_way() -> None:
    settings = Settings.from_env({"GREENSERVE_FETCH_CONCURRENCY": "2"})
    runner = Runner(settings, model=FakeModel(), cores=2)
    with runner.admit(5, arrived=1.0) as early:
        with gevent.Timeout(1):
            runner.wait_to_fetch(early)  # the earliest request never waits
        with runner.admit(3, arrived=2.0) as late:
            waiter = gevent.spawn(runner.wait_to_fetch, late)
            gevent.sleep(0.01)
            early.settle(2)  # 3 of the earlier request's images still on their way: more than 2
            gevent.sleep(0.01)
            assert not waiter.dead
            early.settle()
            waiter.join(timeout=1)
            assert waiter.successful()
            with runner.admit(1, arrived=3.0) as last:
                waiter = gevent.spawn(runner.wait_to_fetch, last)  # 2 + 3 still on their way
                gevent.sleep(0.01)
                assert not waiter.dead
        waiter.join(timeout=1)  # the middle request ended (its images failed or were served)
        assert waiter.successful()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux")
def test_lower_priority_lowers_only_the_calling_thread_and_only_once() -> None:
    seen: dict[str, int] = {}

    def run() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        lower_priority(3)
        lower_priority(3)
        seen["delta"] = os.getpriority(os.PRIO_PROCESS, tid) - before

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["delta"] == 3
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == os.getpriority(os.PRIO_PROCESS, 0)


class Siblings:
    def __init__(self) -> None:
        self.idle = True

    def siblings_idle(self) -> bool:
        return self.idle


def test_a_worker_borrows_every_core_only_while_its_siblings_are_idle() -> None:
    siblings = Siblings()
    runner = Runner(Settings.from_env({}), model=FakeModel(), cores=2, siblings=siblings)
    assert runner._forward_threads() == 2  # the siblings idle: every core
    siblings.idle = False
    assert runner._forward_threads() == 1  # one is busy: this worker's share
    assert Runner(Settings.from_env({}), model=FakeModel(), cores=2)._forward_threads() == 1  # nothing known
    pinned = Runner(Settings.from_env({"GREENSERVE_TORCH_THREADS": "1"}), model=FakeModel(), cores=2,
                    siblings=Siblings())
    assert pinned._forward_threads() == 1
