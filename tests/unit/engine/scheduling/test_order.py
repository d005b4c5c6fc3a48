"""Waiters served by tag: the queue for the model, the decode threads' waiters, and what is dropped."""

from __future__ import annotations

import time

import gevent
import gevent.event
import pytest

from harness.polling import quiet
from service.engine.scheduling.admission import Admission
from service.engine.scheduling.order import FairQueue, RankedSlots, still_due
from service.errors import DeadlineExceeded


def test_the_queue_gives_the_lowest_tag_first_or_a_requests_own_lowest() -> None:
    queue = FairQueue()
    late, early = Admission(0, 0.0, start=10.0, caller="b"), Admission(0, 0.0, start=0.0, caller="a")
    for _ in range(2):
        queue.push("late", None, late)
        queue.push("early", None, early)
    assert queue.by("a") == 2 and len(queue) == 4
    assert queue.pop(late.key).waiting.tag == 10.0  # type: ignore[union-attr]
    assert [queue.pop().pixels for _ in range(2)] == ["early", "early"]  # type: ignore[union-attr]
    assert queue.pop(early.key) is None
    rest = queue.take(queue.waiting())
    assert [item.waiting.tag for item in rest] == [11.0] and len(queue) == 0
    queue.requeue(rest)
    assert queue.drop(late) == 1 and len(queue) == 0


def test_still_due() -> None:
    queue = FairQueue()
    gone, live = Admission(0, 0.0, caller="gone"), Admission(0, 0.0, caller="live")
    items = [queue.push("g", None, gone), queue.push("l", None, live),
             queue.push("late", time.monotonic() - 1, live)]
    gone.cancelled = True
    assert still_due(items) == [items[1]]
    with pytest.raises(DeadlineExceeded):
        items[2].result.get(timeout=0)
    assert not items[0].result.ready()  # nobody waits on a cancelled request's rows


def test_waiters_get_slots_in_rank_order_not_arrival_order() -> None:
    slots = RankedSlots(1)
    order: list[str] = []
    release = gevent.event.Event()

    def task(name: str, rank: tuple[float, int]) -> None:
        with slots.take(rank):
            order.append(name)
            if name == "holder":
                release.wait()

    first = gevent.spawn(task, "holder", (0.0, 0))
    quiet()  # the holder has the slot; the rest queue in this order...
    later = [gevent.spawn(task, name, rank) for name, rank in
             (("late request", (3.0, 0)), ("early request, image 1", (1.0, 1)), ("early request, image 0", (1.0, 0)))]
    quiet()
    release.set()
    gevent.joinall([first, *later], raise_error=True, timeout=2)
    assert order == ["holder", "early request, image 0", "early request, image 1", "late request"]


def test_a_killed_waiter_gives_up_its_place_and_no_slot_is_lost() -> None:
    slots = RankedSlots(1)
    done: list[str] = []
    release = gevent.event.Event()

    def task(name: str, rank: tuple[float, int]) -> None:
        with slots.take(rank):
            release.wait()
            done.append(name)

    holder = gevent.spawn(task, "holder", (0.0, 0))
    quiet()
    doomed = gevent.spawn(task, "doomed", (1.0, 0))
    survivor = gevent.spawn(task, "survivor", (2.0, 0))
    quiet()
    doomed.kill()
    release.set()
    gevent.joinall([holder, survivor], raise_error=True, timeout=2)
    assert done == ["holder", "survivor"]
    with gevent.Timeout(1), slots.take((0.0, 0)):  # the slot came back
        pass


def test_a_rank_held_back_by_ready_waits_for_recheck_and_earlier_ranks_pass_it() -> None:
    limit = [3.0]  # ranks from this one on are held back
    slots = RankedSlots(2, ready=lambda rank: rank[0] < limit[0])
    order: list[str] = []

    def task(name: str, rank: tuple[float, int]) -> None:
        with slots.take(rank):
            order.append(name)

    late = gevent.spawn(task, "late", (5.0, 0))
    quiet()
    assert order == []  # two slots free, still held back
    early = gevent.spawn(task, "early", (1.0, 0))
    gevent.joinall([early], timeout=1)
    assert order == ["early"]  # came after, was not held back, went past
    limit[0] = 10.0
    slots.recheck()
    gevent.joinall([late], raise_error=True, timeout=1)
    assert order == ["early", "late"]
