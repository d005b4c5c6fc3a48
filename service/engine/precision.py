"""Which dtype a worker serves in. ``GREENSERVE_DTYPE=auto`` (the default) takes a lower precision only
where the hardware runs it natively *and* a probe batch shows it gives the same answers as float32:

    hardware                                candidate    else
    CUDA, compute capability >= 8.0         bfloat16     float32
    CUDA 7.x (tensor cores, no bf16)        float16      float32
    CPU with AMX (amx_bf16) or avx512_bf16  bfloat16     float32
    any other CPU                           none         float32, no probe (bf16 would be emulated: slower)

The probe (``PROBE_IMAGES`` photo-like crops, and ``PROBE_TEXTS`` for a text tower) runs in float32 and in
the candidate; the candidate is kept only if every embedding has cosine >= ``MIN_COSINE`` to its float32
one and every image has the same top-1 class. A pinned value (float32, bfloat16, float16) is served as
given, unprobed. Runs in the worker's inference thread, before warm-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.engine.model import LoadedModel, dtype_name

log = logging.getLogger(__name__)

MIN_COSINE = 0.9999
PROBE_IMAGES = 8
PROBE_TEXTS = ("a photo of a dog.", "a photo of a cat on a sofa.", "a city street at night.", "a bowl of fruit.")
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class Probe:
    """float32 against the candidate on the probe batch."""

    candidate: str
    images: int
    min_cosine: float  # embeddings (or, for a logits-only model, logits), the worst image or text
    top1_same: int | None  # images whose top-1 class matched; None for a model without logits
    ms_float32: float
    ms_candidate: float

    @property
    def agrees(self) -> bool:
        return self.min_cosine >= MIN_COSINE and self.top1_same in (None, self.images)

    def text(self) -> str:
        top1 = "" if self.top1_same is None else f", top-1 same on {self.top1_same}/{self.images}"
        return (f"probe of {self.images} images: min cosine {self.min_cosine:.6f} (needs >= {MIN_COSINE}){top1}; "
                f"{self.ms_float32:.0f} ms float32, {self.ms_candidate:.0f} ms {self.candidate}")


@dataclass(frozen=True)
class Precision:
    """The dtype a worker serves in, and why: ``ModelInfo.precision``, in ``/v1/models`` and the start-up log."""

    requested: str  # GREENSERVE_DTYPE
    chosen: str
    hardware: str  # what the choice was made on: "cpu avx2", "cpu avx512_bf16", "cuda sm_90 NVIDIA H200"
    reason: str
    probe: Probe | None = None

    def public(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requested": self.requested, "chosen": self.chosen, "hardware": self.hardware,
                               "reason": self.reason, "min_cosine": MIN_COSINE}
        if self.probe is not None:
            p = self.probe
            out["probe"] = {"candidate": p.candidate, "images": p.images, "min_cosine": round(p.min_cosine, 7),
                            "top1_same": p.top1_same, "ms_float32": round(p.ms_float32, 1),
                            "ms_candidate": round(p.ms_candidate, 1)}
        return out


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``); empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def candidate_for(device: torch.device, cpu_bf16: str = "auto",
                  flags: frozenset[str] | None = None) -> tuple[torch.dtype | None, str]:
    """The lower precision this hardware runs natively (None: float32 only), and the hardware in words.

    ``cpu_bf16`` (``GREENSERVE_CPU_BF16``) overrides the CPU check: ``yes`` where the flags are hidden
    (some VMs), ``no`` to keep float32."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        hardware = f"cuda sm_{major}{minor} {torch.cuda.get_device_name(device)}"
        if major >= 8:
            return torch.bfloat16, hardware
        return (torch.float16 if major == 7 else None), hardware
    flags = cpu_flags() if flags is None else flags
    native = [f for f in CPU_BF16_FLAGS if f in flags]
    simd = next((f for f in ("avx512f", "avx2", "neon", "asimd") if f in flags), "baseline")
    hardware = f"cpu {' '.join(native) or simd}"
    if cpu_bf16 == "yes" or cpu_bf16 == "auto" and native:
        return torch.bfloat16, hardware + (" (GREENSERVE_CPU_BF16=yes)" if cpu_bf16 == "yes" else "")
    return None, hardware + (" (GREENSERVE_CPU_BF16=no)" if cpu_bf16 == "no" else "")


def settle(model: LoadedModel, requested: str, *, cpu_bf16: str = "auto",
           flags: frozenset[str] | None = None) -> Precision:
    """Set ``model``'s serving dtype from ``requested`` (``GREENSERVE_DTYPE``); log and record why."""
    candidate, hardware = candidate_for(model.device, cpu_bf16, flags)
    if requested != "auto":
        precision = Precision(requested, requested, hardware, "pinned by GREENSERVE_DTYPE")
        model.dtype = getattr(torch, requested)
    else:
        precision = _choose(model, candidate, hardware)
    model.info = replace(model.info, dtype=precision.chosen, precision=precision)
    log.info("serving in %s (GREENSERVE_DTYPE=%s): %s", precision.chosen, requested, precision.reason)
    return precision


def _choose(model: LoadedModel, candidate: torch.dtype | None, hardware: str) -> Precision:
    if candidate is None:
        model.dtype = torch.float32
        return Precision("auto", "float32", hardware, f"{hardware}: no native bfloat16 or float16 (it would be "
                         "emulated, slower than float32), so float32")
    probe = run_probe(model, candidate)
    name = dtype_name(candidate)
    if probe.agrees:
        model.dtype = candidate
        return Precision("auto", name, hardware, f"{hardware}: {name} agreed with float32 ({probe.text()})", probe)
    model.dtype = torch.float32
    return Precision("auto", "float32", hardware, f"{hardware}: {name} disagreed with float32 ({probe.text()}), "
                     "so float32", probe)


def run_probe(model: LoadedModel, candidate: torch.dtype) -> Probe:
    """The probe batch through ``model`` in float32 and in ``candidate``; leaves ``model.dtype`` as it was."""
    pixels = probe_pixels(model.info.transform.crop_size)
    kept = model.dtype
    try:
        (f32, logits32), ms32 = _timed(model, torch.float32, pixels)
        (low, logits_low), ms_low = _timed(model, candidate, pixels)
        cosines = [_min_cosine(f32, low) if f32 is not None else _min_cosine(logits32, logits_low)]
        if model.text is not None:
            ids = model.tokenize(PROBE_TEXTS).ids
            model.dtype = torch.float32
            t32 = model.encode_text(ids)
            model.dtype = candidate
            cosines.append(_min_cosine(t32, model.encode_text(ids)))
    finally:
        model.dtype = kept
    top1 = None
    if logits32 is not None and logits_low is not None:
        top1 = int((logits32.argmax(dim=1) == logits_low.argmax(dim=1)).sum())
    return Probe(dtype_name(candidate), len(pixels), min(cosines), top1, ms32, ms_low)


def _timed(model: LoadedModel, dtype: torch.dtype, pixels: np.ndarray) -> tuple[tuple[Any, Any], float]:
    model.dtype = dtype
    model.forward(pixels[:1])  # the first call at a dtype pays for kernel selection and weight casts
    started = time.perf_counter()
    out = model.forward(pixels)
    return out, (time.perf_counter() - started) * 1000


def _min_cosine(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    assert a is not None and b is not None
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1).min())


def probe_pixels(size: int, n: int = PROBE_IMAGES) -> np.ndarray:
    """``n`` deterministic photo-like uint8 crops (N, size, size, 3): smooth colour fields with blobs, edges
    and sensor-like noise, so the probe exercises the model the way photos do (flat or white-noise inputs
    make near-constant features that agree in any precision)."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    out = np.empty((n, size, size, 3), np.uint8)
    for i in range(n):
        base = rng.uniform(0, 255, 3) * (1 - yy[..., None]) + rng.uniform(0, 255, 3) * xx[..., None]
        img = base.copy()
        for _ in range(6):  # soft blobs and hard-edged discs of random colours
            cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
            d2 = ((yy - cy) ** 2 + (xx - cx) ** 2) / r**2
            mask = np.exp(-d2)[..., None] if rng.uniform() < 0.5 else (d2 < 1)[..., None]
            img = img * (1 - mask) + rng.uniform(0, 255, 3) * mask
        img += rng.normal(0, 6, img.shape)
        out[i] = np.clip(img, 0, 255).astype(np.uint8)
    return out
