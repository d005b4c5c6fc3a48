"""The batcher as mechanism, on a real gevent ThreadPool(1) with a fake forward: it routes rows, forms batches
as the plans say, and fails, drops and waits as told (which plan applies is test_rules.py's)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import gevent
import numpy as np
import pytest
from gevent.event import AsyncResult
from gevent.threadpool import ThreadPool

from harness import batching
from harness.polling import quiet, until
from service.engine.batcher import Batcher
from service.engine.scheduling import Admission, BatchRules, Scheduler
from service.engine.scheduling.view import BatchPlan, Forming, Run
from service.errors import DeadlineExceeded, InferenceFailed


class Forward:
    """Row i's output encodes image i's pixel value, so misrouting shows; while ``gate`` is clear, a forward
    waits for it (the test decides when the model is busy)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.gate = threading.Event()
        self.gate.set()
        self.sizes: list[int] = []
        self.values: list[list[int]] = []
        self.threads: set[int] = set()

    def __call__(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.threads.add(threading.get_ident())
        self.sizes.append(len(batch))
        values = batch[:, 0, 0, 0].astype(np.float32)
        self.values.append([int(v) for v in values])
        self.gate.wait(5)
        if self.fail_on is not None and self.fail_on in values:
            raise RuntimeError("bad batch")
        return values[:, None].repeat(2, axis=1), values[:, None]


def pixel(v: int) -> np.ndarray:
    return np.full((2, 2, 3), v, np.uint8)


def submit(b: Batcher, request: Admission, *values: int) -> list[AsyncResult]:
    return [b.submit(pixel(v), None, request) for v in values]


def features(results: list[AsyncResult]) -> list[float]:
    return [r.get(timeout=5).features[0] for r in results]


def test_concurrent_requests_get_their_own_rows_in_order() -> None:
    fwd = Forward()
    b, scheduler = batching.batcher(fwd)

    def request(base: int) -> list[float]:
        with scheduler.admit(5, coming=0, caller=f"c{base}") as r:
            return features(submit(b, r, *range(base, base + 5)))

    jobs = [gevent.spawn(request, base) for base in (0, 10, 20, 30, 40, 50)]
    gevent.joinall(jobs, raise_error=True)
    assert [job.value for job in jobs] == [[base + i for i in range(5)] for base in (0, 10, 20, 30, 40, 50)]
    assert max(fwd.sizes) > 1, "concurrent images were never batched together"
    assert len(fwd.threads) == 1, "the model must only ever run on one thread"
    b.stop()


def test_batches_never_exceed_max_batch_and_a_busy_model_lets_them_fill() -> None:
    fwd = Forward()
    fwd.gate.clear()
    b, scheduler = batching.batcher(fwd, max_batch=4)
    with scheduler.admit(13, coming=0) as r:
        results = submit(b, r, *range(13))
        until(lambda: fwd.sizes, what="the first forward started")
        fwd.gate.set()
        assert features(results) == list(range(13))
    assert fwd.sizes == [4, 4, 4, 1]
    b.stop()


def test_without_cross_request_batching_a_forward_holds_one_request() -> None:
    fwd = Forward()
    fwd.gate.clear()
    b, scheduler = batching.batcher(fwd, across_requests=False)
    with scheduler.admit(3, coming=0, caller="a") as a, scheduler.admit(3, coming=0, caller="b") as c:
        results = submit(b, a, 10, 11) + submit(b, c, 20, 21) + submit(b, a, 12)
        fwd.gate.set()
        features(results)
    assert all(len({v // 10 for v in values}) == 1 for values in fwd.values), fwd.values
    b.stop()


def test_a_failing_batch_fails_only_its_images_and_the_batcher_carries_on() -> None:
    fwd = Forward(fail_on=66)
    b, scheduler = batching.batcher(fwd, across_requests=False)
    with scheduler.admit(1, coming=0, caller="bad") as bad, scheduler.admit(3, coming=0, caller="good") as good:
        failed = submit(b, bad, 66)
        rows = submit(b, good, 1, 2)
        with pytest.raises(InferenceFailed):
            failed[0].get(timeout=5)
        assert features(rows) == [1, 2]
        assert features(submit(b, good, 3)) == [3]
    b.stop()


def test_images_past_their_deadline_or_of_a_cancelled_request_never_reach_the_model() -> None:
    fwd = Forward()
    fwd.gate.clear()
    b, scheduler = batching.batcher(fwd, max_batch=1)
    with scheduler.admit(4, coming=0, caller="a") as a:
        first = submit(b, a, 1)
        until(lambda: fwd.sizes, what="the first forward started")
        deadline = time.monotonic() + 0.01
        expired = b.submit(pixel(2), deadline, a)
        with pytest.raises(RuntimeError), scheduler.admit(2, coming=0, caller="gone") as gone:
            dropped = submit(b, gone, 3)
            raise RuntimeError("its client left")
        kept = submit(b, a, 4)
        until(lambda: time.monotonic() > deadline, what="the deadline passed while the model was busy")
        fwd.gate.set()
        assert features(first + kept) == [1, 4]
        with pytest.raises(DeadlineExceeded):
            expired.get(timeout=5)
    assert not dropped[0].ready() and fwd.values == [[1], [4]]
    b.stop()


def test_the_earlier_requests_images_go_first_whatever_order_they_arrive_in() -> None:
    fwd = Forward()
    fwd.gate.clear()
    b, scheduler = batching.batcher(fwd, max_batch=2)
    with scheduler.admit(1, coming=0, caller="x") as blocker:
        submit(b, blocker, 0)  # occupies the model while the rest queue up
        until(lambda: fwd.sizes, what="the first forward started")
        with scheduler.admit(2, coming=0, caller="e") as early, scheduler.admit(2, coming=0, caller="e") as late:
            rows = submit(b, late, 20, 21) + submit(b, early, 10, 11)  # "late" is tagged after "early"
            fwd.gate.set()
            features(rows)
    assert fwd.values == [[0], [10, 11], [20, 21]]
    b.stop()


class Plans:
    """Rules fixed by the test: every plan is ``plan``; records urgent forwards."""

    def __init__(self, plan: Callable[[Forming], BatchPlan]) -> None:
        self.plan = plan
        self.urgent: list[str] = []

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.urgent.append("begin")
        yield
        self.urgent.append("end")

    def rules(self) -> BatchRules:
        return BatchRules(self.plan, lambda running, left: Run(), lambda items: None, self.hold)


def fixed(fwd: Forward, plans: Plans) -> tuple[Batcher, Scheduler]:
    scheduler = batching.scheduler()
    b = Batcher(lambda _model, batch: fwd(batch), ThreadPool(1), scheduler.images, plans.rules())
    b.start()
    return b, scheduler


def test_a_batch_waits_for_more_until_its_plan_says_and_goes_with_what_came() -> None:
    wait_s = 0.2
    fwd = Forward()
    b, scheduler = fixed(fwd, Plans(lambda f: BatchPlan(8, None, f.started + wait_s)))
    with scheduler.admit(3, coming=0) as r:
        t0 = time.monotonic()
        first = submit(b, r, 1)
        quiet()
        second = submit(b, r, 2)  # well within the wait: it joins
        assert features(first + second) == [1, 2]
        waited = time.monotonic() - t0
    assert fwd.sizes == [2] and wait_s * 0.9 <= waited < wait_s * 5, waited
    b.stop()


def test_a_closed_plan_goes_at_once_and_an_urgent_one_runs_under_the_hold() -> None:
    fwd = Forward()
    fwd.gate.clear()
    plans = Plans(lambda f: BatchPlan(8, None, f.started + 60, urgent=True, closed=True))
    b, scheduler = fixed(fwd, plans)
    with scheduler.admit(3, coming=0) as r:
        rows = submit(b, r, 1)
        until(lambda: fwd.sizes, timeout_s=2, what="the forward started without waiting 60 s")
        rows += submit(b, r, 2)
        fwd.gate.set()
        assert features(rows) == [1, 2]
    assert fwd.sizes == [1, 1] and plans.urgent == ["begin", "end"] * 2
    b.stop()


def test_a_plans_others_run_on_their_own_before_the_batch_goes_on() -> None:
    fwd = Forward()
    scheduler = batching.scheduler()
    state = {"others": True}

    def plan(forming: Forming) -> BatchPlan:
        queued = [w for w in scheduler.images.waiting() if w.caller == "search"]
        if queued and state["others"]:
            return BatchPlan(8, None, forming.started + 5, others=Run(tuple(queued), urgent=True))
        return BatchPlan(8, None, forming.started) if len(forming.members) > 1 else BatchPlan(8, None, time.monotonic() + 5)

    plans = Plans(plan)
    b = Batcher(lambda _model, batch: fwd(batch), ThreadPool(1), scheduler.images, plans.rules())
    with scheduler.admit(2, coming=0, caller="album") as album, scheduler.admit(1, coming=0, caller="search") as s:
        album_rows = submit(b, album, 1)
        search_rows = submit(b, s, 100)
        b.start()
        assert features(search_rows) == [100]
        album_rows += submit(b, album, 2)
        assert features(album_rows) == [1, 2]
    assert fwd.values == [[100], [1, 2]] and plans.urgent == ["begin", "end"]
    b.stop()


def test_a_gathering_batch_goes_as_soon_as_nothing_more_is_on_its_way() -> None:
    """With the real rules on every core, a request's batch waits for its images; once the last one has
    settled (reached the queue or failed), the batch goes without waiting out the gap."""
    fwd = Forward()
    b, scheduler = batching.batcher(fwd)
    with scheduler.admit(3, caller="album") as album:
        with album.image():
            rows = submit(b, album, 1)
        quiet()
        assert not rows[0].ready()
        with album.image():
            rows += submit(b, album, 2)
        with album.image():  # the third failed on its way
            pass
        assert features(rows) == [1, 2]
    assert fwd.sizes == [2]
    b.stop()


def test_a_streamed_requests_first_row_goes_alone_under_the_hold_and_the_rest_gather() -> None:
    fwd = Forward()
    b, scheduler = batching.batcher(fwd)
    with scheduler.admit(4, caller="album", streamed=True) as album:
        with album.image():
            first = submit(b, album, 1)
        assert features(first) == [1]
        assert scheduler.urgency.ended > 0, "its forward was urgent"
        rows: list[AsyncResult] = []
        for v in (2, 3, 4):
            with album.image():
                rows += submit(b, album, v)
        assert features(rows) == [2, 3, 4]
    assert fwd.sizes == [1, 3]
    b.stop()
