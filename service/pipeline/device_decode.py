"""JPEGs decoded on the model's device (``GREENSERVE_JPEG_DECODE=device``; the default on CUDA): nvJPEG
through ``torchvision.io.decode_jpeg(device="cuda")``, a whole batch in one call, then EXIF orientation,
resize and centre crop as tensor ops on the device. Everything here runs in the worker's one inference
thread, so the hub never waits on CUDA and no other thread touches the device.

The safety checks stay in the decode threads (``decode.jpeg_for_device``): the format sniffed and allow-listed,
the pixel limit and the EXIF orientation read from the header, before anything is decoded. Only JPEGs
that pass come here as ``EncodedJpeg``; a JPEG the device cannot decode is sent back (``DeviceDecodeFailed``)
and goes through Pillow like every other format.

This module is the engine's ``DeviceDecoder`` (``engine.types``): the worker's boot hands it to the model,
which calls ``crops`` for the JPEGs of a batch in its inference thread. The engine never imports it.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence

import torch
from torch.nn import functional as F

from service.engine.types import EncodedJpeg, Transform

log = logging.getLogger(__name__)

INTERPOLATIONS = ("bilinear", "bicubic")  # Pillow's filters that torch reproduces (antialiased); lanczos is not


class DeviceDecodeFailed(Exception):
    """The device could not decode this JPEG (an unusual subsampling, a corrupt scan): decode it with Pillow."""


def usable(mode: str, device: torch.device, transform: Transform) -> tuple[bool, str]:
    """Whether JPEGs go to the device under ``GREENSERVE_JPEG_DECODE=mode``, and why (for the start-up log)."""
    if mode == "pillow":
        return False, "GREENSERVE_JPEG_DECODE=pillow"
    if mode == "auto" and device.type != "cuda":
        return False, f"the model is on {device} (auto decodes on the device only on CUDA)"
    if transform.exact:
        return False, "the model's preprocessing is exact (Pillow's pixels, as its reference has them)"
    if transform.interpolation not in INTERPOLATIONS:
        return False, f"the model resizes with {transform.interpolation}, which only Pillow has"
    try:  # a tiny JPEG through the whole path: a missing nvJPEG shows here, and its first call is paid
        from torchvision.io import encode_jpeg

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # as in ``_decode``
            probe = encode_jpeg(torch.full((3, 16, 16), 128, dtype=torch.uint8)).numpy()
        _, failed = crops([EncodedJpeg(probe)], transform, device)
        if failed:
            raise failed[0]
    except (RuntimeError, DeviceDecodeFailed, ImportError) as exc:
        return False, f"{device} cannot decode JPEGs here ({str(exc)[:200]})"
    return True, f"JPEGs are decoded on {device} in batches" + (" (nvJPEG)" if device.type == "cuda" else "")


def crops(jpegs: Sequence[EncodedJpeg], transform: Transform, device: torch.device
          ) -> tuple[list[torch.Tensor | None], dict[int, Exception]]:
    """Each JPEG decoded, upright, resized and cropped on ``device``: (3, crop, crop) uint8, or None with
    the reason in the second value."""
    tensors = [torch.from_numpy(j.data) for j in jpegs]
    failed: dict[int, Exception] = {}
    try:
        images: list[torch.Tensor | None] = list(_decode(tensors, device))
    except torch.OutOfMemoryError:
        raise  # the batcher splits the batch: fewer JPEGs per call
    except RuntimeError:  # one bad file fails the batch call: find it
        images = []
        for i, t in enumerate(tensors):
            try:
                images.append(_decode([t], device)[0])
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as exc:
                images.append(None)
                failed[i] = DeviceDecodeFailed(f"{device} could not decode this JPEG ({str(exc)[:200]})")
    out: list[torch.Tensor | None] = []
    for j, img in zip(jpegs, images, strict=True):
        out.append(None if img is None else resize_crop(upright(img, j.orientation), transform))
    return out, failed


def _decode(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg  # only workers that decode on the device pay for it

    with warnings.catch_warnings():
        # torchvision 0.29 marks its image codecs deprecated in favour of TorchCodec; the decoder still works
        # and is what is pinned and tested here (moving to TorchCodec is noted in docs/BENCHMARKS.md)
        warnings.simplefilter("ignore", DeprecationWarning)
        return list(decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device))


def upright(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """(3, H, W) turned the way EXIF orientation ``orientation`` says, as Pillow's ``exif_transpose`` does."""
    if orientation == 2:
        return img.flip(-1)
    if orientation == 3:
        return img.flip(-2, -1)
    if orientation == 4:
        return img.flip(-2)
    if orientation == 5:
        return img.transpose(-2, -1)
    if orientation == 6:
        return img.rot90(-1, dims=(-2, -1))
    if orientation == 7:
        return img.transpose(-2, -1).flip(-2, -1)
    if orientation == 8:
        return img.rot90(1, dims=(-2, -1))
    return img


def resize_crop(img: torch.Tensor, t: Transform) -> torch.Tensor:
    """(3, H, W) uint8 → (3, crop, crop) uint8: the region ``Transform.crop_box`` keeps, resized in one
    antialiased step as Pillow's box resize does, rounded back to 8 bits like the Pillow path's crops."""
    _, h, w = img.shape
    left, top, right, bottom = t.crop_box(w, h)
    x0, y0 = math.floor(left + 0.5), math.floor(top + 0.5)
    x1, y1 = max(x0 + 1, math.floor(right + 0.5)), max(y0 + 1, math.floor(bottom + 0.5))
    region = img[None, :, y0:y1, x0:x1].float()
    out = F.interpolate(region, size=(t.crop_size, t.crop_size), mode=t.interpolation, antialias=True,
                        align_corners=False)
    return out.round_().clamp_(0, 255).to(torch.uint8)[0]
