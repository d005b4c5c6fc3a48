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
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from service.engine import openvino_runtime, precision, weights
from service.engine.casting import FLOAT32, Numerics, dtype_name
from service.engine.model import LoadedModel
from service.engine.precision_records import FleetStore, Memo
from service.engine.types import INT8_ALLOW_COSINE, DeviceDecoder, ModelLoadError
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


def import_family(spec: str) -> None:
    """Import the family module of ``spec`` here, in the worker's main thread, before the loader thread
    starts. An import may run a subprocess (trio, which open_clip pulls in through huggingface_hub and
    httpcore when it is installed, asks ldconfig for libpthread), and gevent's subprocess works only on the
    hub's thread: imported in the loader thread, the model failed to load. A bad name is the loader's to
    report."""
    try:
        importlib.import_module(FAMILY_MODULES[parse_model_name(spec)[0]])
    except ModelLoadError:
        pass


def load_model(name: str, weights: str, *, device: torch.device | None = None, channels_last: bool = True,
               numerics: Numerics = FLOAT32) -> LoadedModel:
    """Load ``name`` (``GREENSERVE_MODEL``) with ``weights`` (``GREENSERVE_WEIGHTS``) through its family, every
    tower in ``numerics`` (``precision.settle`` chooses per tower instead)."""
    started = time.perf_counter()
    family, arch = parse_model_name(name)
    device = device or torch.device("cpu")
    loader = importlib.import_module(FAMILY_MODULES[family])
    extra = {} if family == "open_clip" else {"channels_last": channels_last}  # CLIP's ViTs: no convolutions
    model: LoadedModel = loader.load(arch, weights, device=device, **extra)
    _describe(model, started)
    if numerics != FLOAT32:
        for tower in model.towers:
            model.set_numerics(tower, numerics)
        model.info = replace(model.info, dtype=dtype_name(numerics.dtype))
    return model


def _describe(model: LoadedModel, started: float) -> None:
    """The tail every family shares: one probe forward (first-call allocations paid here) tells the
    embedding width, whether the image tower gives features at all (a TorchScript classifier: logits only)
    and the head's width, which names the classes when the family's list does not match."""
    crop = model.info.transform.crop_size
    feats, logits = model.forward(np.zeros((1, crop, crop, 3), np.uint8))
    info = model.info
    tasks = info.tasks if feats is not None else tuple(t for t in info.tasks if t != "embeddings")
    labels = info.labels
    if logits is not None and logits.shape[1] != len(labels):
        labels = tuple(f"class_{i}" for i in range(logits.shape[1]))
    model.info = replace(info, tasks=tasks, labels=labels, embedding_dim=None if feats is None else feats.shape[1],
                         weights_digest=weights.digest(model.module), load_seconds=time.perf_counter() - started)


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


def load_for_worker(settings: Settings, slot: int, decoder: DeviceDecoder, memo: Memo | None = None,
                    fleet: FleetStore | None = None) -> LoadedModel:
    """The worker's model as configured: its device, its numerics settled (as an earlier worker of this
    server measured them, through ``memo``, else as the fleet's first instance did, through ``fleet``, else
    measured here), where its JPEGs decode (on the device through ``decoder`` when it can). Runs in the
    worker's inference thread, after fork: the first torch op of this process."""
    torch.set_num_threads(settings.torch_threads_per_worker())
    device = resolve_device(settings.device, slot)
    log.info("loading %s (weights=%s) on %s with %d torch thread(s)", settings.model, settings.weights,
             device, torch.get_num_threads())
    model = load_model(settings.model, settings.weights, device=device, channels_last=settings.channels_last)
    runtimes = _converters(settings, model)
    # before warm-up (it warms the chosen numerics), timed at the sizes the batchers form
    try:
        precision.settle(model, settings.dtype, cpu_bf16=settings.cpu_bf16,
                         image_sizes=precision.batch_sizes(settings.max_batch),
                         text_sizes=precision.batch_sizes(settings.max_text_batch), memo=memo, fleet=fleet,
                         runtimes=runtimes, int8_min_cosine=_int8_bound(settings) if runtimes else None)
    finally:
        if fleet is not None:
            fleet.close()  # read once at boot: its connection is not kept for the worker's life
    on_device, why = decoder.usable(settings.jpeg_decode, device, model.info.transform)
    model.decoder = decoder if on_device else None
    model.info = replace(model.info, jpeg_decode="device" if on_device else "pillow")
    log.info("JPEG decoding: %s (%s)", model.info.jpeg_decode, why)
    return model


def _converters(settings: Settings, model: LoadedModel) -> tuple[str, ...]:
    """Give ``model`` a compiler for the other runtimes its image tower may try (OpenVINO, where installed, on a
    CPU, under GREENSERVE_DTYPE=auto); their names and versions. GREENSERVE_RUNTIMES=auto leaves a model with a
    text tower on torch: its searches run between the blocks of a torch image forward, and a converted forward
    has none (immich's load shape: a search's p99 beside 8 backfill clients went from 1.2x idle to 3.0x)."""
    ov_version = openvino_runtime.version()
    if settings.runtimes == "torch" or settings.dtype != "auto" or model.device.type != "cpu" or ov_version is None:
        return ()
    if settings.runtimes == "auto" and model.text is not None:
        log.info("the image tower stays on torch: its searches run between its blocks (GREENSERVE_RUNTIMES=openvino "
                 "tries OpenVINO for it too)")
        return ()
    model.compiler = openvino_runtime.OpenVinoCompiler(Path(settings.cache_directory()) / "openvino",
                                                       torch.get_num_threads())
    int8 = _int8_bound(settings)
    return (f"openvino {ov_version}", *((f"int8 >= {int8}",) if int8 is not None else ()))


def _int8_bound(settings: Settings) -> float | None:
    """The agreement an int8 tower must keep to serve (GREENSERVE_INT8), or None: int8 is not tried."""
    return None if settings.int8 == "off" else INT8_ALLOW_COSINE if settings.int8 == "allow" else float(settings.int8)
