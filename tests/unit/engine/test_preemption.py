"""Preempted forwards: a short forward runs between the blocks of a long one (a real torch module on a real
gevent ThreadPool(1)), and the batcher offers other callers' images to the running forward."""

from __future__ import annotations

import threading
from typing import Any

import gevent
import numpy as np
import pytest
import torch
from gevent.threadpool import ThreadPool
from torch import nn

from harness import batching
from harness.polling import quiet, until
from service.engine.preemption import Preemption


class Step(nn.Module):
    """A block that adds 1, logs its name and, while ``gate`` is clear, waits for it (the test steps the
    forward through its blocks)."""

    def __init__(self, name: str, log: list[str], gate: threading.Event) -> None:
        super().__init__()
        self.name, self.log, self.gate = name, log, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(self.name)
        self.gate.wait(5)
        return x + 1


class Stepped:
    """A model of ``n`` gated blocks; ``log`` says which block runs (and what ran between them)."""

    def __init__(self, n: int) -> None:
        self.log: list[str] = []
        self.gate = threading.Event()
        self.model = nn.Sequential(*[Step(f"block {i}", self.log, self.gate) for i in range(n)])

    def inside(self, name: str) -> None:
        until(lambda: name in self.log, what=f"{name} started")


def test_an_offer_runs_at_the_next_block_and_the_long_forward_goes_on_unchanged() -> None:
    net = Stepped(6)
    preemption = Preemption()
    assert preemption.install(net.model) == 6
    pool = ThreadPool(1)
    x = torch.zeros(3)
    preemption.expect()
    long = gevent.spawn(pool.apply, preemption.run, (net.model, x))
    net.inside("block 0")
    job = preemption.offer(lambda: net.log.append("interjected") or threading.get_ident())
    assert job is not None
    net.gate.set()
    thread = job.get(timeout=5)
    out, spent = long.get(timeout=5)
    assert torch.equal(out, x + 6)  # the long forward's activations were kept across the interjection
    assert net.log.index("interjected") + 1 == net.log.index("block 1")  # at the next point, before block 1
    assert thread not in (threading.get_ident(), None), "the interjection must run on the inference thread"
    assert spent >= 0


def test_an_offer_after_the_last_point_runs_as_the_forward_ends() -> None:
    net = Stepped(1)
    model = nn.Sequential(nn.Identity(), net.model)
    preemption = Preemption()
    preemption.install(model)
    pool = ThreadPool(1)
    preemption.expect()
    long = gevent.spawn(pool.apply, preemption.run, (model, torch.zeros(1)))
    net.inside("block 0")  # past the last point: inside the last block
    job = preemption.offer(lambda: "late")
    assert job is not None
    net.gate.set()
    assert job.get(timeout=2) == "late"
    long.get(timeout=2)


def test_offers_are_refused_while_no_forward_runs_or_one_is_pending_and_errors_reach_the_waiter() -> None:
    net = Stepped(4)
    preemption = Preemption()
    preemption.install(net.model)
    assert preemption.offer(lambda: 1) is None  # nothing running
    pool = ThreadPool(1)
    preemption.expect()
    long = gevent.spawn(pool.apply, preemption.run, (net.model, torch.zeros(1)))
    first = preemption.offer(lambda: 1 / 0)
    assert first is not None
    assert preemption.offer(lambda: 2) is None  # one at a time
    net.gate.set()
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


class SteppedForward:
    """The batcher's forward through gated blocks; records each forward's values."""

    def __init__(self, preemption: Preemption, n_blocks: int = 8) -> None:
        self.net = Stepped(n_blocks)
        preemption.install(self.net.model)
        self.n_blocks = n_blocks
        self.batches: list[list[int]] = []
        self.thread = 0  # the inference thread that ran the last forward

    def __call__(self, batch: np.ndarray) -> tuple[Any, Any]:
        self.thread = threading.get_ident()
        values = batch[:, 0, 0, 0].astype(np.float32)
        self.batches.append([int(v) for v in values])
        out = self.net.model(torch.from_numpy(values)).numpy() - self.n_blocks  # each block added 1
        return out[:, None].repeat(2, axis=1), out[:, None]


def pixel(v: int) -> np.ndarray:
    return np.full((2, 2, 3), v, np.uint8)


def preempting(n_blocks: int = 8, **limits: Any) -> tuple[Any, Any, SteppedForward]:
    preemption = Preemption()
    forward = SteppedForward(preemption, n_blocks)
    b, scheduler = batching.batcher(forward, preemption=preemption, **limits)
    return b, scheduler, forward


def test_another_callers_image_runs_inside_an_albums_forward_and_a_callers_own_next_image_waits() -> None:
    b, scheduler, forward = preempting()
    with scheduler.admit(7, coming=0, caller="backfill") as album, \
            scheduler.admit(1, coming=0, caller="search") as search:
        rows = [b.submit(pixel(i), None, album) for i in range(6)]
        forward.net.inside("block 0")  # the album's forward is running
        later_album = b.submit(pixel(50), None, album)
        one = b.submit(pixel(100), None, search)
        quiet()  # offered to the running forward
        forward.net.gate.set()
        assert one.get(timeout=2).features[0] == 100
        assert [r.get(timeout=2).features[0] for r in rows] == list(range(6))  # rows routed right after it
        assert later_album.get(timeout=2).features[0] == 50
    assert forward.batches == [list(range(6)), [100], [50]]  # the album's own next image did not cut in
    assert scheduler.urgency.ended > 0, "the interjected forward was urgent"
    b.stop()


def test_other_callers_get_at_most_as_many_images_as_the_running_forward_holds() -> None:
    b, scheduler, forward = preempting(n_blocks=20)
    with scheduler.admit(2, coming=0, caller="a") as a:
        rows = [b.submit(pixel(i), None, a) for i in range(2)]
        forward.net.inside("block 0")
        others = []
        for i in range(5):
            with scheduler.admit(1, coming=0, caller=f"c{i}") as c:
                others.append((c, b.submit(pixel(10 + i), None, c)))
        quiet()  # offered to the running forward
        forward.net.gate.set()
        for _, row in others:
            row.get(timeout=5)
        assert [r.get(timeout=5).features[0] for r in rows] == [0, 1]
    # two of the five ran inside the 2-image forward; the rest waited for it to end
    assert forward.batches[0] == [0, 1] and [len(batch) for batch in forward.batches[1:]] == [2, 3]
    assert sorted(v for batch in forward.batches[1:] for v in batch) == [10, 11, 12, 13, 14]
    b.stop()


def test_while_an_album_gathers_its_images_a_light_callers_image_runs_at_once() -> None:
    b, scheduler, forward = preempting(n_blocks=2)
    forward.net.gate.set()
    with scheduler.admit(6, caller="album") as album:
        with album.image():  # one of six here: its batch gathers the rest
            first = b.submit(pixel(1), None, album)
        with scheduler.admit(1, caller="search") as search:
            with search.image():
                one = b.submit(pixel(100), None, search)
            assert one.get(timeout=2).features[0] == 100
        assert not first.ready()
        for _ in range(5):
            with album.image():
                pass  # the rest failed on their way
        assert first.get(timeout=3).features[0] == 1
    assert forward.batches == [[100], [1]]
    b.stop()


def test_a_text_batch_runs_between_the_blocks_of_a_running_image_forward() -> None:
    """A search does not wait for an album's forward: the text batcher offers its batch to the running one."""
    from gevent.threadpool import ThreadPool

    from service.engine.batcher import Batcher

    b, scheduler, forward = preempting(n_blocks=8)
    texts: list[int] = []

    def encode(_model: str, ids: np.ndarray) -> tuple[Any, Any]:
        texts.append(threading.get_ident())
        forward.net.log.append("text")
        return ids.astype(np.float32), None

    offers = b._preemption  # the worker's one Preemption
    text_batcher = Batcher(encode, ThreadPool(1), scheduler.texts, scheduler.text_rules(), offers=offers)
    text_batcher.start()
    with scheduler.admit(6, coming=0, caller="backfill") as album, \
            scheduler.admit(1, coming=0, caller="search") as search:
        rows = [b.submit(pixel(i), None, album) for i in range(6)]
        forward.net.inside("block 0")  # the album's forward is running, held at its first block
        query = text_batcher.submit(np.arange(4, dtype=np.int64), None, search)
        quiet()  # offered to the running forward
        forward.net.gate.set()
        assert query.get(timeout=5).features.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert [r.get(timeout=5).features[0] for r in rows] == list(range(6))
    text_batcher.stop()
    b.stop()
    # on the album forward's own thread, at its next point: not after it, not on the text batcher's thread
    assert texts == [forward.thread] and forward.net.log.index("text") + 1 == forward.net.log.index("block 1")
