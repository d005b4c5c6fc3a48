"""Apples to apples: does a design serve the same embeddings as the reference for the same album?

Random weights make every image's embedding alike (a random resnet50 gives cosine up to 0.9997 between
*different* photos), so a plain cosine ≥ 0.999 would pass even with the images swapped. The check is
therefore three-fold, per image:

    cosine             ≥ 0.999   of the L2-normalised embeddings
    centered cosine    ≥ 0.999   after subtracting the reference album's mean embedding (different
                                 photos score ~0.7 here: the check can tell them apart)
    max |a - b|        ≤ 5e-4    elementwise, on the normalised embeddings (different photos: ≥ 2e-3)

plus: each image's nearest reference embedding is its own. Thread count and batch composition change
float summation order, so exact equality is not expected (measured: ~1e-6).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

TOLERANCE = {"cosine": 0.999, "centered_cosine": 0.999, "max_abs_diff": 5e-4}
# a server that chose bfloat16/float16 (GREENSERVE_DTYPE=auto on native hardware): its trial kept it at
# cosine >= 0.9999 on probe crops; different photos stay far below these (centered ~0.7, diff >= 2e-3 is
# not asked of it) and each photo must still be nearest its own reference
LOW_PRECISION = {"cosine": 0.999, "centered_cosine": 0.95, "max_abs_diff": 1.0}


@dataclass(frozen=True)
class Check:
    images: int
    min_cosine: float
    min_centered_cosine: float
    max_abs_diff: float
    nearest_is_self: bool
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(emb: np.ndarray, ref: np.ndarray, tolerance: dict[str, float] = TOLERANCE) -> Check:
    """Compare ``emb`` (images x dim) with ``ref`` row by row, within ``tolerance``."""
    if emb.shape != ref.shape:
        return Check(int(emb.shape[0]), 0.0, 0.0, float("inf"), False, False)
    a, b = _unit(emb), _unit(ref)
    cos = np.sum(a * b, axis=1)
    mean = b.mean(axis=0, keepdims=True)
    ca, cb = _unit(a - mean), _unit(b - mean)
    centered = np.sum(ca * cb, axis=1)
    diff = float(np.abs(a - b).max())
    nearest = bool(np.all(np.argmax(ca @ cb.T, axis=1) == np.arange(len(b)))) if len(b) > 1 else True
    ok = (float(cos.min()) >= tolerance["cosine"] and float(centered.min()) >= tolerance["centered_cosine"]
          and diff <= tolerance["max_abs_diff"] and nearest)
    return Check(int(len(b)), round(float(cos.min()), 6), round(float(centered.min()), 6), diff, nearest, ok)


def spread(ref: np.ndarray) -> dict[str, float]:
    """How alike the album's *different* photos are: what the tolerances must stay clear of."""
    a = _unit(ref)
    n = len(a)
    if n < 2:
        return {}
    off = ~np.eye(n, dtype=bool)
    c = _unit(a - a.mean(axis=0, keepdims=True))
    pair_diff = np.abs(a[:, None, :] - a[None, :, :]).max(axis=2)
    return {"max_cosine_between_photos": round(float((a @ a.T)[off].max()), 6),
            "max_centered_cosine_between_photos": round(float((c @ c.T)[off].max()), 6),
            "min_max_abs_diff_between_photos": float(pair_diff[off].min())}


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
