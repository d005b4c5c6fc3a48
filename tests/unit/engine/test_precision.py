"""GREENSERVE_DTYPE=auto: the hardware check (CPU flags forced on and off) and the probe that keeps the lower
precision only when it agrees with float32, on real torch modules (one whose bfloat16 disagrees)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from service.balance.memo import SharedMemo
from service.engine import precision, probes
from service.engine.casting import Numerics
from service.engine.loading import load_model
from service.engine.model import LoadedModel
from service.engine.types import MIN_COSINE, ModelInfo, Tokens, Transform

pytestmark = pytest.mark.slow  # real models: not in make test-fast

AMX = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})
CPU = torch.device("cpu")


def fresh_resnet18() -> LoadedModel:
    torch.manual_seed(0)
    return load_model("resnet18", "random")


@pytest.fixture(scope="module")
def resnet18() -> LoadedModel:
    return fresh_resnet18()


@pytest.mark.parametrize(("flags", "mode", "expected"), [
    (AMX, "auto", torch.bfloat16), (ZEN4, "auto", torch.bfloat16), (AVX2, "auto", None),
    (AMX, "no", None), (AVX2, "yes", torch.bfloat16), (frozenset(), "auto", None)])
def test_the_cpu_candidate_comes_from_its_bf16_flags_or_the_override(flags: frozenset[str], mode: str,
                                                                      expected: torch.dtype | None) -> None:
    candidate, hardware = precision.candidate_for(CPU, mode, flags)
    assert candidate == expected
    assert hardware.startswith("cpu ")
    if "amx_bf16" in flags:
        assert "amx_bf16" in hardware
    if mode != "auto":
        assert f"GREENSERVE_CPU_BF16={mode}" in hardware


def test_this_hosts_flags_are_read() -> None:
    flags = precision.cpu_flags()
    assert flags, "/proc/cpuinfo has a flags line on Linux"
    candidate, _ = precision.candidate_for(CPU, "auto")
    assert (candidate is torch.bfloat16) == bool(flags & set(precision.CPU_BF16_FLAGS))


def test_a_gpu_candidate_follows_its_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "a GPU")
    for capability, expected in (((9, 0), torch.bfloat16), ((8, 6), torch.bfloat16), ((7, 5), torch.float16),
                                 ((6, 1), None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        candidate, hardware = precision.candidate_for(torch.device("cuda", 0))
        assert candidate == expected, capability
        assert hardware == f"cuda sm_{capability[0]}{capability[1]} a GPU"


class FakeTimer:
    """Runs the forward for its outputs, and says it took ``per_image_s`` per image times the numerics'
    factor (float32: 1): the speed half of the choice, injected. ``calls`` is what was timed."""

    def __init__(self, factors: dict[str, float], per_image_s: float = 0.01) -> None:
        self.factors, self.per_image_s = factors, per_image_s
        self.calls: list[tuple[str, str, int]] = []

    def __call__(self, tower: str, numerics: Numerics, size: int, run: Callable[[], Any]) -> tuple[Any, float]:
        self.calls.append((tower, numerics.name, size))
        return run(), size * self.per_image_s * self.factors.get(numerics.name, 1.0)


SMALL = (1, 2, 4)  # batch sizes for the trials whose every candidate runs to the end (emulated bf16 is slow here)
FAST_CAST = {"bfloat16 cast once": 0.3, "bfloat16 autocast": 1.7}  # what the seed measured on a ViT-B/32


def test_auto_without_native_bf16_serves_float32_without_a_trial(resnet18: LoadedModel) -> None:
    chosen = precision.settle(resnet18, "auto", flags=AVX2, timer=FakeTimer(FAST_CAST))
    assert (chosen.chosen, resnet18.dtype) == ("float32", torch.float32)
    assert "no native bfloat16" in chosen.reason
    image = chosen.tower("image")
    assert image is not None and image.trials == () and image.numerics == "float32"
    public = resnet18.info.public()
    assert public["dtype"] == "float32"
    assert public["precision"]["requested"] == "auto" and public["precision"]["towers"]["image"]["trials"] == []


def test_auto_with_native_bf16_keeps_the_cast_once_weights_when_they_agree_and_are_faster() -> None:
    model = fresh_resnet18()
    before = model.forward(probes.probe_pixels(224, 2))[0]
    timer = FakeTimer(FAST_CAST)
    chosen = precision.settle(model, "auto", flags=ZEN4, timer=timer)
    image = chosen.tower("image")
    assert image is not None and image.numerics == "bfloat16 cast once", chosen.reason
    assert (chosen.chosen, model.dtype, model.info.dtype) == ("bfloat16", torch.bfloat16, "bfloat16")
    cast, autocast = image.trials
    assert cast.agrees and cast.min_cosine is not None and cast.min_cosine >= MIN_COSINE
    assert cast.top1_same == cast.compared == 1 + 8 + 32  # every probe output at every size
    assert cast.speedup == pytest.approx(1 / 0.3) and autocast.speedup == pytest.approx(1 / 1.7)
    assert "avx512_bf16" in chosen.reason and "3.33x" in chosen.reason and "agreed but slower" in chosen.reason
    # timed at the sizes asked for, ascending; autocast stopped once it could not be fast enough
    assert [c for c in timer.calls if c[1] == "float32"] == [("image", "float32", n) for n in (1, 8, 32)]
    assert len(autocast.sizes) < 3
    # and it really serves cast weights now: a Linear/Conv in bfloat16, the answer moved in the last bits
    assert model.module.backbone.conv1.weight.dtype == torch.bfloat16
    after = model.forward(probes.probe_pixels(224, 2))[0]
    assert after is not None and before is not None and after.dtype == torch.float32 and not torch.equal(after, before)
    card = model.info.public()["precision"]
    assert card["towers"]["image"]["numerics"] == "bfloat16 cast once"
    assert [t["numerics"] for t in card["towers"]["image"]["trials"]] == ["bfloat16 cast once", "bfloat16 autocast"]
    # what it serves in carries its own times, per image by batch size (the gather's stop on a share reads them)
    assert image.ms == cast.ms and card["towers"]["image"]["ms"] == [round(m, 1) for m in cast.ms]
    assert image.per_image_ms() == pytest.approx({n: ms / n for n, ms in zip((1, 8, 32), cast.ms, strict=True)})


def test_the_start_up_line_is_the_choice_and_its_speed_up_and_the_trials_go_to_the_card(
        caplog: pytest.LogCaptureFixture) -> None:
    """One line per worker at info (every trial's timings made it some 800 characters); the whole reason at
    debug level and in /v1/models."""
    memo = SharedMemo()
    with caplog.at_level(logging.DEBUG, logger="service.engine.precision"):
        chosen = precision.settle(fresh_resnet18(), "auto", flags=ZEN4, timer=FakeTimer(FAST_CAST), memo=memo)
        precision.settle(fresh_resnet18(), "auto", flags=ZEN4, timer=FakeTimer(FAST_CAST), memo=memo)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "serving in" in r.getMessage()]
    assert lines == [
        "serving in image bfloat16 cast once (GREENSERVE_DTYPE=auto): cpu avx512_bf16, measured here (image 3.33x "
        "float32); every trial: /v1/models precision",
        "serving in image bfloat16 cast once (GREENSERVE_DTYPE=auto): cpu avx512_bf16, as this server measured it; "
        "every trial: /v1/models precision"]
    assert f"precision: {chosen.reason}" in [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]


def test_a_trial_kept_in_the_memo_is_served_by_the_next_worker_without_timing() -> None:
    """A replacement after a HUP reads the choice its predecessor measured; other weights or sizes time again."""
    memo = SharedMemo()
    first = precision.settle(fresh_resnet18(), "auto", flags=ZEN4, timer=FakeTimer(FAST_CAST), memo=memo)
    timer = FakeTimer({"bfloat16 cast once": 2.0, "bfloat16 autocast": 3.0})  # it would choose float32
    model = fresh_resnet18()
    again = precision.settle(model, "auto", flags=ZEN4, timer=timer, memo=memo)
    assert timer.calls == [] and model.dtype == torch.bfloat16
    assert model.module.backbone.conv1.weight.dtype == torch.bfloat16  # really cast, as the first one was
    image, was = again.tower("image"), first.tower("image")
    assert image is not None and was is not None and image.numerics == was.numerics == "bfloat16 cast once"
    assert image.reason == precision.REUSED + was.reason and image.sizes == was.sizes
    precision.settle(fresh_resnet18(), "auto", flags=ZEN4, timer=timer, image_sizes=SMALL, memo=memo)
    assert timer.calls  # other sizes: another key, timed


def test_workers_starting_together_take_turns_and_the_second_reads_the_first_trial() -> None:
    memo = SharedMemo()
    timers = [FakeTimer(FAST_CAST), FakeTimer({"bfloat16 cast once": 2.0, "bfloat16 autocast": 3.0})]
    models = [fresh_resnet18(), fresh_resnet18()]
    chosen: list[precision.Precision] = []
    with memo.exclusive(1.0):  # the first worker's turn is held: the other two wait for it
        workers = [threading.Thread(target=lambda i=i: chosen.append(
            precision.settle(models[i], "auto", flags=ZEN4, timer=timers[i], memo=memo))) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(0.1)  # they must not finish while the turn is held
        assert not chosen and all(w.is_alive() for w in workers)  # both wait
    for w in workers:
        w.join(30)
    assert len(chosen) == 2 and chosen[0].chosen == chosen[1].chosen
    assert sum(bool(t.calls) for t in timers) == 1  # one trial, read by the other
    assert sum(c.reason.count(precision.REUSED) for c in chosen) == 1


def test_the_memo_reads_nothing_torn_or_under_another_key() -> None:
    memo = SharedMemo(size=256)
    assert memo.get("k") is None
    assert memo.put("k", b"value") and memo.get("k") == b"value" and memo.get("other") is None
    memo._buf[53] ^= 0xFF  # a torn write: the checksum no longer matches
    assert memo.get("k") is None
    assert not memo.put("k", b"x" * 300)  # too big: not kept


def test_an_agreeing_but_slower_candidate_is_refused_with_both_timings() -> None:
    model = fresh_resnet18()
    chosen = precision.settle(model, "auto", flags=AMX, timer=FakeTimer({"bfloat16 cast once": 2.0,
                                                                          "bfloat16 autocast": 3.0}))
    assert (chosen.chosen, model.dtype) == ("float32", torch.float32)
    image = chosen.tower("image")
    assert image is not None and all(t.agrees for t in image.trials)
    assert "agreed but slower" in chosen.reason and "0.50x" in chosen.reason
    assert "20 ms vs float32 10 ms at batch 1" in chosen.reason  # both figures, in words
    # float32 serves, with its own times at every size (the candidates' trials stopped early)
    assert image.ms == pytest.approx((10.0, 80.0, 320.0)) and len(image.trials[0].ms_float32) < 3
    assert model.module.backbone.conv1.weight.dtype == torch.float32  # the originals are back


def test_a_candidate_under_the_margin_is_refused() -> None:
    model = fresh_resnet18()
    chosen = precision.settle(model, "auto", flags=AMX, image_sizes=SMALL,
                              timer=FakeTimer({"bfloat16 cast once": 1 / 1.1, "bfloat16 autocast": 1.0}))
    assert chosen.chosen == "float32" and "not enough faster" in chosen.reason


def test_autocast_serves_when_it_is_the_faster_one_that_agrees() -> None:
    model = fresh_resnet18()
    chosen = precision.settle(model, "auto", flags=AMX, image_sizes=SMALL,
                              timer=FakeTimer({"bfloat16 cast once": 0.8, "bfloat16 autocast": 0.5}))
    assert model.numerics_of("image") == Numerics(torch.bfloat16, cast=False)
    assert model.module.backbone.conv1.weight.dtype == torch.float32  # autocast casts per call, not the weights
    assert chosen.reason.startswith("cpu amx_bf16: image tower bfloat16 autocast: ")


@pytest.mark.skipif(bool(precision.cpu_flags() & set(precision.CPU_BF16_FLAGS)), reason="this CPU has native bf16")
def test_on_this_cpu_emulated_bf16_agrees_but_measures_slower_so_float32_serves() -> None:
    """The real clock: GREENSERVE_CPU_BF16=yes on a CPU without native bf16 (emulated: 5-7x slower here)."""
    model = fresh_resnet18()
    chosen = precision.settle(model, "auto", cpu_bf16="yes", flags=AVX2)
    assert chosen.chosen == "float32", chosen.reason
    image = chosen.tower("image")
    assert image is not None and all(t.speedup < 1 and t.sizes == (1,) for t in image.trials), chosen.reason
    assert "agreed but slower" in chosen.reason


def test_the_cpu_override_turns_it_off_even_on_amx(resnet18: LoadedModel) -> None:
    chosen = precision.settle(resnet18, "auto", cpu_bf16="no", flags=AMX)
    assert chosen.chosen == "float32" and chosen.towers[0].trials == ()


@pytest.mark.parametrize("pinned", ["float32", "bfloat16", "float16"])
def test_a_pinned_dtype_is_served_as_given_cast_once_untried(pinned: str) -> None:
    model = fresh_resnet18()
    chosen = precision.settle(model, pinned, flags=AMX if pinned == "float32" else AVX2)
    assert (chosen.chosen, model.dtype) == (pinned, getattr(torch, pinned))
    assert chosen.towers[0].trials == () and chosen.reason == "pinned by GREENSERVE_DTYPE"
    assert chosen.towers[0].per_image_ms() == {}  # untimed: the gather's fixed stop
    assert model.module.backbone.conv1.weight.dtype == getattr(torch, pinned)


def test_batch_sizes_are_one_a_quarter_and_the_max() -> None:
    assert precision.batch_sizes(32) == (1, 8, 32)
    assert precision.batch_sizes(64) == (1, 16, 64)
    assert precision.batch_sizes(2) == (1, 2)
    assert precision.batch_sizes(1) == (1,)


class Cancelling(nn.Module):
    """Embeddings computed as the small difference of two large terms: float32 keeps it, bfloat16's 8-bit
    mantissa rounds it away (a real numerical failure, not a switch on the dtype)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.big = nn.Linear(3, 16)
        self.small = nn.Linear(3, 16, bias=False)
        with torch.no_grad():
            self.small.weight.copy_(torch.randn(16, 3, generator=g) * 1e-3)
            self.big.weight.copy_(torch.randn(16, 3, generator=g) * 1e3)
            self.big.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.mean(dim=(2, 3))
        return (self.big(f) + self.small(f)) - self.big(f)


class NearTie(nn.Module):
    """Stable embeddings, but two classes whose weights differ below bfloat16's resolution: float32 ranks
    class 1 first, bfloat16 ties them and argmax says class 0."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor([[1.0, 1.0, 1.0], [1.0001, 1.0001, 1.0001]]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = x.mean(dim=(2, 3)) + 10.0  # positive features: class 1's slightly larger weights win in float32
        return f, self.head(f)


def small_model(module: nn.Module, text: DriftingText | None = None) -> LoadedModel:
    info = ModelInfo("probe-test", ("embeddings",), 3, (), "cpu", "float32", "random", Transform(16, 16))
    roots = {} if text is None else {"text": (text.net, ())}
    return LoadedModel(info=info, module=module, device=CPU, channels_last=False, text=text,
                       features_only=not isinstance(module, NearTie), tower_roots=roots)


def test_a_model_whose_bf16_embeddings_disagree_serves_float32() -> None:
    model = small_model(Cancelling())
    chosen = precision.settle(model, "auto", flags=AMX, timer=FakeTimer(FAST_CAST))
    cast = chosen.towers[0].trials[0]
    assert cast.min_cosine is not None and cast.min_cosine < MIN_COSINE
    assert (chosen.chosen, model.dtype, model.info.dtype) == ("float32", torch.float32, "float32")
    assert "disagreed" in chosen.reason and "image tower float32: " in chosen.reason


def test_a_top1_that_flips_in_bf16_serves_float32_though_the_embeddings_agree() -> None:
    model = small_model(NearTie())
    chosen = precision.settle(model, "auto", flags=AMX, timer=FakeTimer(FAST_CAST))
    cast = chosen.towers[0].trials[0]
    assert cast.min_cosine is not None and cast.min_cosine >= MIN_COSINE
    assert cast.top1_same == 0
    assert chosen.chosen == "float32"


class DriftingText:
    """A text tower whose bfloat16 output is dominated by a cancelled term (as ``Cancelling``)."""

    context_length = 4

    def __init__(self) -> None:
        self.net = Cancelling()

    def tokenize(self, texts: Sequence[str]) -> Tokens:
        n = len(texts)
        return Tokens(np.arange(n * 4, dtype=np.int64).reshape(n, 4) % 7, (4,) * n, (False,) * n)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids.float().view(-1, 1, 2, 2).expand(-1, 3, 2, 2)
        return self.net(x)


def test_each_tower_chooses_for_itself() -> None:
    images_fine = nn.Sequential(nn.Flatten(), nn.Linear(16 * 16 * 3, 8))
    model = small_model(images_fine, DriftingText())
    chosen = precision.settle(model, "auto", flags=ZEN4, timer=FakeTimer(FAST_CAST))
    image, text = chosen.tower("image"), chosen.tower("text")
    assert image is not None and text is not None
    assert (image.numerics, text.numerics) == ("bfloat16 cast once", "float32"), chosen.reason
    assert model.numerics_of("text") == Numerics() and model.dtype == torch.bfloat16
    assert text.sizes == (1, 16, 64) and "disagreed" in text.reason
    assert set(model.info.public()["precision"]["towers"]) == {"image", "text"}


def test_the_probe_images_are_deterministic_and_photo_like() -> None:
    a, b = probes.probe_pixels(64), probes.probe_pixels(64)
    assert a.shape == (probes.PROBE_IMAGES, 64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert all(img.std() > 20 for img in a)  # not flat
    assert len({img.tobytes() for img in a}) == len(a)
