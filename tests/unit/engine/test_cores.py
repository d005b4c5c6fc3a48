"""How many cores a worker's forward uses, and how urgent its native threads are."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from service.engine.cores import CorePlan, lower_priority
from service.settings import Settings


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


class Model:
    def __init__(self) -> None:
        self.threads: list[int] = []

    def set_threads(self, n: int) -> None:
        self.threads.append(n)


def test_a_worker_borrows_every_core_only_while_its_siblings_are_idle() -> None:
    siblings = Siblings()
    settings = Settings.from_env({"GREENSERVE_WORKERS": "2"})
    plan = CorePlan(settings, 2, siblings)
    model = Model()
    assert plan.forward_threads() == 2 and plan.all_cores()  # the siblings idle: every core
    plan.apply(model)
    plan.apply(model)
    siblings.idle = False
    assert plan.forward_threads() == 1 and not plan.all_cores()  # one is busy: this worker's share
    plan.apply(model)
    assert model.threads == [2, 1]  # set only when the plan changes
    assert CorePlan(settings, 2).forward_threads() == 1  # nothing known of siblings: the share
    pinned = CorePlan(Settings.from_env({"GREENSERVE_WORKERS": "2", "GREENSERVE_TORCH_THREADS": "1"}), 2,
                        Siblings())
    assert pinned.forward_threads() == 1
    pinned.apply(model)
    assert model.threads == [2, 1]  # pinned: never changed


def test_without_borrowing_a_worker_runs_on_its_share_while_its_siblings_idle() -> None:
    plan = CorePlan(Settings(workers=2, borrow_idle_cores=False), 2, Siblings())
    model = Model()
    assert plan.forward_threads() == 1 and not plan.all_cores()
    plan.apply(model)
    assert model.threads == []  # torch keeps the share it started with
