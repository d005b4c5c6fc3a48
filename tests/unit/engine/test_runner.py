"""One worker's parts together (a fake model, the real threads, scheduler and batchers): the orders the rules
give hold up when images really decode, queue and run."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Sequence

import gevent
import numpy as np
import pytest
import torch
from gevent.event import AsyncResult
from torch import nn

from harness.fakes import FakeModel
from harness.polling import quiet, until
from service.engine.runner import Runner, limits
from service.engine.scheduling import Admission
from service.engine.types import ModelLoadError, Precision, Tokens, TowerChoice
from service.settings import Settings

PIXELS = np.zeros((32, 32, 3), np.uint8)


def test_a_batch_gathering_a_later_requests_images_goes_when_an_earlier_requests_images_wait() -> None:
    """One worker on every core gathers: the later request's first image leads a batch that waits for its
    second, whose decode is held back by the earlier request's waiting images. The batch must go (and the
    earlier request be served first), not wait for an image that cannot come."""
    runner = Runner(Settings(workers=1, decode_threads=2), model=FakeModel(), cores=2)
    done: list[str] = []

    def image(admission: Admission, index: int) -> None:
        with admission.image():
            crop = runner.decode(PIXELS.copy, admission=admission, index=index)
            result = runner.infer(crop, None, admission)
        result.get(timeout=5)
        done.append(f"{admission.arrived:.0f}/{index}")

    runner.batcher.start()
    try:
        with runner.admit(2, arrived=1.0, caller="c") as earlier, runner.admit(2, arrived=2.0, caller="c") as later:
            first = gevent.spawn(image, later, 0)
            until(lambda: later.upstream == 1, what="the later request's first image queued")
            rest = [gevent.spawn(image, earlier, i) for i in range(2)]
            quiet()
            rest.append(gevent.spawn(image, later, 1))
            gevent.joinall([first, *rest], raise_error=True, timeout=5)
        assert sorted(done) == ["1/0", "1/1", "2/0", "2/1"]
        assert done.index("1/1") < done.index("2/1")
    finally:
        runner.batcher.stop()


def test_a_light_callers_image_goes_between_a_heavy_callers_batches() -> None:
    """A heavy request with all its images on the way holds batches of its own; the light caller's one
    image must be in the next batch, not after the heavy request's 24."""
    model = FakeModel()
    gate, started = threading.Event(), []
    forward = model.forward
    model.forward = lambda batch: (started.append(len(batch)), gate.wait(5), forward(batch))[2]  # type: ignore[method-assign]
    runner = Runner(Settings(workers=1, max_batch=4, preempt_forwards=False), model=model, cores=2)
    order: list[str] = []

    def image(admission: Admission, name: str) -> None:
        with admission.image():
            result = runner.infer(PIXELS, None, admission)
        result.get(timeout=10)
        order.append(name)

    runner.batcher.start()
    try:
        with runner.admit(24, caller="heavy") as heavy:
            jobs = [gevent.spawn(image, heavy, f"heavy {i}") for i in range(24)]
            until(lambda: started, what="the heavy caller's first forward started")
            with runner.admit(1, caller="light") as light:
                jobs.append(gevent.spawn(image, light, "light"))
                quiet()
                gate.set()
                gevent.joinall(jobs, raise_error=True, timeout=10)
        # the running batch (4), then the one formed meanwhile (at most 4): by then it must have gone
        assert order.index("light") <= 4 + 4, order
    finally:
        runner.batcher.stop()


class TextTowerModel(FakeModel):
    """FakeModel with a text tower: a text's embedding is its token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.info = dataclasses.replace(self.info, towers=("image", "text"), context_length=4)

    def tokenize(self, texts: Sequence[str]) -> Tokens:
        n = len(texts)
        return Tokens(np.arange(n * 4, dtype=np.int64).reshape(n, 4), (4,) * n, (False,) * n)

    def encode_text(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(ids.astype(np.float32))


def test_texts_run_in_batches_of_their_own_on_the_one_inference_thread() -> None:
    model = TextTowerModel()
    runner = Runner(Settings(max_batch_wait_ms=1), model=model)
    runner.start()
    try:
        ids = runner.tokenize(["a dog", "a cat"]).ids
        with runner.admit(1, coming=0) as admission:
            texts: list[AsyncResult] = [runner.infer_text(row, None, admission) for row in ids]
            image = runner.infer(PIXELS, None, admission)
            rows = [t.get(timeout=5) for t in texts]
            image.get(timeout=5)
        assert [r.batch_size for r in rows] == [2, 2] and model.batches == [1]  # the image's forward held no text
        assert np.array_equal(rows[1].features, ids[1].astype(np.float32))
        assert len(model.threads) == 1
    finally:
        runner.close(5)


def test_the_switches_the_rules_read_reach_them_off_as_well_as_on() -> None:
    """What ``across_requests`` and ``interject`` off decide is in test_rules' rows (test_members,
    test_interjection, test_others_now); here the settings carry them there."""
    on = limits(Settings(), decode_threads=2)
    off = limits(Settings(batch_across_requests=False, preempt_forwards=False), decode_threads=2)
    assert (on.across_requests, on.interject) == (True, True)
    assert (off.across_requests, off.interject) == (False, False)


def test_the_rules_read_each_models_image_forward_costs_from_its_precision_trial() -> None:
    """The gather's stop on a share (``rules.share_stop``) reads what the model's trial timed: here, in the view."""
    timed = FakeModel()
    image = TowerChoice("image", "bfloat16 cast once", "timed", (1, 8, 32), ms=(41.0, 112.0, 416.0))
    timed.info = dataclasses.replace(timed.info, precision=Precision("auto", "bfloat16", "cpu amx_bf16", "", (image,)))
    assert Runner(Settings(), model=timed).scheduling.view().image_costs == {"fake": {1: 41.0, 8: 14.0, 32: 13.0}}
    assert Runner(Settings(), model=FakeModel()).scheduling.view().image_costs == {}  # untimed: the fixed stop


@pytest.mark.parametrize(("preempt", "hooked"), [(True, True), (False, False)])
def test_a_model_gets_preemption_points_only_while_forwards_are_preempted(preempt: bool, hooked: bool) -> None:
    model = FakeModel()
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model.module = module  # type: ignore[attr-defined]  # as ``LoadedModel.module``
    runner = Runner(Settings(workers=1, preempt_forwards=preempt), loader=lambda: model, cores=1)
    runner.start()
    try:
        until(lambda: runner.ready, what="the model loaded")
        assert any(layer._forward_pre_hooks for layer in module) is hooked
    finally:
        runner.close(5)


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux")
@pytest.mark.parametrize("compute_nice", [10, 0])
def test_compute_nice_puts_decode_below_the_model_below_the_hub_and_0_leaves_them_alike(compute_nice: int) -> None:
    hub = _nice()
    model = FakeModel()
    seen: list[int] = []
    forward = model.forward
    model.forward = lambda batch: (seen.append(_nice()), forward(batch))[1]  # type: ignore[method-assign]
    runner = Runner(Settings(workers=1, compute_nice=compute_nice), model=model, cores=1)
    runner.start()
    try:
        decode = runner.offload(_nice)
        with runner.admit(1, coming=0) as admission:
            runner.infer(PIXELS, None, admission).get(timeout=5)
        assert (decode - hub, seen[0] - hub) == (min(19, hub + compute_nice) - hub, min(19, hub + compute_nice // 2) - hub)
    finally:
        runner.close(5)


def test_a_load_no_retry_fixes_is_fatal_and_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """The settings name a model or weights that cannot load (``ModelLoadError``): the worker ends the server
    with it (``Runner.fatal_error``), and its message is the one line logged, without a traceback."""
    def missing() -> FakeModel:
        raise ModelLoadError("open_clip:ViT-B-32 pretrained 'laion2b_s34b_b79k' is not in the local cache; run ...")

    runner = Runner(Settings(), loader=missing, cores=1)
    runner.start()
    try:
        until(lambda: runner.load_error is not None, what="the load failed")
    finally:
        runner.close(5)
    assert runner.fatal_error is runner.load_error and not runner.ready
    [record] = [r for r in caplog.records if r.levelname == "CRITICAL"]
    assert record.getMessage().startswith("cannot serve resnet50: open_clip:ViT-B-32 pretrained") and record.exc_info is None


def test_any_other_failed_load_is_not_fatal() -> None:
    def broken() -> FakeModel:
        raise RuntimeError("CUDA error: out of memory")

    runner = Runner(Settings(), loader=broken, cores=1)
    runner.start()
    try:
        until(lambda: runner.load_error is not None, what="the load failed")
    finally:
        runner.close(5)
    assert runner.fatal_error is None and isinstance(runner.load_error, RuntimeError)
