"""Micro-batching with a real gevent ThreadPool(1) and a fake forward: routing, grouping, failures, deadlines."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import gevent
import numpy as np
import pytest
from gevent.threadpool import ThreadPool

from service.engine import batcher
from service.engine.batcher import Batcher, Row
from service.engine.scheduling import Gather
from service.errors import DeadlineExceeded, InferenceFailed


class Forward:
    """Row i's output encodes image i's pixel value, so misrouting is visible."""

    def __init__(self, delay_s: float = 0.01, fail_on: int | None = None) -> None:
        self.delay_s, self.fail_on = delay_s, fail_on
        self.sizes: list[int] = []
        self.threads: set[int] = set()

    def __call__(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.threads.add(threading.get_ident())
        self.sizes.append(len(batch))
        time.sleep(self.delay_s)  # native: the hub keeps running
        values = batch[:, 0, 0, 0].astype(np.float32)
        if self.fail_on is not None and self.fail_on in values:
            raise RuntimeError("bad batch")
        return values[:, None].repeat(2, axis=1), values[:, None]


class Request:
    """A request as the batcher sees it (the runner's ``Admission``)."""

    def __init__(self, upstream: int = 0) -> None:
        self.upstream = upstream
        self.cancelled = False

    def first_at_once(self) -> bool:
        return False


class Policy:
    """A scheduling answer fixed by the test (the real one is ``scheduling.Scheduler``)."""

    def __init__(self, upstream: Callable[[], int], gather: Gather = Gather.NO) -> None:
        self._upstream, self._gather = upstream, gather
        self.taken_calls = 0
        self.urgent_calls: list[bool] = []

    def upstream(self) -> int:
        return self._upstream()

    def gather(self) -> Gather:
        return self._gather

    def taken(self, tag: float) -> None:
        self.taken_calls += 1

    def batch_cap(self, seconds_per_image: float) -> int | None:
        return None

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        self.urgent_calls.append(True)
        yield
        self.urgent_calls.append(False)


def pixel(v: int) -> np.ndarray:
    return np.full((2, 2, 3), v, np.uint8)


def make(forward: Forward, **kw: object) -> Batcher:
    b = Batcher(forward, ThreadPool(1), **{"max_batch": 8, "max_wait_s": 0.005, **kw})  # type: ignore[arg-type]
    b.start()
    return b


def test_concurrent_requests_get_their_own_rows_in_order() -> None:
    fwd = Forward()
    b = make(fwd)

    def request(base: int) -> list[float]:
        group = Request()
        results = [b.submit(pixel(base + i), admission=group) for i in range(5)]
        return [r.get().features[0] for r in results]

    jobs = [gevent.spawn(request, base) for base in (0, 10, 20, 30, 40, 50)]
    gevent.joinall(jobs, raise_error=True)
    for base, job in zip((0, 10, 20, 30, 40, 50), jobs, strict=True):
        assert job.value == [base + i for i in range(5)]
    assert max(fwd.sizes) > 1, "concurrent images were never batched together"
    assert len(fwd.threads) == 1, "the model must only ever run on one thread"
    b.stop()


def test_batches_never_exceed_max_batch() -> None:
    fwd = Forward()
    b = make(fwd, max_batch=4)
    gevent.joinall([gevent.spawn(lambda v=v: b.submit(pixel(v)).get()) for v in range(30)], raise_error=True)
    assert max(fwd.sizes) <= 4 and sum(fwd.sizes) == 30
    b.stop()


def test_without_cross_request_batching_a_forward_holds_one_request() -> None:
    fwd = Forward()
    b = make(fwd, across_requests=False, max_wait_s=0.0)
    seen: list[set[int]] = []
    original = fwd.__call__

    def spy(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seen.append({int(v) // 10 for v in batch[:, 0, 0, 0]})
        return original(batch)

    b._run_batch = spy  # type: ignore[method-assign]
    def request(base: int) -> list[Row]:
        group = Request()
        return [r.get() for r in [b.submit(pixel(base + i), admission=group) for i in range(3)]]

    jobs = [gevent.spawn(request, base) for base in (10, 20, 30)]
    gevent.joinall(jobs, raise_error=True)
    assert all(len(groups) == 1 for groups in seen)
    b.stop()


def test_failing_batch_fails_only_its_images_and_the_batcher_carries_on() -> None:
    fwd = Forward(fail_on=66)
    b = make(fwd, across_requests=False, max_wait_s=0.0)
    bad = [b.submit(pixel(66), admission=Request())]
    good_request = Request()
    good = [b.submit(pixel(v), admission=good_request) for v in (1, 2)]
    with pytest.raises(InferenceFailed):
        bad[0].get()
    assert [r.get().features[0] for r in good] == [1, 2]
    assert b.submit(pixel(3)).get().features[0] == 3
    b.stop()


def test_expired_images_are_dropped_before_the_model() -> None:
    fwd = Forward(delay_s=0.2)
    b = make(fwd, max_batch=1)
    first = b.submit(pixel(1))
    expired = b.submit(pixel(2), deadline=time.monotonic() + 0.05)
    assert first.get().features[0] == 1
    with pytest.raises(DeadlineExceeded):
        expired.get()
    assert fwd.sizes == [1], "the expired image reached the model"
    b.stop()


def test_stats_track_per_image_time() -> None:
    fwd = Forward(delay_s=0.05)
    b = make(fwd)
    b.submit(pixel(1)).get()
    assert b.stats.batches == 1 and b.stats.seconds_per_image >= 0.04
    b.stop()


def test_earlier_requests_images_go_first_whatever_order_they_arrive_in() -> None:
    fwd = Forward(delay_s=0.05)
    b = make(fwd, max_batch=2, max_wait_s=0.0)
    blocker = b.submit(pixel(0), tag=0.0)  # occupies the model while the rest queue up
    gevent.sleep(0.01)
    late_request, early_request = Request(), Request()
    late = [b.submit(pixel(20 + i), admission=late_request, tag=2.0) for i in range(2)]
    early = [b.submit(pixel(10 + i), admission=early_request, tag=1.0) for i in range(2)]
    order: list[str] = []
    jobs = [gevent.spawn(lambda rs=rs, name=name: ([r.get() for r in rs], order.append(name)))
            for name, rs in (("late", late), ("early", early))]
    blocker.get()
    gevent.joinall(jobs, raise_error=True)
    assert order == ["early", "late"]


def test_nothing_upstream_means_no_wait_for_a_fuller_batch() -> None:
    fwd = Forward(delay_s=0)
    b = make(fwd, max_wait_s=5.0, policy=Policy(lambda: 0))
    t0 = time.monotonic()
    assert b.submit(pixel(3)).get(timeout=2).features[0] == 3
    assert time.monotonic() - t0 < 1.0, "a lone image waited for images that could not come"
    b.stop()


def test_images_still_upstream_are_waited_for_up_to_max_wait() -> None:
    fwd = Forward(delay_s=0)
    upstream = [1]
    b = make(fwd, max_wait_s=5.0, policy=Policy(lambda: upstream[0]))
    first = b.submit(pixel(1))
    gevent.sleep(0.05)
    upstream[0] = 0
    second = b.submit(pixel(2))
    assert (first.get(timeout=2).batch_size, second.get(timeout=2).batch_size) == (2, 2)
    b.stop()


def feed_one_request(b: Batcher, request: Request, n: int, gap_s: float) -> list:
    """Submit ``n`` images of ``request`` ``gap_s`` apart, settling each from its ``upstream`` as it goes."""

    def feed() -> list:
        results = []
        for i in range(n):
            request.upstream -= 1
            results.append(b.submit(pixel(i), admission=request))
            gevent.sleep(gap_s)
        return results

    return gevent.spawn(feed).get()


def test_gathering_batch_waits_past_max_wait_while_its_images_keep_arriving() -> None:
    """A lone worker's batch: a request's images arriving 20 ms apart (4x max_wait) go as one forward."""
    fwd = Forward(delay_s=0)
    request = Request(upstream=6)
    b = make(fwd, max_wait_s=0.005, policy=Policy(lambda: request.upstream, Gather.BRIDGE_GAPS))
    results = feed_one_request(b, request, 6, 0.02)
    assert [r.get(timeout=2).features[0] for r in results] == list(range(6))
    assert fwd.sizes == [6]
    b.stop()


def test_gathering_batch_goes_when_arrivals_stall() -> None:
    fwd = Forward(delay_s=0)
    b = make(fwd, max_wait_s=0.005, policy=Policy(lambda: 1, Gather.BRIDGE_GAPS))  # one image never comes
    t0 = time.monotonic()
    assert b.submit(pixel(4), admission=Request(upstream=1)).get(timeout=2).features[0] == 4
    waited = time.monotonic() - t0
    assert 0.03 < waited < 1.0, f"a stalled gather should wait about GATHER_GAP_S, waited {waited:.3f}s"
    b.stop()


def test_a_gathering_batch_goes_after_gather_max_s_however_busy_decode_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batcher, "GATHER_MAX_S", 0.2)
    fwd = Forward(delay_s=0)
    b = make(fwd, max_wait_s=0.005, policy=Policy(lambda: 1, Gather.WHILE_DECODING))
    t0 = time.monotonic()
    assert b.submit(pixel(4), admission=Request(upstream=1)).get(timeout=3).features[0] == 4
    waited = time.monotonic() - t0
    assert 0.15 < waited < 1.5, f"the gathering batch should go after GATHER_MAX_S, waited {waited:.3f}s"
    b.stop()


def test_a_stream_of_small_requests_is_not_held_back_by_gathering() -> None:
    """Only a batch whose own request has images on their way gathers: one-image requests arriving
    every 20 ms while others are always upstream each go after max_wait, not in one late batch."""
    fwd = Forward(delay_s=0)
    b = make(fwd, max_wait_s=0.005, policy=Policy(lambda: 1, Gather.BRIDGE_GAPS))

    def feed() -> list:
        results = []
        for i in range(5):
            results.append(b.submit(pixel(i), admission=Request(upstream=0)))
            gevent.sleep(0.02)
        return results

    results = gevent.spawn(feed).get()
    assert [r.get(timeout=2).features[0] for r in results] == list(range(5))
    assert max(fwd.sizes) <= 2, f"small requests were gathered into late batches: {fwd.sizes}"
    b.stop()


def test_a_request_with_images_on_their_way_gets_batches_of_its_own() -> None:
    """On a CPU an image costs the same in any batch: filling request A's batch with B's images while more
    of A's are coming would only delay A. Once nothing of A's is upstream, batches mix again."""
    fwd = Forward(delay_s=0.02)
    b = make(fwd, max_wait_s=0.005)
    a, later = Request(upstream=2), Request(upstream=0)
    b.submit(pixel(99)).get(timeout=2)  # warm: the next batch starts from an empty queue
    results = [b.submit(pixel(1), admission=a, tag=1.0), b.submit(pixel(2), admission=a, tag=1.0)]
    results += [b.submit(pixel(10 + i), admission=later, tag=2.0) for i in range(3)]
    assert [r.get(timeout=2).batch_size for r in results] == [2, 2, 3, 3, 3]
    a.upstream = 0
    mixed = [b.submit(pixel(3), admission=a, tag=1.0), b.submit(pixel(20), admission=later, tag=2.0)]
    assert [r.get(timeout=2).batch_size for r in mixed] == [2, 2]
    b.stop()


def test_while_decode_is_busy_a_gathering_batch_waits_out_longer_gaps() -> None:
    """Big photos decode slower than the gap: while the worker's decode threads are busy, the batch
    waits for its request's next image (up to GATHER_MAX_S); with decode idle it would have gone."""
    for gather, expected in ((Gather.WHILE_DECODING, [3]), (Gather.BRIDGE_GAPS, [1, 1, 1])):
        fwd = Forward(delay_s=0)
        request = Request(upstream=3)
        b = make(fwd, max_wait_s=0.005, policy=Policy(lambda request=request: request.upstream, gather))
        results = feed_one_request(b, request, 3, 0.12)
        assert [r.get(timeout=2).features[0] for r in results] == [0, 1, 2]
        assert fwd.sizes == expected, (gather, fwd.sizes)
        b.stop()


def test_a_cancelled_requests_queued_images_never_reach_the_model() -> None:
    fwd = Forward(delay_s=0.1)
    b = make(fwd, max_batch=2)
    running = [b.submit(pixel(1)), b.submit(pixel(2))]  # the first batch starts at once
    gevent.sleep(0.02)
    gone, other = Request(), Request()
    dropped = [b.submit(pixel(10 + i), admission=gone) for i in range(3)]
    kept = b.submit(pixel(20), admission=other)
    assert b.cancel(gone) == 3
    gone.cancelled = True
    assert [r.get(timeout=2).features[0] for r in running] == [1, 2]  # the running batch finishes
    assert kept.get(timeout=2).features[0] == 20
    assert all(not r.ready() for r in dropped)
    assert fwd.sizes == [2, 1]
    b.stop()


def test_a_request_cancelled_while_its_batch_gathers_is_left_out_of_the_forward() -> None:
    fwd = Forward()
    b = make(fwd, max_wait_s=0.2)
    request = Request(upstream=1)  # more of its images on their way: its batch waits for them
    first = b.submit(pixel(5), admission=request)
    gevent.sleep(0.05)
    request.cancelled = True
    request.upstream = 0
    b.wake()
    gevent.sleep(0.3)
    assert not first.ready() and fwd.sizes == []
    b.stop()
