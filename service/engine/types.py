"""The engine's value types, torch-free: what the HTTP layer and the pipeline know of a model (its
description, its preprocessing, its tokens, its precision choice) and of a forward's outputs (``Row``,
``BatchOutputs``) without importing torch or the batcher."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # annotations only: this module stays torch-free
    import torch

MIN_COSINE = 0.9999
INT8_ALLOW_COSINE = 0.999  # GREENSERVE_INT8=allow: the looser agreement an operator accepts for int8
MIN_SPEEDUP = 1.15  # a lower precision must earn its rounding: timing noise between runs here is ~5-10%
# two ways kept within this factor of each other are a tie, by the same noise: cast once, first in a fixed order,
# serves unless autocast is faster by more, so that instances which time alike choose alike (``precision.preferred``)
TIE_MARGIN = MIN_SPEEDUP


class ModelLoadError(RuntimeError):
    """The configured model or weights cannot be loaded; the message says what to change."""


# ImageNet preprocessing used by torchvision's classification weights (resnet50 V2 uses 232/224).
DEFAULT_RESIZE = 256
DEFAULT_CROP = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Transform:
    resize_size: int = DEFAULT_RESIZE
    crop_size: int = DEFAULT_CROP
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"
    resize_mode: str = "shortest"  # shortest side to resize_size, then centre crop | squash: whole image to crop
    # the reference's resize and crop exactly (immich's, open_clip's own PIL transform): the whole image resized, then
    # an integer crop, from a JPEG decoded at no less than twice resize_size (within 0.18 grey levels of decoding
    # every pixel). Off (the default), a JPEG decodes at a scale down to resize_size and only the crop's region is
    # resampled, with Pillow's reducing gap: less time, slightly other pixels (docs/MODELS.md, immich)
    exact: bool = False

    def crop_box(self, width: int, height: int) -> tuple[float, float, float, float]:
        """The source region (left, top, right, bottom) that resizing the shorter side to ``resize_size`` and
        centre-cropping ``crop_size`` keeps; the whole image for ``squash``."""
        if self.resize_mode == "squash":
            return 0.0, 0.0, float(width), float(height)
        half = self.crop_size / (self.resize_size / min(width, height)) / 2
        cx, cy = width / 2, height / 2
        return max(0.0, cx - half), max(0.0, cy - half), min(float(width), cx + half), min(float(height), cy + half)


@dataclass(frozen=True)
class Tokens:
    """Tokenised texts: ids padded to the context length, and how many tokens each text kept."""

    ids: np.ndarray  # (n, context_length) int64
    lengths: tuple[int, ...]  # tokens kept, start and end tokens included
    truncated: tuple[bool, ...]  # the text had more tokens than the context length


@dataclass(frozen=True)
class Row:
    """One item's outputs from a forward, with how long it queued and how long its batch ran."""

    features: np.ndarray | None
    logits: np.ndarray | None
    queue_s: float
    inference_s: float
    batch_size: int


@dataclass(frozen=True)
class BatchOutputs:
    """A forward's rows (row i for item i) and the items that got none, each with its reason."""

    features: np.ndarray | None
    logits: np.ndarray | None
    failed: dict[int, Exception] = field(default_factory=dict)


@dataclass(frozen=True)
class EncodedJpeg:
    """A JPEG that passed the header checks, waiting for the device: its bytes as a uint8 array (made in the
    decode thread, so the inference thread does not copy them) and its EXIF orientation (1-8)."""

    data: np.ndarray
    orientation: int = 1


class DeviceDecoder(Protocol):
    """Decodes JPEGs on the model's device, in the inference thread (``pipeline.device_decode``, handed to
    the model by the worker's boot: the engine does not import the pipeline)."""

    def usable(self, mode: str, device: torch.device, transform: Transform) -> tuple[bool, str]: ...

    def crops(self, jpegs: Sequence[EncodedJpeg], transform: Transform, device: torch.device
              ) -> tuple[list[torch.Tensor | None], dict[int, Exception]]: ...


@dataclass(frozen=True)
class ModelInfo:
    name: str
    tasks: tuple[str, ...]
    embedding_dim: int | None
    labels: tuple[str, ...]  # a classifier's fixed classes; empty for zero-shot models
    device: str
    dtype: str
    weights: str  # "imagenet", "random", a pretrained tag, or the file it came from
    transform: Transform
    load_seconds: float = 0.0
    format: str = "torchvision"
    family: str = "torchvision"
    towers: tuple[str, ...] = ("image",)
    context_length: int | None = None  # the text tower's, in tokens
    logit_scale: float = 1.0  # zero-shot: softmax(logit_scale * cosine + logit_bias)
    logit_bias: float = 0.0
    precision: Precision | None = None  # the dtype choice and why (``precision.settle``)
    jpeg_decode: str = "pillow"  # where JPEGs are decoded: pillow (decode threads) | device (``DeviceDecoder``)
    weights_digest: str = ""  # sha256 of the loaded tensors (``weights.digest``): part of the embedding cache's key

    def public(self) -> dict[str, Any]:
        t = self.transform
        out: dict[str, Any] = {"name": self.name, "family": self.family, "towers": list(self.towers), "tasks": list(self.tasks),
               "embedding_dim": self.embedding_dim, "labels_count": len(self.labels), "device": self.device,
               "dtype": self.dtype, "weights": self.weights, "format": self.format,
               "input": {"resize": t.resize_size, "crop": t.crop_size},
               "preprocessing": {"resize": t.resize_size, "crop": t.crop_size, "resize_mode": t.resize_mode,
                                 "interpolation": t.interpolation, "mean": list(t.mean), "std": list(t.std),
                                 "exact": t.exact},
               "load_seconds": round(self.load_seconds, 3), "jpeg_decode": self.jpeg_decode,
               "weights_digest": self.weights_digest}
        if self.precision is not None:
            out["precision"] = self.precision.public()
        if "text" in self.towers:
            out["text"] = {"context_length": self.context_length, "over_context_length": "truncate",
                           "logit_scale": round(self.logit_scale, 4), "logit_bias": round(self.logit_bias, 4)}
        return out


@dataclass(frozen=True)
class Trial:
    """One lower-precision way of running a tower, against float32 at the same batch sizes."""

    numerics: str  # Numerics.name
    sizes: tuple[int, ...]  # the sizes it was timed at: fewer than the tower's when it stopped early
    ms: tuple[float, ...]
    ms_float32: tuple[float, ...]  # float32's at the same sizes
    min_cosine: float | None  # outputs against float32's, over every probe input it ran
    top1_same: int | None  # images whose top-1 class matched; None for a model without logits, or texts
    compared: int  # outputs compared
    error: str | None = None  # the candidate could not run (its forward raised)
    min_cosine_bound: float = MIN_COSINE  # MIN_COSINE, or the operator's for int8 (GREENSERVE_INT8)

    @property
    def speedup(self) -> float:
        return sum(self.ms_float32) / sum(self.ms) if self.ms and sum(self.ms) > 0 else 0.0

    @property
    def agrees(self) -> bool:
        return (self.error is None and self.min_cosine is not None and self.min_cosine >= self.min_cosine_bound
                and self.top1_same in (None, self.compared))

    def kept(self, all_sizes: tuple[int, ...]) -> bool:
        return self.agrees and self.sizes == all_sizes and self.speedup >= MIN_SPEEDUP

    def text(self) -> str:
        if self.error is not None:
            return f"{self.numerics} failed: {self.error}"
        ms = "+".join(f"{m:.0f}" for m in self.ms)
        ms32 = "+".join(f"{m:.0f}" for m in self.ms_float32)
        top1 = "" if self.top1_same is None else f", top-1 same {self.top1_same}/{self.compared}"
        cosine = "n/a" if self.min_cosine is None else f"{self.min_cosine:.6f}"
        return (f"{self.numerics} {ms} ms vs float32 {ms32} ms at batch {'/'.join(map(str, self.sizes))} "
                f"= {self.speedup:.2f}x (needs >= {MIN_SPEEDUP}x), min cosine {cosine} (needs >= {self.min_cosine_bound})"
                f"{top1}")

    def public(self) -> dict[str, Any]:
        return {"numerics": self.numerics, "sizes": list(self.sizes), "ms": [round(m, 1) for m in self.ms],
                "ms_float32": [round(m, 1) for m in self.ms_float32], "speedup": round(self.speedup, 3),
                "min_cosine": None if self.min_cosine is None else round(self.min_cosine, 7),
                "top1_same": self.top1_same, "compared": self.compared, "agrees": self.agrees, "error": self.error,
                "min_cosine_bound": self.min_cosine_bound}


@dataclass(frozen=True)
class TowerChoice:
    tower: str  # image | text
    numerics: str  # what it serves in (Numerics.name)
    reason: str
    sizes: tuple[int, ...] = ()
    trials: tuple[Trial, ...] = ()
    ms: tuple[float, ...] = ()  # what it serves in, timed at ``sizes`` in its trial; empty when untimed

    def per_image_ms(self) -> dict[int, float]:
        """The forward's cost per image at each batch size the trial timed (the gather's stop reads it)."""
        return {size: ms / size for size, ms in zip(self.sizes, self.ms, strict=False) if size > 0 and ms > 0}

    def public(self) -> dict[str, Any]:
        return {"numerics": self.numerics, "reason": self.reason, "sizes": list(self.sizes),
                "ms": [round(m, 1) for m in self.ms], "trials": [t.public() for t in self.trials]}


@dataclass(frozen=True)
class Precision:
    """What a worker serves in, and why: ``ModelInfo.precision``, in ``/v1/models`` and the start-up log."""

    requested: str  # GREENSERVE_DTYPE
    chosen: str  # the image tower's dtype
    hardware: str  # what the choice was made on: "cpu avx2", "cpu avx512_bf16", "cuda sm_90 NVIDIA H200"
    reason: str
    towers: tuple[TowerChoice, ...] = ()
    # where this worker got it: measured (timed here) | server (an earlier worker's, the memo) | fleet (the first
    # instance's record in the shared cache) | pinned (GREENSERVE_DTYPE) | hardware (no candidate: float32 untried)
    source: str = "measured"
    measured_by: str = ""  # "<host> pid <pid>" of the worker that timed it; empty when nothing was timed

    def tower(self, name: str) -> TowerChoice | None:
        return next((t for t in self.towers if t.tower == name), None)

    def public(self) -> dict[str, Any]:
        return {"requested": self.requested, "chosen": self.chosen, "hardware": self.hardware,
                "reason": self.reason, "source": self.source, "measured_by": self.measured_by,
                "min_cosine": MIN_COSINE, "min_speedup": MIN_SPEEDUP, "tie_margin": TIE_MARGIN,
                "towers": {t.tower: t.public() for t in self.towers}}
