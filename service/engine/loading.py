"""Loading the configured model: the name parsed, its family's loader, the device chosen.

    GREENSERVE_MODEL          family            towers          embeddings from
    resnet50, torchvision:X   torchvision_family  image          the pooled features before the classifier
    open_clip:ARCH            open_clip_family  image + text    CLIP/SigLIP's joint space (``encode_image``/``text``)
    timm:NAME                 timm_family       image           the pooled pre-logits features

Runs in the worker's inference thread, after fork: never in the gunicorn master (libgomp and CUDA are not
fork-safe).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from service.engine import open_clip_family, timm_family, torchvision_family
from service.engine.casting import FLOAT32, Numerics, dtype_name
from service.engine.model import LoadedModel
from service.engine.types import ModelLoadError

FAMILIES = ("torchvision", "open_clip", "timm")


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


def load_model(name: str, weights: str, *, device: torch.device | None = None, channels_last: bool = True,
               numerics: Numerics = FLOAT32) -> LoadedModel:
    """Load ``name`` (``GREENSERVE_MODEL``) with ``weights`` (``GREENSERVE_WEIGHTS``) through its family, every
    tower in ``numerics`` (``precision.settle`` chooses per tower instead)."""
    family, arch = parse_model_name(name)
    device = device or torch.device("cpu")
    model: LoadedModel
    if family == "open_clip":
        model = open_clip_family.load(arch, weights, device=device)
    elif family == "timm":
        model = timm_family.load(arch, weights, device=device, channels_last=channels_last)
    else:
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
