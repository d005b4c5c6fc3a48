"""Running out of device memory: the batch is split and its halves retried; an image that does not fit alone
gets 503 out_of_memory with Retry-After, the rest their rows, and the worker keeps serving.

The allocator failures here are real (torch's CPU allocator refusing a huge tensor, raised inside the
model's forward); a CUDA out-of-memory takes the same path (``torch.OutOfMemoryError``, then
``torch.cuda.empty_cache``), and ``bench/gpu_check.py`` measures it on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from harness import batching
from harness.fakes import BASE, FakeFetcher
from harness.images import solid
from service.app import create_app
from service.engine.model import LoadedModel
from service.engine.types import BatchOutputs, ModelInfo, Row, Transform
from service.errors import OutOfMemory
from service.settings import Settings

TOO_BIG = 1 << 50  # bytes: no allocator grants this


class Greedy(nn.Module):
    """Needs memory that grows with the batch: more than ``fits`` images ask the allocator for the
    impossible, and so does any image whose mean brightness is above ``hopeless_above``."""

    def __init__(self, fits: int, hopeless_above: float = 256.0) -> None:
        super().__init__()
        self.fits, self.hopeless_above = fits, hopeless_above
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.sizes.append(len(x))
        brightness = x.mean(dim=(1, 2, 3)) * 0.229 * 255 + 0.45 * 255  # roughly undo the normalisation
        if len(x) > self.fits or bool((brightness > self.hopeless_above).any()):
            torch.empty(TOO_BIG, dtype=torch.uint8)
        feats = x.mean(dim=(2, 3))
        return feats, feats[:, :2]


def loaded(module: nn.Module) -> LoadedModel:
    info = ModelInfo("greedy", ("embeddings", "classify"), 3, ("a", "b"), "cpu", "float32", "random",
                     Transform(8, 8))
    return LoadedModel(info=info, module=module, device=torch.device("cpu"), channels_last=False)


def crops(values: list[int]) -> list[np.ndarray]:
    return [np.full((8, 8, 3), v, np.uint8) for v in values]


def test_the_models_forward_turns_an_allocator_failure_into_out_of_memory() -> None:
    model = loaded(Greedy(fits=2))
    with pytest.raises(OutOfMemory) as caught:
        model.forward(np.stack(crops([1, 2, 3])))
    assert caught.value.status_code == 503 and caught.value.headers["Retry-After"] == "2"
    assert "ran out of memory" in caught.value.message
    assert model.forward(np.stack(crops([1, 2])))[0] is not None  # and it still runs what fits


def test_another_runtime_error_is_not_taken_for_memory() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        loaded(Broken()).forward(np.stack(crops([1])))


def run_through_batcher(model: LoadedModel, values: list[int]) -> list[Row | BaseException]:
    b, scheduler = batching.batcher(model.forward, max_batch=len(values), max_wait_s=0.05, start=False)
    with scheduler.admit(len(values), coming=0) as request:
        results = [b.submit(c, None, request) for c in crops(values)]
    b.start()
    try:
        out: list[Row | BaseException] = []
        for r in results:
            try:
                out.append(r.get(timeout=30))
            except OutOfMemory as exc:
                out.append(exc)
        return out
    finally:
        b.stop()


def test_a_batch_that_does_not_fit_is_split_until_its_halves_do() -> None:
    greedy = Greedy(fits=2)
    values = [10, 20, 30, 40, 50, 60, 70, 80]
    rows = run_through_batcher(loaded(greedy), values)
    assert greedy.sizes == [8, 4, 2, 2, 4, 2, 2]
    reference = loaded(Greedy(fits=99)).forward(np.stack(crops(values)))[0]
    assert reference is not None
    for i, row in enumerate(rows):
        assert isinstance(row, Row) and row.batch_size == 8
        np.testing.assert_allclose(row.features, reference[i].numpy(), rtol=1e-6)  # its own row, not a neighbour's


def test_an_image_that_fails_alone_gets_503_and_the_others_their_rows() -> None:
    rows = run_through_batcher(loaded(Greedy(fits=4, hopeless_above=200)), [10, 250, 30, 40])
    assert isinstance(rows[1], OutOfMemory) and rows[1].code == "out_of_memory"
    assert all(isinstance(r, Row) for i, r in enumerate(rows) if i != 1)


def test_over_http_the_hopeless_image_is_503_with_retry_after_and_the_worker_answers_after() -> None:
    fetcher = FakeFetcher({BASE + f"g{v}.png": solid(v) for v in (10, 100, 250)})
    model = loaded(Greedy(fits=1, hopeless_above=200))
    client = create_app(Settings(image_base_url=BASE, max_images=8), model=model, fetcher=fetcher).test_client()
    r = client.post("/v1/embeddings", json={"images": ["g10.png", "g250.png", "g100.png"]})
    assert r.status_code == 503 and r.headers["Retry-After"] == "2"
    assert r.json["error"]["code"] == "out_of_memory" and "ran out of memory" in r.json["error"]["message"]
    ok = client.post("/v1/embeddings", json={"images": ["g10.png", "g100.png"]})  # split to 1 + 1, both fit
    assert ok.status_code == 200 and len(ok.json["data"]) == 2


def test_decoding_on_the_device_out_of_memory_splits_the_batch_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness import images
    from service.pipeline import device_decode
    from service.pipeline.decode import configure_pillow, jpeg_for_device, open_checked

    configure_pillow(40_000_000)
    real, calls = device_decode._decode, []

    def tight(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        calls.append(len(tensors))
        if len(tensors) > 2:  # as nvJPEG runs out of device memory for a batch of big photos
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.5 GiB")
        return real(tensors, device)

    monkeypatch.setattr(device_decode, "_decode", tight)
    model = loaded(Greedy(fits=99))
    model.decoder = device_decode
    blobs = [images.jpeg(64, 48, seed=i) for i in range(4)]
    jpegs = [jpeg_for_device(open_checked(b, 10**6), b) for b in blobs]
    b, scheduler = batching.batcher(lambda batch: BatchOutputs(*model.forward_items(batch)), max_batch=4,
                                    max_wait_s=0.05, start=False)
    with scheduler.admit(len(jpegs), coming=0) as request:
        results = [b.submit(j, None, request) for j in jpegs]
    b.start()
    try:
        rows = [r.get(timeout=30) for r in results]
    finally:
        b.stop()
    assert calls == [4, 2, 2] and all(isinstance(r, Row) for r in rows)
