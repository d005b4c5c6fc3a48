"""The inputs a precision trial runs (``precision``): photo-like crops for an image tower, short queries for a
text tower. Deterministic, so two workers (or two instances) time and compare the same work."""

from __future__ import annotations

import numpy as np

PROBE_IMAGES = 8
PROBE_TEXTS = ("a photo of a dog.", "a photo of a cat on a sofa.", "a city street at night.", "a bowl of fruit.")


def probe_pixels(size: int, n: int = PROBE_IMAGES, seed: int = 0) -> np.ndarray:
    """``n`` deterministic photo-like uint8 crops (N, size, size, 3): smooth colour fields with blobs, edges
    and sensor-like noise, so the probe exercises the model the way photos do (flat or white-noise inputs
    make near-constant features that agree in any precision). Another ``seed``: other photos (int8's
    calibration, so that the trial's agreement is measured on photos it was not calibrated on)."""
    rng = np.random.default_rng(seed)
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
