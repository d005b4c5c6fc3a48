"""Weight files: a state dict (``torch.save`` or ``.safetensors``) mapped from disk, so the workers share its
pages through the page cache, and the check that a model built on the meta device got every tensor."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from service.engine.types import ModelLoadError

RANDOM_SEED = 0  # random weights are seeded so every worker serves the same (meaningless) model


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """A state dict file (``torch.save`` or ``.safetensors``), memory-mapped (workers share its pages),
    ``module.`` prefixes dropped."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return {k.removeprefix("module."): v for k, v in load_file(path).items()}
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, OSError, ValueError, EOFError) as exc:
        raise ModelLoadError(f"cannot read weights file {path!r} as a state dict or TorchScript ({exc}); "
                             "save it with torch.save(model.state_dict(), path)") from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{path!r} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def adopt(module: nn.Module, state: dict[str, torch.Tensor], what: str, hint: str = "") -> nn.Module:
    """A module built on the meta device takes the file's (mmapped) tensors as its own: no second copy of
    the weights, and the workers share the file's pages."""
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"the weights do not fit {what}: {str(exc)[:500]}{hint}") from exc
    return module


def unset_tensors(model: nn.Module) -> list[str]:
    """Parameters and buffers still on the meta device (the weights file did not set them)."""
    return [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]


def check_all_set(model: nn.Module, what: str) -> None:
    missing = unset_tensors(model)
    if missing:
        raise ModelLoadError(f"the weights file leaves {what} tensors unset: {', '.join(missing[:5])}")


def digest(module: nn.Module) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes, as loaded: the same weights from any file or
    seed give the same digest, and any change gives another (a small part of the load's time)."""
    h = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:32]
