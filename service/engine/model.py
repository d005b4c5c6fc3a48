"""The model one worker owns, whichever library built it (``loading``): warm up, forward images and texts.

Everything here runs in the worker's inference thread (forwards) or its decode threads (tokenising),
after fork: never in the gunicorn master (libgomp and CUDA are not fork-safe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import numpy as np
import torch
from torch import nn

from service.engine.casting import FLOAT32, Numerics, TowerCast
from service.engine.types import DeviceDecoder, EncodedJpeg, ModelInfo, Tokens, Transform
from service.errors import OutOfMemory

log = logging.getLogger(__name__)
T = TypeVar("T")

WARMUP_BATCHES = (1, 4)  # shapes run once before /readyz says ready (first-call allocations, kernel picks)


class TowerCompiler(Protocol):
    """Converts the image tower to another runtime (``openvino_runtime.OpenVinoCompiler``)."""

    runtime: str

    def compile(self, module: nn.Module, root: tuple[nn.Module, tuple[str, ...]], transform: Transform,
                numerics: Numerics) -> Callable[[torch.Tensor], Any]: ...  # takes uint8 NHWC crops


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
    decoder: DeviceDecoder | None = None  # set when JPEGs decode on the device (``info.jpeg_decode``)
    # what each tower casts for "cast once": its root module and the names under it that are not its own
    # (CLIP's towers share one module; ``open_clip_family`` says which half is which)
    tower_roots: dict[str, tuple[nn.Module, tuple[str, ...]]] = field(default_factory=dict)
    numerics: dict[str, Numerics] = field(default_factory=dict)
    compiler: TowerCompiler | None = None  # where the image tower may be converted (the trial's candidates)
    _converted: dict[str, Callable[[torch.Tensor], Any]] = field(init=False, repr=False, default_factory=dict)
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

    @property
    def runs_module(self) -> bool:
        """The image forward runs ``module``'s blocks (its preemption points), not a converted copy."""
        return not self.numerics_of("image").converted

    def numerics_of(self, tower: str) -> Numerics:
        return self.numerics.get(tower, FLOAT32)

    def set_numerics(self, tower: str, numerics: Numerics) -> None:
        """Run ``tower`` (image | text) in ``numerics`` from the next forward on; casting once casts its
        weights now (float32 brings back the very originals); another runtime converts the image tower from
        float32 (once per numerics: ``release_float32`` drops those not served)."""
        self.tower_cast(tower).to(numerics.dtype if numerics.cast else torch.float32)
        if numerics.converted and numerics.name not in self._converted:
            if tower != "image" or self.compiler is None or self.compiler.runtime != numerics.runtime:
                raise NotImplementedError(f"the {tower} tower cannot run in {numerics.name} here")
            self._converted[numerics.name] = self.compiler.compile(self.module, self.tower_roots["image"],
                                                                   self.info.transform, numerics)
        self.numerics[tower] = numerics

    def tower_cast(self, tower: str) -> TowerCast:
        if tower not in self._casts:
            root, skip = self.tower_roots[tower]
            self._casts[tower] = TowerCast(root, skip)
        return self._casts[tower]

    def forget_casts(self) -> None:
        """Drop what the casts kept of the towers (their float32 originals): the towers are on their files now."""
        self._casts.clear()

    def release_float32(self) -> None:
        """Drop the float32 originals of the towers cast once (after the dtype choice): one copy each; and the
        converted towers not served."""
        for casting in self._casts.values():
            casting.release()
        served = {n.name for n in self.numerics.values()}
        self._converted = {name: run for name, run in self._converted.items() if name in served}

    def forward(self, batch: np.ndarray) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run one batch of uint8 crops (N, H, W, 3). Call from the inference thread only."""
        with torch.inference_mode():
            return self._guarded(lambda: self._run(self._upload(batch)))

    def forward_items(self, items: Sequence[np.ndarray | EncodedJpeg]
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, Exception]]:
        """One batch mixing Pillow's crops (H, W, 3) and JPEGs to decode on the device (``decoder``):
        rows in item order, zeros for the items in the third value, which the device could not decode."""
        with torch.inference_mode():
            return self._guarded(lambda: self._forward_items(items))

    def _forward_items(self, items: Sequence[np.ndarray | EncodedJpeg]
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, Exception]]:
        at = [i for i, item in enumerate(items) if isinstance(item, EncodedJpeg)]
        decoded: list[torch.Tensor | None] = []
        failed: dict[int, Exception] = {}
        if at:
            if self.decoder is None:
                raise RuntimeError("JPEGs for the device, but the model has no device decoder")
            decoded, failed = self.decoder.crops([cast(EncodedJpeg, items[i]) for i in at], self.info.transform,
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
        if numerics.converted:  # uint8 NHWC as uploaded: the converted tower normalises in its first op
            return self._outputs(self._converted[numerics.name](x.permute(0, 2, 3, 1)))
        x = x.to(torch.float32).sub_(self._mean).div_(self._std)  # normalised in float32, then cast once
        if numerics.cast:
            x = x.to(numerics.dtype)
        if not self.channels_last:
            x = x.contiguous()
        elif not x.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)  # the device decoder's stacked NCHW crops
        with numerics.autocast(self.device):
            return self._outputs(self.module(x))

    def _outputs(self, out: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
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
