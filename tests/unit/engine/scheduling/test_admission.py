"""Who is in the worker: fair tags, each request's place and each caller's count."""

from __future__ import annotations

import pytest

from service.engine.scheduling.admission import Admission, Callers, FairTags


def test_fair_tags() -> None:
    tags = FairTags()
    assert [tags.start("heavy", 30) for _ in range(4)] == [0, 30, 60, 90]
    tags.taken(10.0)  # the batcher is at the heavy caller's 11th image
    assert tags.start("light", 1) == 10.0, "a caller with nothing queued goes next, not after 120 images"
    assert tags.start("light", 1) == 11.0 and tags.start("heavy", 30) == 120.0
    tags.taken(5.0)
    assert tags.now == 10.0, "fair time never goes back"


def test_fair_tags_forget_callers_whose_work_is_behind() -> None:
    tags = FairTags()
    for i in range(200):
        tags.start(f"caller {i}", 1)
    tags.taken(500.0)
    assert tags._finish == {}, "callers with nothing ahead of now are not remembered"


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


def test_callers_count_admitted_images_and_forget_idle_callers() -> None:
    callers = Callers()
    callers.admit("a", 3, now=0.0, recent_s=1.0)
    callers.admit("a", 2, now=0.0, recent_s=1.0)
    callers.release("a", 3)
    assert callers.admitted == {"a": 2}
    callers.release("a", 2)
    assert callers.admitted == {}
    for i in range(70):
        callers.admit(f"c{i}", 1, now=float(i), recent_s=1.0)
        callers.release(f"c{i}", 1)
    assert len(callers.seen) <= 65
