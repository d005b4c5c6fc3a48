"""How one tower runs its numbers: float32, autocast to a lower dtype, or its weights cast to it once.

    Numerics      float32 | bfloat16/float16 autocast | bfloat16/float16 cast once (weights and input), in
                  torch; or float32 | bfloat16 in OpenVINO (``openvino_runtime``: the tower converted)
    TowerCast     swaps a tower's floating-point tensors between their float32 originals and one copy in
                  the lower dtype (``.data``, so TorchScript and shared mmapped tensors work alike)

Autocast re-casts the weights on every call and sets up per shape, which a batcher's mixed sizes make worse;
weights cast once run several times faster on native hardware (figures: docs/SIZING.md#precision). What stays
float32 in a cast tower, and why:

- normalisation layers (BatchNorm, LayerNorm, GroupNorm): their weights and running statistics; a bf16
  running variance keeps 3 significant digits, and CPU kernels take a bf16 input with float32 parameters;
- CLIP's logit scale and bias (``open_clip_family``): a scalar read once into ``ModelInfo``;
- the input normalisation (uint8 - mean) / std (``LoadedModel._run``), cast to the tower's dtype after;
- everything after the forward: rows leave as float32 (``model._cpu``), and the L2 normalisation, softmax
  and zero-shot scores run on them (``pipeline.postprocess``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TORCH, OPENVINO = "torch", "openvino"
KEPT_FLOAT32 = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)  # their parameters and buffers


@dataclass(frozen=True)
class Numerics:
    """How a tower runs: ``dtype`` float32, or a lower dtype by autocast (``cast=False``) or cast once; in torch,
    or converted to another ``runtime`` (its inference precision ``dtype``; the torch tower stays float32)."""

    dtype: torch.dtype = torch.float32
    cast: bool = False
    runtime: str = TORCH

    @property
    def name(self) -> str:
        """``float32``, ``bfloat16 autocast``, ``bfloat16 cast once``, ``openvino bfloat16``: the words in
        ``/v1/models`` and logs."""
        short = str(self.dtype).replace("torch.", "")
        if self.runtime != TORCH:
            return f"{self.runtime} {short}"
        if self.dtype == torch.float32:
            return short
        return f"{short} {'cast once' if self.cast else 'autocast'}"

    @property
    def converted(self) -> bool:
        return self.runtime != TORCH

    def autocast(self, device: torch.device) -> Any:
        """The context a forward runs in: autocast only for the autocast mode."""
        if self.dtype == torch.float32 or self.cast or self.converted:
            return torch.autocast(device.type, enabled=False)
        return torch.autocast(device.type, dtype=self.dtype)


FLOAT32 = Numerics()
OPENVINO_FLOAT32, OPENVINO_BFLOAT16 = Numerics(runtime=OPENVINO), Numerics(torch.bfloat16, runtime=OPENVINO)
OPENVINO_INT8 = Numerics(torch.int8, runtime=OPENVINO)  # weights and activations, calibrated (GREENSERVE_INT8)
# every Numerics by its name: a choice kept as words (``precision_records``) read back
BY_NAME = {n.name: n for n in (FLOAT32, *(Numerics(dtype, cast) for dtype in (torch.bfloat16, torch.float16)
                                          for cast in (True, False)), OPENVINO_FLOAT32, OPENVINO_BFLOAT16,
                               OPENVINO_INT8)}


class TowerCast:
    """The floating-point tensors of a tower (``root``'s, less names under ``skip``), in float32 or cast once."""

    def __init__(self, root: nn.Module, skip: tuple[str, ...] = ()) -> None:
        kept = {id(t) for m in root.modules() if isinstance(m, KEPT_FLOAT32)
                for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
        seen: set[int] = set()
        self.tensors: list[torch.Tensor] = []
        for name, t in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
            if id(t) in seen or id(t) in kept or not t.is_floating_point() or name.startswith(skip):
                continue
            seen.add(id(t))
            self.tensors.append(t)
        self.kept = len(kept)
        self._originals: list[torch.Tensor] | None = [t.data for t in self.tensors]
        self.dtype = torch.float32

    def to(self, dtype: torch.dtype) -> None:
        """Cast the tower to ``dtype`` (float32: back to the very originals, not a round trip)."""
        if dtype == self.dtype:
            return
        if self._originals is None:
            raise RuntimeError("the tower's float32 originals were released (TowerCast.release)")
        self.dtype = dtype  # first: should a cast fail half-way, going back to float32 still restores every tensor
        with torch.no_grad():
            for t, orig in zip(self.tensors, self._originals, strict=True):
                t.data = orig if dtype == torch.float32 else orig.to(dtype)

    def release(self) -> None:
        """Forget the float32 originals once the choice is made (a cast tower then holds one copy)."""
        if self.dtype != torch.float32:
            self._originals = None

    @contextlib.contextmanager
    def trying(self, dtype: torch.dtype) -> Iterator[None]:
        """The tower cast to ``dtype`` for the block, then as it was."""
        before = self.dtype
        self.to(dtype)
        try:
            yield
        finally:
            self.to(before)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
