"""Request-order scheduling: ranked decode slots, the decode lookahead, fetch pacing, admission, gathering."""

from __future__ import annotations

import threading
import time

import gevent
import gevent.event
import numpy as np
import pytest

from harness.fakes import FakeModel
from service.engine.runner import Runner
from service.engine.scheduling import Admission, Gather, Scheduler
from service.engine.slots import RankedSlots
from service.engine.urgency import HOLD_MAX_S, Urgency
from service.errors import Overloaded
from service.settings import Settings


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
    decoded: list[str] = []

    def decode(name: str, rank: tuple[float, int]) -> None:
        runner.offload(decoded.append, name, rank=rank)

    with runner.admit(3, arrived=1.0) as request_1:
        rows = [runner.infer(pixels, None, request_1) for _ in range(2)]  # the batcher not started yet
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

    def image(admission: Admission, index: int) -> None:
        with admission.image():
            crop = runner.offload(pixels.copy, rank=admission.rank(index))
            result = runner.infer(crop, None, admission)
        result.get()
        done.append(f"{admission.arrived:.0f}/{index}")

    runner.batcher.start()
    try:
        with runner.admit(2, arrived=1.0) as earlier, runner.admit(2, arrived=2.0) as later:
            first = gevent.spawn(image, later, 0)
            while later.upstream == 2:  # decoded and queued: the collector takes it and gathers
                gevent.sleep(0.001)
            gevent.sleep(0.01)
            rest = [gevent.spawn(image, earlier, i) for i in range(2)]
            gevent.sleep(0.01)
            rest.append(gevent.spawn(image, later, 1))
            gevent.joinall([first, *rest], raise_error=True, timeout=3)
        assert sorted(done) == ["1/0", "1/1", "2/0", "2/1"]
        assert done.index("1/1") < done.index("2/1")
    finally:
        runner.batcher.stop()


def settle(admission: Admission, n: int = 1) -> None:
    """``n`` of the request's images reach the batcher (or fail on the way)."""
    for _ in range(n):
        with admission.image():
            pass


class AllCores:
    def __init__(self, all_cores: bool = True) -> None:
        self.value = all_cores

    def all_cores(self) -> bool:
        return self.value


def test_a_later_request_fetches_once_earlier_requests_have_few_images_on_their_way() -> None:
    scheduler = Scheduler(Settings.from_env({"GREENSERVE_FETCH_CONCURRENCY": "2"}), 2, AllCores())
    with scheduler.admit(5, arrived=1.0) as early:
        with gevent.Timeout(1):
            scheduler.wait_to_fetch(early)  # the earliest request never waits
        with scheduler.admit(3, arrived=2.0) as late:
            waiter = gevent.spawn(scheduler.wait_to_fetch, late)
            gevent.sleep(0.01)
            settle(early, 2)  # 3 of the earlier request's images still on their way: more than 2
            gevent.sleep(0.01)
            assert not waiter.dead
            settle(early)
            waiter.join(timeout=1)
            assert waiter.successful()
            with scheduler.admit(1, arrived=3.0) as last:
                waiter = gevent.spawn(scheduler.wait_to_fetch, last)  # 2 + 3 still on their way
                gevent.sleep(0.01)
                assert not waiter.dead
        waiter.join(timeout=1)  # the middle request ended (its images failed or were served)
        assert waiter.successful()


def test_admission_refuses_past_the_queue_bound_and_while_loading() -> None:
    scheduler = Scheduler(Settings.from_env({"GREENSERVE_MAX_QUEUE_IMAGES": "4"}), 2, AllCores())
    with pytest.raises(Overloaded) as loading:
        with scheduler.admit(1, ready=False):
            pass
    assert loading.value.code == "not_ready" and loading.value.headers["Retry-After"] == "5"
    with scheduler.admit(3):
        with pytest.raises(Overloaded) as full:
            with scheduler.admit(2, seconds_per_image=1.0):
                pass
        assert full.value.code == "overloaded" and full.value.headers["Retry-After"] == "3"
        with scheduler.admit(1):
            pass  # fits
    with scheduler.admit(10):
        pass  # alone, a request bigger than the bound is admitted: it could never run otherwise


def test_images_that_never_came_settle_when_the_request_ends_and_a_failed_request_is_cancelled() -> None:
    cancelled = []

    class Queue:
        def queued_before(self, arrived: float) -> int:
            return 0

        def wake(self) -> None:
            pass

        def cancel(self, group: Admission) -> int:
            cancelled.append(group)
            return 0

    scheduler = Scheduler(Settings.from_env({}), 2, AllCores())
    scheduler.watch(Queue())
    with pytest.raises(RuntimeError):
        with scheduler.admit(4, coming=3) as admission:
            settle(admission)
            assert scheduler.upstream() == 2
            raise RuntimeError("deadline")
    assert scheduler.upstream() == 0 and admission.cancelled and cancelled == [admission]


def test_a_batch_gathers_only_while_the_forward_runs_on_every_core() -> None:
    cores = AllCores(False)
    scheduler = Scheduler(Settings.from_env({}), 1, cores)
    assert scheduler.gather() is Gather.NO
    cores.value = True
    assert scheduler.gather() is Gather.BRIDGE_GAPS  # decode idle: bridge short gaps only
    with scheduler.decode_slot((1.0, 0)):
        assert scheduler.gather() is Gather.WHILE_DECODING


def test_a_callers_first_image_takes_the_spare_decode_thread_while_another_caller_holds_them() -> None:
    """Both decode threads busy with an album's photos: a one-photo caller's image decodes at once on the
    spare thread, while the album's next image waits for one of its own."""
    settings = Settings.from_env({"GREENSERVE_DECODE_THREADS": "2"})
    runner = Runner(settings, model=FakeModel(), cores=2)
    release = threading.Event()
    done: list[str] = []

    def decode(name: str, caller: str, rank: tuple[float, int], block: bool) -> None:
        runner.offload(lambda: (release.wait(5) if block else None, done.append(name)), rank=rank, caller=caller)

    with runner.admit(3, arrived=1.0, caller="album"), runner.admit(1, arrived=2.0, caller="search"):
        busy = [gevent.spawn(decode, f"album {i}", "album", (1.0 + i, i), True) for i in range(2)]
        gevent.sleep(0.05)
        album_next = gevent.spawn(decode, "album 2", "album", (3.0, 2), False)
        search = gevent.spawn(decode, "search 0", "search", (4.0, 0), False)
        search.join(timeout=2)
        assert done == ["search 0"] and not album_next.dead
        release.set()
        gevent.joinall([*busy, album_next], raise_error=True, timeout=2)
        assert sorted(done[1:]) == ["album 0", "album 1", "album 2"]


def test_a_callers_first_image_is_not_held_back_behind_another_callers_queued_images() -> None:
    """The decode lookahead holds later images while the model has two earlier ones queued; a caller with
    nothing of its own in the worker is not held (its image was tagged just after the album's two)."""
    settings = Settings.from_env({"GREENSERVE_DECODE_THREADS": "2", "GREENSERVE_MAX_BATCH_WAIT_MS": "0"})
    runner = Runner(settings, model=FakeModel(), cores=2)
    pixels = np.zeros((32, 32, 3), np.uint8)
    decoded: list[str] = []
    with runner.admit(4, arrived=1.0, caller="album") as album, runner.admit(1, arrived=2.0, caller="search"):
        rows = [runner.infer(pixels, None, album) for _ in range(2)]  # the batcher not started yet
        held = gevent.spawn(runner.offload, decoded.append, "album 3", rank=(album.start + 3, 3), caller="album")
        first = gevent.spawn(runner.offload, decoded.append, "search 0", rank=(album.start + 2.5, 0), caller="search")
        first.join(timeout=2)
        gevent.sleep(0.05)
        assert decoded == ["search 0"] and not held.dead
        runner.batcher.start()
        try:
            gevent.joinall([held, *rows], raise_error=True, timeout=2)
        finally:
            runner.batcher.stop()


def test_a_callers_only_small_request_fetches_at_once_whatever_other_callers_have_on_their_way() -> None:
    """Fetch pacing waits for images tagged before the request; a caller's only request, if small, does not
    (here "search" is tagged 10 ahead of now, behind 10 of the album's images on their way)."""
    scheduler = Scheduler(Settings.from_env({"GREENSERVE_FETCH_CONCURRENCY": "2"}), 2, AllCores())
    with scheduler.admit(10, arrived=0.5, caller="search"):
        pass  # its finish tag stays 10 ahead of now
    with scheduler.admit(30, arrived=1.0, caller="album"):
        with scheduler.admit(1, arrived=2.0, caller="search") as one, gevent.Timeout(1):
            scheduler.wait_to_fetch(one)
        with scheduler.admit(3, arrived=3.0, caller="search") as three:
            waiter = gevent.spawn(scheduler.wait_to_fetch, three)  # more than fetch_concurrency: it paces
            gevent.sleep(0.01)
            assert not waiter.dead
            waiter.kill()


@pytest.mark.parametrize("all_cores", [True, False])
def test_no_decode_starts_while_an_urgent_forward_has_every_core_but_a_callers_first_image(all_cores: bool) -> None:
    """A streamed answer's first row runs alone on the cores: the album's next decode waits for it to end
    (a one-photo caller's image does not). A forward that leaves cores free (sibling workers) holds nothing."""
    scheduler = Scheduler(Settings.from_env({}), 2, AllCores(all_cores))
    started: list[str] = []
    release = gevent.event.Event()

    def decode(name: str, rank: tuple[float, int], caller: str, wait: bool = False) -> None:
        with scheduler.decode_slot(rank, caller):
            started.append(name)
            if wait:
                release.wait(5)

    with scheduler.admit(3, arrived=1.0, caller="album"), scheduler.admit(1, arrived=2.0, caller="search"):
        with scheduler.urgent():
            assert scheduler.urgency.active is all_cores
            album = [gevent.spawn(decode, "album 0", (1.0, 0), "album", True)]  # its first: not held
            gevent.sleep(0.01)
            album.append(gevent.spawn(decode, "album 1", (2.0, 1), "album"))
            search = gevent.spawn(decode, "search 0", (5.0, 0), "search")
            gevent.sleep(0.05)
            assert started == (["album 0", "search 0"] if all_cores else ["album 0", "album 1", "search 0"])
        gevent.sleep(0.01)
        assert "album 1" in started and not scheduler.urgency.active
        release.set()
        gevent.joinall([*album, search], raise_error=True, timeout=2)


def test_reads_wait_while_an_urgent_forward_runs_at_most_hold_max() -> None:
    urgency = Urgency()
    urgency.begin()
    reader = gevent.spawn(urgency.turn)
    gevent.sleep(0.05)
    assert not reader.dead, "a body's next chunk waits for the urgent forward"
    urgency.end()
    reader.join(timeout=1)
    assert reader.dead
    urgency.begin()
    t0 = time.monotonic()
    urgency.turn()  # a forward that runs long: the reads go on after HOLD_MAX_S
    assert HOLD_MAX_S * 0.9 <= time.monotonic() - t0 < HOLD_MAX_S + 0.3
    urgency.end()
    t0 = time.monotonic()
    urgency.turn()
    assert time.monotonic() - t0 < 0.05


@pytest.mark.parametrize("all_cores", [True, False])
def test_a_streamed_answers_first_decode_holds_the_reads_but_not_the_other_decodes(all_cores: bool) -> None:
    scheduler = Scheduler(Settings.from_env({}), 2, AllCores(all_cores))
    started: list[str] = []

    def decode(name: str, rank: tuple[float, int], caller: str) -> None:
        with scheduler.decode_slot(rank, caller):
            started.append(name)

    with scheduler.admit(3, arrived=1.0, caller="album"), scheduler.first_decode():
        reader = gevent.spawn(scheduler.urgency.turn)
        other = gevent.spawn(decode, "album 1", (2.0, 1), "album")
        gevent.sleep(0.05)
        assert started == ["album 1"] and reader.dead is not all_cores
    reader.join(timeout=1)
    assert reader.dead and other.dead
