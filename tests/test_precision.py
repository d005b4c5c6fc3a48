"""GREENSERVE_DTYPE=auto: the hardware check (CPU flags forced on and off) and the probe that keeps the lower
precision only when it agrees with float32, on real torch modules (one whose bfloat16 disagrees)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch import nn

from service.engine import precision
from service.engine.model import LoadedModel, ModelInfo, Tokens, load_model
from service.engine.transform import Transform

AMX = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def resnet18() -> LoadedModel:
    torch.manual_seed(0)
    return load_model("resnet18", "random")


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


def test_auto_without_native_bf16_serves_float32_without_a_probe(resnet18: LoadedModel) -> None:
    chosen = precision.settle(resnet18, "auto", flags=AVX2)
    assert (chosen.chosen, chosen.probe, resnet18.dtype) == ("float32", None, torch.float32)
    assert "no native bfloat16" in chosen.reason
    public = resnet18.info.public()
    assert public["dtype"] == "float32"
    assert public["precision"]["requested"] == "auto" and "probe" not in public["precision"]


def test_auto_with_native_bf16_keeps_it_when_the_probe_agrees(resnet18: LoadedModel) -> None:
    chosen = precision.settle(resnet18, "auto", flags=ZEN4)
    assert chosen.probe is not None and chosen.probe.agrees
    assert chosen.probe.min_cosine >= precision.MIN_COSINE
    assert chosen.probe.top1_same == chosen.probe.images == precision.PROBE_IMAGES
    assert (chosen.chosen, resnet18.dtype, resnet18.info.dtype) == ("bfloat16", torch.bfloat16, "bfloat16")
    assert "agreed" in chosen.reason and "avx512_bf16" in chosen.reason
    assert resnet18.info.public()["precision"]["probe"]["candidate"] == "bfloat16"
    # and it really serves bfloat16 now: the answer moves from float32's in the last bits
    pixels = precision.probe_pixels(224, 2)
    low = resnet18.forward(pixels)[0]
    resnet18.dtype = torch.float32
    high = resnet18.forward(pixels)[0]
    assert low is not None and high is not None and not torch.equal(low, high)


def test_the_cpu_override_turns_it_off_even_on_amx(resnet18: LoadedModel) -> None:
    chosen = precision.settle(resnet18, "auto", cpu_bf16="no", flags=AMX)
    assert (chosen.chosen, chosen.probe) == ("float32", None)


@pytest.mark.parametrize("pinned", ["float32", "bfloat16", "float16"])
def test_a_pinned_dtype_is_served_as_given_unprobed(resnet18: LoadedModel, pinned: str) -> None:
    chosen = precision.settle(resnet18, pinned, flags=AMX if pinned == "float32" else AVX2)
    assert (chosen.chosen, chosen.probe, resnet18.dtype) == (pinned, None, getattr(torch, pinned))
    assert chosen.reason == "pinned by GREENSERVE_DTYPE"


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
    return LoadedModel(info=info, module=module, device=CPU, channels_last=False, text=text,
                       features_only=not isinstance(module, NearTie))


def test_a_model_whose_bf16_embeddings_disagree_serves_float32() -> None:
    model = small_model(Cancelling())
    chosen = precision.settle(model, "auto", flags=AMX)
    assert chosen.probe is not None and chosen.probe.min_cosine < precision.MIN_COSINE
    assert (chosen.chosen, model.dtype, model.info.dtype) == ("float32", torch.float32, "float32")
    assert "disagreed" in chosen.reason and "so float32" in chosen.reason


def test_a_top1_that_flips_in_bf16_serves_float32_though_the_embeddings_agree() -> None:
    model = small_model(NearTie())
    chosen = precision.settle(model, "auto", flags=AMX)
    assert chosen.probe is not None and chosen.probe.min_cosine >= precision.MIN_COSINE
    assert chosen.probe.top1_same == 0
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


def test_the_text_tower_is_probed_too() -> None:
    images_fine = nn.Sequential(nn.Flatten(), nn.LazyLinear(8))
    model = small_model(images_fine, DriftingText())
    chosen = precision.settle(model, "auto", flags=ZEN4)
    assert chosen.chosen == "float32", chosen.reason
    model_without_text = small_model(images_fine)
    assert precision.settle(model_without_text, "auto", flags=ZEN4).chosen == "bfloat16"


def test_the_probe_images_are_deterministic_and_photo_like() -> None:
    a, b = precision.probe_pixels(64), precision.probe_pixels(64)
    assert a.shape == (precision.PROBE_IMAGES, 64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert all(img.std() > 20 for img in a)  # not flat
    assert len({img.tobytes() for img in a}) == len(a)
