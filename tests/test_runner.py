"""The runner's own parts: ranked decode slots, and the nice value of compute threads."""

from __future__ import annotations

import os
import sys
import threading

import gevent
import pytest

from service.engine.runner import RankedSlots, lower_priority


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
