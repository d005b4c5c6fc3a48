"""A replacement worker's boot priority (``service.balance.priority``) and the master's imports
(``service.preimport``), on real threads of this process."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator

import pytest

from service import preimport
from service.balance import priority
from service.balance.board import LoadBoard, Seat
from service.balance.gate import Balance, Policy
from service.balance.priority import BootPriority

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread are Linux's")


def nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@pytest.fixture
def thread_below_the_hub() -> Iterator[int]:
    """A native thread 5 steps below the test's own (as the model's thread is below a worker's hub), run in a
    thread of its own so the test's nice value can be moved and put back."""
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def run() -> None:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, nice(me) + 5)
        tid.append(me)
        ready.set()
        done.wait(10)

    t = threading.Thread(target=run)
    t.start()
    ready.wait(5)
    yield tid[0]
    done.set()
    t.join()


@linux
def test_lower_and_restore_move_every_thread_by_the_same_step(thread_below_the_hub: int) -> None:
    """Each thread keeps its distance from the hub: the model's thread came back 5 below it, not level."""
    me = threading.get_native_id()
    start = nice(me)
    if not priority.may_raise_to(start):
        pytest.skip("this process may not take a lowered priority back (no CAP_SYS_NICE nor RLIMIT_NICE)")
    result: list[tuple[int, int, int, int]] = []

    def in_a_thread() -> None:  # the whole process's threads move: run it where the test runner is unaffected
        boot = BootPriority()
        assert boot.lower(by=3) and boot.lowered
        lowered = (nice(me), nice(thread_below_the_hub))
        boot.restore()
        assert not boot.lowered
        result.append((*lowered, nice(me), nice(thread_below_the_hub)))
        boot.restore()  # idempotent

    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert result == [(start + 3, start + 8, start, start + 5)]


@linux
def test_a_process_that_could_not_take_its_priority_back_boots_at_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CAP_SYS_NICE and with RLIMIT_NICE at its default 0, a lowered worker would serve lowered for
    good: it does not lower at all."""
    monkeypatch.setattr(priority.resource, "getrlimit", lambda _: (0, 0))
    monkeypatch.setattr(priority, "_capable", lambda cap: False)
    me = threading.get_native_id()
    start = nice(me)
    boot = BootPriority()
    assert not boot.lower()
    assert not boot.lowered and nice(me) == start
    monkeypatch.setattr(priority.resource, "getrlimit", lambda _: (20 - start, 20 - start))  # LimitNICE=+0
    assert priority.may_raise_to(start)


class FakeBoot(BootPriority):
    def __init__(self) -> None:
        super().__init__()
        self._normal = 0  # as if lowered
        self.restored = 0

    def restore(self) -> None:
        self.restored += 1
        self._normal = None


class Engine:
    def __init__(self) -> None:
        self.ready = False
        self.fatal_error = None

    def close(self, timeout_s: float) -> bool:
        return True


def test_the_balance_restores_the_priority_once_the_model_serves() -> None:
    board = LoadBoard(4)
    seat = Seat(board, board.claim())
    boot, engine = FakeBoot(), Engine()
    balance = Balance(seat, Policy(), boot=boot)
    balance._readiness = engine  # following the engine without the ticker's greenlets
    balance.apply()
    assert boot.restored == 0 and boot.lowered  # still loading: its siblings keep the cores
    engine.ready = True
    assert balance.apply()  # accepting, and at its normal priority first
    balance.apply()
    assert boot.restored == 1


def test_only_a_worker_with_a_serving_sibling_boots_lowered() -> None:
    board = LoadBoard(4)
    first, second = board.claim(), board.claim()
    assert not board.any_serving(second)  # the server's first boot: nobody serves, boot at full speed
    board.publish(first, 0, 0)  # the first one's model is ready
    assert board.any_serving(second)
    board.release(first)
    assert not board.any_serving(second)


@pytest.mark.parametrize(("model", "libraries"), [
    ("resnet50", ("torch", "torchvision")),
    ("torchvision:convnext_tiny", ("torch", "torchvision")),
    ("open_clip:ViT-B-32", ("torch", "torchvision", "open_clip")),
    ("timm:convnext_tiny", ("torch", "torchvision", "timm")),
    ("nonsense:x", ("torch", "torchvision")),  # the worker reports the bad name with the load
])
def test_the_master_imports_what_the_models_worker_would(model: str, libraries: tuple[str, ...]) -> None:
    assert preimport.libraries_for(model) == libraries
