"""The model one worker owns, whichever library built it: load, warm up, forward images and texts.

    GREENSERVE_MODEL          family            towers          embeddings from
    resnet50, torchvision:X   torchvision_family  image          the pooled features before the classifier
    open_clip:ARCH            open_clip_family  image + text    CLIP/SigLIP's joint space (``encode_image``/``text``)
    timm:NAME                 timm_family       image           the pooled pre-logits features

Everything here runs in the worker's inference thread (forwards) or its decode threads (tokenising),
after fork: never in the gunicorn master (libgomp and CUDA are not fork-safe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import numpy as np
import torch
from torch import nn

from service.engine import device_decode
from service.engine.casting import FLOAT32, Numerics, TowerCast
from service.engine.device_decode import EncodedJpeg
from service.engine.transform import Transform
from service.errors import OutOfMemory

if TYPE_CHECKING:
    from service.engine.precision import Precision

log = logging.getLogger(__name__)
T = TypeVar("T")

FAMILIES = ("torchvision", "open_clip", "timm")
RANDOM_SEED = 0  # random weights are seeded so every worker serves the same (meaningless) model
WARMUP_BATCHES = (1, 4)  # shapes run once before /readyz says ready (first-call allocations, kernel picks)


class ModelLoadError(RuntimeError):
    """The configured model or weights cannot be loaded; the message says what to change."""


def parse_model_name(spec: str) -> tuple[str, str]:
    """``open_clip:ViT-B-32`` → (open_clip, ViT-B-32); a bare name is torchvision's (``resnet50``)."""
    family, sep, name = spec.partition(":")
    if not sep:
        return "torchvision", spec
    if family not in FAMILIES or not name:
        raise ModelLoadError(f"GREENSERVE_MODEL={spec!r}: the family must be one of {', '.join(FAMILIES)} "
                             "(torchvision:resnet50, open_clip:ViT-B-32, timm:convnext_tiny; a bare name is "
                             "torchvision's)")
    return family, name


@dataclass(frozen=True)
class Tokens:
    """Tokenised texts: ids padded to the context length, and how many tokens each text kept."""

    ids: np.ndarray  # (n, context_length) int64
    lengths: tuple[int, ...]  # tokens kept, start and end tokens included
    truncated: tuple[bool, ...]  # the text had more tokens than the context length


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
    jpeg_decode: str = "pillow"  # where JPEGs are decoded: pillow (decode threads) | device (``device_decode``)

    def public(self) -> dict[str, Any]:
        t = self.transform
        out: dict[str, Any] = {"name": self.name, "family": self.family, "towers": list(self.towers), "tasks": list(self.tasks),
               "embedding_dim": self.embedding_dim, "labels_count": len(self.labels), "device": self.device,
               "dtype": self.dtype, "weights": self.weights, "format": self.format,
               "input": {"resize": t.resize_size, "crop": t.crop_size},
               "preprocessing": {"resize": t.resize_size, "crop": t.crop_size, "resize_mode": t.resize_mode,
                                 "interpolation": t.interpolation, "mean": list(t.mean), "std": list(t.std)},
               "load_seconds": round(self.load_seconds, 3), "jpeg_decode": self.jpeg_decode}
        if self.precision is not None:
            out["precision"] = self.precision.public()
        if "text" in self.towers:
            out["text"] = {"context_length": self.context_length, "over_context_length": "truncate",
                           "logit_scale": round(self.logit_scale, 4), "logit_bias": round(self.logit_bias, 4)}
        return out


class TextTower(Protocol):
    """A model's text side (``open_clip_family.ClipText``)."""

    context_length: int

    def tokenize(self, texts: Sequence[str]) -> Tokens: ...  # a decode thread: pure CPU, no torch forward

    def encode(self, ids: torch.Tensor) -> torch.Tensor: ...  # the inference thread


@dataclass
class LoadedModel:
    """A ready model: ``forward(uint8 NHWC batch) -> (embeddings, logits)`` as float32 CPU tensors (either may
    be None: TorchScript classifiers give logits only, CLIP's image tower features only), and with a text
    tower ``encode_text(token ids) -> embeddings``. Each tower runs in its own ``Numerics`` (``set_numerics``)."""

    info: ModelInfo
    module: nn.Module  # returns (features, logits), or one tensor: logits, or features if ``features_only``
    device: torch.device
    channels_last: bool = True
    text: TextTower | None = None
    features_only: bool = False
    # what each tower casts for "cast once": its root module and the names under it that are not its own
    # (CLIP's towers share one module; ``open_clip_family`` says which half is which)
    tower_roots: dict[str, tuple[nn.Module, tuple[str, ...]]] = field(default_factory=dict)
    numerics: dict[str, Numerics] = field(default_factory=dict)
    _casts: dict[str, TowerCast] = field(init=False, repr=False, default_factory=dict)
    _mean: torch.Tensor = field(init=False, repr=False)
    _std: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        t = self.info.transform
        self._mean = torch.tensor(t.mean, device=self.device).view(1, 3, 1, 1) * 255
        self._std = torch.tensor(t.std, device=self.device).view(1, 3, 1, 1) * 255
        self.tower_roots.setdefault("image", (self.module, ()))

    @property
    def towers(self) -> tuple[str, ...]:
        return ("image", "text") if self.text is not None else ("image",)

    @property
    def dtype(self) -> torch.dtype:
        """The image tower's dtype."""
        return self.numerics_of("image").dtype

    def numerics_of(self, tower: str) -> Numerics:
        return self.numerics.get(tower, FLOAT32)

    def set_numerics(self, tower: str, numerics: Numerics) -> None:
        """Run ``tower`` (image | text) in ``numerics`` from the next forward on; casting once casts its
        weights now (float32 brings back the very originals)."""
        self.tower_cast(tower).to(numerics.dtype if numerics.cast else torch.float32)
        self.numerics[tower] = numerics

    def tower_cast(self, tower: str) -> TowerCast:
        if tower not in self._casts:
            root, skip = self.tower_roots[tower]
            self._casts[tower] = TowerCast(root, skip)
        return self._casts[tower]

    def release_float32(self) -> None:
        """Drop the float32 originals of the towers cast once (after the dtype choice): one copy each."""
        for casting in self._casts.values():
            casting.release()

    def forward(self, batch: np.ndarray) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run one batch of uint8 crops (N, H, W, 3). Call from the inference thread only."""
        with torch.inference_mode():
            return self._guarded(lambda: self._run(self._upload(batch)))

    def forward_items(self, items: Sequence[np.ndarray | EncodedJpeg]
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, Exception]]:
        """One batch mixing Pillow's crops (H, W, 3) and JPEGs to decode on the device (``device_decode``):
        rows in item order, zeros for the items in the third value, which the device could not decode."""
        with torch.inference_mode():
            return self._guarded(lambda: self._forward_items(items))

    def _forward_items(self, items: Sequence[np.ndarray | EncodedJpeg]
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, Exception]]:
        at = [i for i, item in enumerate(items) if isinstance(item, EncodedJpeg)]
        decoded, failed = device_decode.crops([cast(EncodedJpeg, items[i]) for i in at], self.info.transform,
                                              self.device)
        chw: list[torch.Tensor | None] = [None] * len(items)
        for k, i in enumerate(at):
            chw[i] = decoded[k]
        arrays = [i for i, item in enumerate(items) if isinstance(item, np.ndarray)]
        if arrays:
            uploaded = self._upload(np.stack([cast(np.ndarray, items[i]) for i in arrays]))
            for k, i in enumerate(arrays):
                chw[i] = uploaded[k]
        kept = [i for i, t in enumerate(chw) if t is not None]
        failed = {at[k]: err for k, err in failed.items()}
        if not kept:
            return None, None, failed
        feats, logits = self._run(torch.stack([cast(torch.Tensor, chw[i]) for i in kept]))
        return _scatter(feats, kept, len(items)), _scatter(logits, kept, len(items)), failed

    def _upload(self, batch: np.ndarray) -> torch.Tensor:
        """uint8 (N, H, W, 3) crops → (N, 3, H, W) on the device; NHWC memory viewed as NCHW *is*
        channels_last: no copy for convnets."""
        x = torch.from_numpy(batch)
        if self.device.type == "cuda":
            x = x.pin_memory().to(self.device, non_blocking=True)
        return x.permute(0, 3, 1, 2)

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        numerics = self.numerics_of("image")
        x = x.to(torch.float32).sub_(self._mean).div_(self._std)  # normalised in float32, then cast once
        if numerics.cast:
            x = x.to(numerics.dtype)
        if not self.channels_last:
            x = x.contiguous()
        elif not x.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)  # the device decoder's stacked NCHW crops
        with numerics.autocast(self.device):
            out = self.module(x)
        if isinstance(out, tuple):
            feats, logits = out
        else:
            feats, logits = (out, None) if self.features_only else (None, out)
        return _cpu(feats), _cpu(logits)

    def tokenize(self, texts: Sequence[str]) -> Tokens:
        """Texts → token ids (a decode thread); only for models with a text tower."""
        assert self.text is not None
        return self.text.tokenize(texts)

    def encode_text(self, ids: np.ndarray) -> torch.Tensor:
        """One batch of token ids (N, context_length) → text embeddings. The inference thread only."""
        assert self.text is not None
        with torch.inference_mode():
            return self._guarded(lambda: self._encode_text(torch.from_numpy(ids).to(self.device)))

    def _encode_text(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.text is not None
        with self.numerics_of("text").autocast(self.device):
            return self.text.encode(ids).float().cpu()

    def _guarded(self, fn: Callable[[], T]) -> T:
        """``fn()``; running out of device memory (the copy to it, decoding, the forward) raises
        ``OutOfMemory`` once the failed attempt's memory is released (the batcher then splits the batch)."""
        try:
            return fn()
        except torch.OutOfMemoryError:
            pass
        except RuntimeError as exc:  # the CPU allocator says it with a plain RuntimeError
            if "can't allocate memory" not in str(exc):
                raise
        # out of the except clause the exception, its frames and their activations are gone: only now
        # can the CUDA cache hand their memory back
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        raise OutOfMemory(f"{self.device} ran out of memory for this image; retry shortly (other work may be "
                          "holding the memory) or send smaller images", retry_after_s=2)

    def set_threads(self, n: int) -> None:
        """torch intra-op threads for the calling (inference) thread's next forwards; CPU only."""
        if self.device.type == "cpu":
            torch.set_num_threads(n)

    def warm_up(self) -> None:
        c = self.info.transform.crop_size
        for n in WARMUP_BATCHES:
            self.forward(np.zeros((n, c, c, 3), dtype=np.uint8))
        if self.text is not None:
            self.encode_text(self.tokenize(["a photo of a cat."] * WARMUP_BATCHES[-1]).ids)


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().flatten(1).cpu()


def _scatter(rows: torch.Tensor | None, kept: list[int], n: int) -> torch.Tensor | None:
    """``rows`` (one per kept item) placed at the kept items' positions among ``n``, zeros elsewhere."""
    if rows is None or len(kept) == n:
        return rows
    out = torch.zeros((n, *rows.shape[1:]), dtype=rows.dtype)
    out[kept] = rows
    return out


def load_model(name: str, weights: str, *, device: torch.device | None = None, channels_last: bool = True,
               numerics: Numerics = FLOAT32) -> LoadedModel:
    """Load ``name`` (``GREENSERVE_MODEL``) with ``weights`` (``GREENSERVE_WEIGHTS``) through its family, every
    tower in ``numerics`` (``precision.settle`` chooses per tower instead)."""
    family, arch = parse_model_name(name)
    device = device or torch.device("cpu")
    model: LoadedModel
    if family == "open_clip":
        from service.engine import open_clip_family

        model = open_clip_family.load(arch, weights, device=device)
    elif family == "timm":
        from service.engine import timm_family

        model = timm_family.load(arch, weights, device=device, channels_last=channels_last)
    else:
        from service.engine import torchvision_family

        model = torchvision_family.load(arch, weights, device=device, channels_last=channels_last)
    if numerics != FLOAT32:
        for tower in model.towers:
            model.set_numerics(tower, numerics)
        model.info = replace(model.info, dtype=dtype_name(numerics.dtype))
    return model


def resolve_device(device: str, worker_ordinal: int = 0) -> torch.device:
    """``auto``/``cuda`` spread workers over the visible GPUs round-robin; call after fork only."""
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda:"):
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", worker_ordinal % torch.cuda.device_count())
    if device == "cuda":
        raise ModelLoadError("GREENSERVE_DEVICE=cuda but no CUDA device is visible; use cpu or auto")
    return torch.device("cpu")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
