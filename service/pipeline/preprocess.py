"""Stage 3: RGB image → the model's input pixels (resize shorter side, centre crop), as uint8 HWC.

Normalisation (mean/std, float conversion, layout) happens batched in the inference thread, on the
model's device: a uint8 crop is 4x smaller to queue and to copy to a GPU than a float one.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from service.engine.types import Transform

# Pillow shrinks by an integer factor first when the image is > REDUCING_GAP x the target: much faster,
# same result within a grey level for photos.
REDUCING_GAP = 3.0

_RESAMPLE = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
             "nearest": Image.Resampling.NEAREST, "lanczos": Image.Resampling.LANCZOS}


def preprocess(img: Image.Image, t: Transform) -> np.ndarray:
    """Resize so the shorter side is ``resize_size``, centre-crop ``crop_size``: one resample call.
    ``squash`` (SigLIP's) resizes the whole image to ``crop_size`` square instead; ``Transform.exact``: the
    reference's two steps (``exact``)."""
    w, h = img.size
    if t.resize_mode == "squash":
        out = img.resize((t.crop_size, t.crop_size), _RESAMPLE[t.interpolation])
        return np.asarray(out, dtype=np.uint8)
    if t.exact:
        return exact(img, t)
    scale = t.resize_size / min(w, h)
    # the centre crop, expressed in source pixels, resized straight to crop x crop
    out = img.resize((t.crop_size, t.crop_size), _RESAMPLE[t.interpolation], box=t.crop_box(w, h),
                     reducing_gap=REDUCING_GAP if scale < 1 / REDUCING_GAP else None)
    return np.asarray(out, dtype=np.uint8)


def exact(img: Image.Image, t: Transform) -> np.ndarray:
    """immich's shortest-side transform, pixel for pixel: the whole image resized (the longer side's length
    truncated to an integer), then cropped at the centre's offset truncated to an integer. open_clip's own PIL
    transform is the same but rounds the offset: a pixel's shift where the resized side's excess is odd."""
    size = resized_size(*img.size, t.resize_size)
    left, top = (int(side / 2 - t.crop_size / 2) for side in size)
    out = img.resize(size, _RESAMPLE[t.interpolation]).crop((left, top, left + t.crop_size, top + t.crop_size))
    return np.asarray(out, dtype=np.uint8)


def resized_size(width: int, height: int, short: int) -> tuple[int, int]:
    """(width, height) with the shorter side ``short`` and the longer scaled by the aspect ratio, truncated."""
    if width < height:
        return short, int(height / width * short)
    return int(width / height * short), short
