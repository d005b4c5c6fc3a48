"""Who is in the worker: fair tags, each request's place and each caller's count."""

from __future__ import annotations

import pytest

from service.engine.scheduling.admission import RECENT_KEPT, Admission, Callers, FairTags


def test_fair_tags() -> None:
    tags = FairTags()
    assert [tags.start("heavy", 30) for _ in range(4)] == [0, 30, 60, 90]
    tags.taken(10.0)  # the batcher is at the heavy caller's 11th image
    assert tags.start("light", 1) == 10.0, "a caller with nothing queued goes next, not after 120 images"
    assert tags.start("light", 1) == 11.0 and tags.start("heavy", 30) == 120.0
    tags.taken(5.0)
    assert tags.now == 10.0, "fair time never goes back"


def test_an_admission_tags_its_images_as_they_come_and_settles_each_once() -> None:
    settled: list[int] = []
    request = Admission(3, arrived=1.0, start=10.0, caller="c", settled=settled.append)
    assert [request.next_tag() for _ in range(2)] == [10.0, 11.0] and request.rank(2) == (12.0, 2)
    with request.image():
        pass
    with pytest.raises(RuntimeError), request.image():
        raise RuntimeError("a failed decode")
    assert request.upstream == 1 and settled == [1, 1]
    assert request.view().upstream_before(20.0) == 1  # one left, tagged 12
    assert request.view().upstream_before(11.5) == 0


def test_callers_count_admitted_images_and_keep_nothing_of_a_caller_with_no_work_but_its_recent_visit() -> None:
    callers = Callers()
    callers.admit("a", 3, now=0.0)
    callers.admit("a", 2, now=0.0)
    callers.release("a", 3)
    assert callers.admitted == {"a": 2} and len(callers.tags) == 1
    callers.release("a", 2)
    assert callers.admitted == {} and len(callers.tags) == 0 and list(callers.seen) == ["a"]


def test_a_hundred_thousand_one_image_callers_leave_bounded_state() -> None:
    """Each caller's image is taken at the fair tag it started at (now does not move), then it leaves."""
    callers = Callers()
    for i in range(100_000):
        tag = callers.admit(f"caller {i}", 1, now=i * 1e-5)
        callers.tags.taken(tag)
        callers.release(f"caller {i}", 1)
    assert callers.tracked() == RECENT_KEPT and len(callers.tags) == 0
    assert list(callers.seen)[-1] == "caller 99999"
