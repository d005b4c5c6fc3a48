"""Preempted forwards: a short forward runs between the blocks of a long one (a real torch module on a real
gevent ThreadPool(1)), and the batcher offers another caller's images to the running forward."""

from __future__ import annotations

import threading
import time
from typing import Any

import gevent
import numpy as np
import pytest
import torch
from gevent.threadpool import ThreadPool
from torch import nn

from service.engine.batcher import Batcher
from service.engine.preemption import Preemption
from tests.test_batcher import Request, pixel


class Slow(nn.Module):
    """A block that takes ``seconds`` an item (a native sleep: the hub runs meanwhile) and adds 1."""

    def __init__(self, seconds: float, log: list[str] | None = None, name: str = "") -> None:
        super().__init__()
        self.seconds, self.log, self.name = seconds, log, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.log is not None:
            self.log.append(self.name)
        time.sleep(self.seconds * len(x))
        return x + 1


def blocks(n: int, seconds: float, log: list[str] | None = None) -> nn.Sequential:
    return nn.Sequential(*[Slow(seconds, log, f"block {i}") for i in range(n)])


def test_an_offer_runs_at_the_next_block_and_the_long_forward_goes_on_unchanged() -> None:
    log: list[str] = []
    model = blocks(6, 0.02, log)
    preemption = Preemption()
    assert preemption.install(model) == 6
    pool = ThreadPool(1)
    x = torch.zeros(3)
    preemption.expect()
    long = gevent.spawn(pool.apply, preemption.run, (model, x))
    gevent.sleep(0.09)  # inside block 1 (60 ms a block)
    offered = time.monotonic()
    job = preemption.offer(lambda: log.append("interjected") or threading.get_ident())
    assert job is not None
    thread = job.get()
    waited = time.monotonic() - offered
    out, spent = long.get(timeout=5)
    assert torch.equal(out, x + 6)  # the long forward's activations were kept across the interjection
    assert log.index("interjected") + 1 == log.index("block 2")  # at the next point, before block 2 runs
    assert waited < 0.2, f"the offer waited {waited:.2f}s: the whole forward, not a block"
    assert thread not in (threading.get_ident(), None), "the interjection must run on the inference thread"
    assert 0 <= spent < 0.05


def test_an_offer_after_the_last_point_runs_as_the_forward_ends() -> None:
    model = nn.Sequential(nn.Identity(), Slow(0.2))
    preemption = Preemption()
    preemption.install(model)
    pool = ThreadPool(1)
    preemption.expect()
    long = gevent.spawn(pool.apply, preemption.run, (model, torch.zeros(1)))
    gevent.sleep(0.05)  # past the last point: inside the slow block
    job = preemption.offer(lambda: "late")
    assert job is not None
    assert job.get(timeout=2) == "late"
    assert long.dead or long.get(timeout=2)


def test_offers_are_refused_while_no_forward_runs_or_one_is_pending_and_errors_reach_the_waiter() -> None:
    model = blocks(4, 0.05)
    preemption = Preemption()
    preemption.install(model)
    assert preemption.offer(lambda: 1) is None  # nothing running
    pool = ThreadPool(1)
    preemption.expect()
    long = gevent.spawn(pool.apply, preemption.run, (model, torch.zeros(1)))
    first = preemption.offer(lambda: 1 / 0)
    assert first is not None
    assert preemption.offer(lambda: 2) is None  # one at a time
    with pytest.raises(ZeroDivisionError):
        first.get(timeout=2)
    out, _ = long.get(timeout=2)
    assert torch.equal(out, torch.full((1,), 4.0))
    assert preemption.offer(lambda: 3) is None  # ended


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_a_scripted_model_has_no_points() -> None:
    model = torch.jit.script(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    preemption = Preemption()
    assert preemption.install(model) == 0
    preemption.expect()
    assert preemption.offer(lambda: 1) is None


class Caller(Request):
    def __init__(self, caller: str, upstream: int = 0) -> None:
        super().__init__(upstream)
        self.caller = caller


class SlowForward:
    """The batcher's forward through a real module of slow blocks; records each forward's values."""

    def __init__(self, preemption: Preemption, n_blocks: int = 8, seconds: float = 0.01) -> None:
        self.model = blocks(n_blocks, seconds)
        preemption.install(self.model)
        self.n_blocks = n_blocks
        self.batches: list[list[int]] = []

    def __call__(self, batch: np.ndarray) -> tuple[Any, Any]:
        values = batch[:, 0, 0, 0].astype(np.float32)
        self.batches.append([int(v) for v in values])
        out = self.model(torch.from_numpy(values)).numpy() - self.n_blocks  # each block added 1
        return out[:, None].repeat(2, axis=1), out[:, None]


def preempting(n_blocks: int = 8, seconds: float = 0.01, **kw: Any) -> tuple[Batcher, SlowForward]:
    preemption = Preemption()
    forward = SlowForward(preemption, n_blocks, seconds)
    b = Batcher(forward, ThreadPool(1), max_batch=8, max_wait_s=0.005, preemption=preemption, **kw)
    b.start()
    return b, forward


def test_another_callers_image_runs_inside_an_albums_forward_and_a_callers_own_next_image_waits() -> None:
    from tests.test_batcher import Policy

    policy = Policy(lambda: 0)
    b, forward = preempting(policy=policy)
    album, search = Caller("backfill"), Caller("search")
    rows = [b.submit(pixel(i), admission=album, tag=float(i)) for i in range(6)]
    gevent.sleep(0.05)  # the album's forward (8 blocks x 6 images x 10 ms) is running
    later_album = b.submit(pixel(50), admission=Caller("backfill"), tag=6.0)
    t0 = time.monotonic()
    one = b.submit(pixel(100), admission=search, tag=7.0)
    assert one.get(timeout=2).features[0] == 100
    waited = time.monotonic() - t0
    assert not rows[0].ready(), "the search caller's row should come before the album's"
    assert waited < 0.2, f"{waited:.2f}s: it waited for the album's forward"
    assert [r.get(timeout=2).features[0] for r in rows] == list(range(6))  # rows routed right after it
    assert later_album.get(timeout=2).features[0] == 50
    assert forward.batches == [list(range(6)), [100], [50]]  # the album's own next image did not cut in
    assert policy.urgent_calls == [True, False], "only the interjected forward is urgent (decodes and reads wait)"
    b.stop()


def test_other_callers_get_at_most_as_many_images_as_the_running_forward_holds() -> None:
    b, forward = preempting(n_blocks=20, seconds=0.01)
    rows = [b.submit(pixel(i), admission=Caller("a"), tag=float(i)) for i in range(2)]
    gevent.sleep(0.03)
    others = [b.submit(pixel(10 + i), admission=Caller(f"c{i}"), tag=2.0 + i) for i in range(5)]
    assert [r.get(timeout=5).features[0] for r in rows + others] == [0, 1, 10, 11, 12, 13, 14]
    # two of the five ran inside the 2-image forward, in fair order; the rest waited for it to end
    assert forward.batches == [[0, 1], [10, 11], [12, 13, 14]]
    b.stop()


def test_while_an_album_gathers_its_images_another_callers_image_runs_at_once() -> None:
    from service.engine.scheduling import Gather
    from tests.test_batcher import Policy

    album = Caller("album", upstream=5)  # more of its images on their way: its batch gathers
    policy = Policy(lambda: 5, Gather.WHILE_DECODING)
    b, forward = preempting(n_blocks=2, seconds=0.005, policy=policy)
    first = b.submit(pixel(1), admission=album, tag=0.0)
    gevent.sleep(0.05)
    t0 = time.monotonic()
    one = b.submit(pixel(100), admission=Caller("search"), tag=1.0)
    assert one.get(timeout=2).features[0] == 100
    assert time.monotonic() - t0 < 0.3 and not first.ready()
    album.upstream = 0
    b.wake()
    assert first.get(timeout=3).features[0] == 1
    assert forward.batches == [[100], [1]]
    assert policy.urgent_calls == [True, False], "the one-photo forward is urgent; the album's is not"
    b.stop()
