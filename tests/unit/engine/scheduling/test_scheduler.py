"""The mechanism that carries the rules out: refusals as errors, cancelling, fetch turns, decode slots and
the urgent holds, on real greenlets (the decisions themselves are test_rules.py's)."""

from __future__ import annotations

import time

import gevent
import gevent.event
import pytest

from harness import batching
from harness.polling import quiet
from service.engine.scheduling import Admission, Scheduler
from service.engine.scheduling.urgency import HOLD_MAX_S
from service.errors import Overloaded, OverShare


def settle(admission: Admission, n: int = 1) -> None:
    """``n`` of the request's images reach the batcher (or fail on the way)."""
    for _ in range(n):
        with admission.image():
            pass


def test_refusals_are_503_or_429_with_retry_after_from_the_images_ahead() -> None:
    scheduler = batching.scheduler(max_queue=4, share=3, seconds_per_image=1.0)
    with pytest.raises(Overloaded) as loading, scheduler.admit(1, ready=False):
        pass
    assert loading.value.code == "not_ready" and loading.value.headers["Retry-After"] == "5"
    with scheduler.admit(3, caller="heavy"):
        with pytest.raises(OverShare) as over, scheduler.admit(1, caller="heavy"):
            pass
        assert over.value.status_code == 429 and over.value.headers["Retry-After"] == "3"
        with pytest.raises(Overloaded) as full, scheduler.admit(2, caller="light"):
            pass
        assert full.value.status_code == 503 and full.value.code == "overloaded"
        assert full.value.headers["Retry-After"] == "3"
    assert scheduler.view().admitted == 0


def test_a_failed_request_is_cancelled_its_queued_images_dropped_and_those_that_never_came_settled() -> None:
    scheduler = batching.scheduler()
    with pytest.raises(RuntimeError), scheduler.admit(4, coming=3) as admission:
        settle(admission)
        scheduler.images.push("queued", None, admission)
        assert scheduler.view().upstream == 2
        raise RuntimeError("deadline")
    assert admission.cancelled and len(scheduler.images) == 0 and scheduler.view().upstream == 0


def test_a_later_request_fetches_once_earlier_requests_have_few_images_on_their_way() -> None:
    scheduler = batching.scheduler(fetch_ahead=2)
    with scheduler.admit(5, caller="a") as early, scheduler.admit(3, caller="a") as late:  # tagged after it
        with gevent.Timeout(1):
            scheduler.wait_to_fetch(early)  # the earliest request never waits
        waiter = gevent.spawn(scheduler.wait_to_fetch, late)
        settle(early, 2)
        quiet()
        assert not waiter.dead, "3 of the earlier request's images still on their way: more than 2"
        settle(early)
        waiter.join(timeout=1)
        assert waiter.successful()


def test_a_callers_first_image_takes_the_spare_thread_while_another_callers_images_hold_them() -> None:
    scheduler = batching.scheduler(decode_threads=2)
    release = gevent.event.Event()
    got: list[tuple[str, bool]] = []

    def decode(name: str, admission: Admission, index: int) -> None:
        with scheduler.decode_slot(admission, index) as spare:
            got.append((name, spare))
            if name.startswith("album") and index < 2:
                release.wait()

    with scheduler.admit(3, caller="album") as album, scheduler.admit(1, caller="search") as search:
        busy = [gevent.spawn(decode, f"album {i}", album, i) for i in range(2)]
        quiet()
        waiting = gevent.spawn(decode, "album 2", album, 2)
        first = gevent.spawn(decode, "search 0", search, 0)
        first.join(timeout=1)
        assert got[2:] == [("search 0", True)] and not waiting.dead
        release.set()
        gevent.joinall([*busy, waiting], raise_error=True, timeout=2)
        assert ("album 2", False) in got


def decode_once(scheduler: Scheduler, admission: Admission, index: int = 0,
                release: gevent.event.Event | None = None) -> None:
    with scheduler.decode_slot(admission, index):
        if release is not None:
            release.wait()


def test_a_later_requests_decode_waits_while_the_model_has_enough_earlier_images_queued() -> None:
    scheduler = batching.scheduler(decode_threads=2)
    with scheduler.admit(3, caller="a") as earlier, scheduler.admit(1, caller="a") as later:
        queued = [scheduler.images.push(f"a{i}", None, earlier) for i in range(2)]
        scheduler.taken([])  # nothing taken yet: the rules are asked again, and still hold it back
        decode_b = gevent.spawn(decode_once, scheduler, later)
        quiet()
        assert not decode_b.dead
        for _ in queued:
            scheduler.images.pop()
        scheduler.taken(queued)  # the model took them
        decode_b.join(timeout=1)
        assert decode_b.successful()


def test_while_an_urgent_forward_runs_only_a_callers_first_image_decodes_and_reads_wait() -> None:
    scheduler = batching.scheduler(decode_threads=2)
    started: list[str] = []

    def decode(name: str, admission: Admission, index: int) -> None:
        with scheduler.decode_slot(admission, index):
            started.append(name)

    with scheduler.admit(3, caller="album") as album, scheduler.admit(1, caller="search") as search:
        scheduler.images.push("album 0", None, album)  # queued: its next image is not its first
        with scheduler.urgent():
            jobs = [gevent.spawn(decode, "album 1", album, 1), gevent.spawn(decode, "search 0", search, 0)]
            reader = gevent.spawn(scheduler.urgency.turn)
            quiet()
            assert started == ["search 0"] and not reader.dead
        gevent.joinall([*jobs, reader], raise_error=True, timeout=2)
        assert started == ["search 0", "album 1"]


def test_a_streamed_answers_first_decode_holds_the_reads_but_not_the_other_decodes() -> None:
    scheduler = batching.scheduler()
    release = gevent.event.Event()
    with scheduler.admit(3, caller="album", streamed=True) as album:
        lead = gevent.spawn(decode_once, scheduler, album, 0, release)
        quiet()
        reader = gevent.spawn(scheduler.urgency.turn)
        other = gevent.spawn(decode_once, scheduler, album, 1)
        quiet()
        assert other.dead and not reader.dead
        release.set()  # its decode ends
        gevent.joinall([lead, reader], raise_error=True, timeout=1)
        assert reader.dead


def test_reads_wait_at_most_hold_max_s_behind_a_long_urgent_forward() -> None:
    urgency = batching.scheduler().urgency
    with urgency.forward():
        t0 = time.monotonic()
        urgency.turn()
        held = time.monotonic() - t0
    assert HOLD_MAX_S * 0.9 <= held < HOLD_MAX_S * 5
    t0 = time.monotonic()
    urgency.turn()
    assert time.monotonic() - t0 < HOLD_MAX_S / 5
