"""What a decode thread does with an image's bytes: decoded and cropped to the model's input, or, for a
model that decodes JPEGs on its device, checked and left encoded."""

from __future__ import annotations

import numpy as np

from service.engine.types import EncodedJpeg, Transform
from service.pipeline.decode import decode_image, decode_opened, jpeg_for_device, open_checked
from service.pipeline.preprocess import preprocess


def decode_and_crop(data: bytes, transform: Transform, max_pixels: int) -> np.ndarray:
    """Runs in a decode thread: safe decode (JPEG draft at the resize size) then resize + crop."""
    return preprocess(decode_image(data, max_pixels=max_pixels, draft_size=draft_size(transform)), transform)


def checked_for_device(data: bytes, transform: Transform, max_pixels: int) -> np.ndarray | EncodedJpeg:
    """Runs in a decode thread when the model decodes JPEGs on its device: a JPEG that passes the header
    checks goes on encoded; anything else is decoded and cropped here, as without device decoding."""
    img = open_checked(data, max_pixels)  # header only: opened once, whichever way it is decoded
    jpeg = jpeg_for_device(img, data)
    if jpeg is not None:
        return jpeg
    return preprocess(decode_opened(img, data, draft_size=draft_size(transform)), transform)


# An exact transform (a reference's own steps, immich's) decodes JPEGs at no less than twice its resize size: a
# 1440-px preview at libjpeg's 1/2 scale costs 12.5 CPU-ms instead of 28 for every pixel, and its crop is within
# 0.18 grey levels of the reference's (cosine 0.999997; at the resize size itself, 0.74: docs/MODELS.md, immich).
EXACT_DRAFT_FACTOR = 2


def draft_size(transform: Transform) -> int:
    """The JPEG draft scale's floor: the resize size, twice it for an exact transform."""
    return transform.resize_size * (EXACT_DRAFT_FACTOR if transform.exact else 1)
