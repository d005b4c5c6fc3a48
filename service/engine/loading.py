"""Loading the configured model: the name parsed, its family's loader, the device chosen.

    GREENSERVE_MODEL          family            towers          embeddings from
    resnet50, torchvision:X   torchvision_family  image          the pooled features before the classifier
    open_clip:ARCH            open_clip_family  image + text    CLIP/SigLIP's joint space (``encode_image``/``text``)
    timm:NAME                 timm_family       image           the pooled pre-logits features

Runs in the worker's inference thread, after fork: never in the gunicorn master (libgomp and CUDA are not
fork-safe).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import replace

import torch

from service.engine import device_decode, precision
from service.engine.casting import FLOAT32, Numerics, dtype_name
from service.engine.model import LoadedModel
from service.engine.types import ModelLoadError
from service.settings import Settings

log = logging.getLogger(__name__)
# family -> its module, imported only when served (timm and open_clip are slow to import, and memory)
FAMILY_MODULES = {"torchvision": "service.engine.torchvision_family", "open_clip": "service.engine.open_clip_family",
                  "timm": "service.engine.timm_family"}
FAMILIES = tuple(FAMILY_MODULES)


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
    loader = importlib.import_module(FAMILY_MODULES[family])
    extra = {} if family == "open_clip" else {"channels_last": channels_last}  # CLIP's ViTs: no convolutions
    model: LoadedModel = loader.load(arch, weights, device=device, **extra)
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


def load_for_worker(settings: Settings, slot: int) -> LoadedModel:
    """The worker's model as configured: its device, its numerics settled, where its JPEGs decode. Runs in
    the worker's inference thread, after fork: the first torch op of this process."""
    torch.set_num_threads(settings.torch_threads_per_worker())
    device = resolve_device(settings.device, slot)
    log.info("loading %s (weights=%s) on %s with %d torch thread(s)", settings.model, settings.weights,
             device, torch.get_num_threads())
    model = load_model(settings.model, settings.weights, device=device, channels_last=settings.channels_last)
    # before warm-up (it warms the chosen numerics), timed at the sizes the batchers form
    precision.settle(model, settings.dtype, cpu_bf16=settings.cpu_bf16,
                     image_sizes=precision.batch_sizes(settings.max_batch),
                     text_sizes=precision.batch_sizes(settings.max_text_batch))
    on_device, why = device_decode.usable(settings.jpeg_decode, device, model.info.transform)
    model.info = replace(model.info, jpeg_decode="device" if on_device else "pillow")
    log.info("JPEG decoding: %s (%s)", model.info.jpeg_decode, why)
    return model
