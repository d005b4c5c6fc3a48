"""Image bytes for tests, made on the fly (deterministic): photos, odd modes, broken and hostile files."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def photo(width: int = 640, height: int = 480, seed: int = 0) -> Image.Image:
    """A smooth, photo-like RGB image (gradients + noise), different per seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([(x / width) * 255, (y / height) * 255, ((x + y) / (width + height)) * 255], axis=-1)
    base = (base * rng.uniform(0.4, 1.0, 3) + rng.uniform(0, 80, 3)) % 256
    noise = rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def scene(width: int, height: int, seed: int = 0) -> Image.Image:
    """A photo-like scene: a sky's gradient, overlapping shapes with sharp and soft edges, a striped texture,
    and sensor noise; different per seed. Where resamplers differ (edges, fine detail), unlike ``photo``'s
    gradients."""
    rng = np.random.default_rng(seed)
    sky = photo(width, height, seed).filter(ImageFilter.GaussianBlur(max(width, height) / 200))
    draw = ImageDraw.Draw(sky)
    for _ in range(12):
        x, y = rng.uniform(-0.2, 1.0, 2) * (width, height)
        w, h = rng.uniform(0.05, 0.5, 2) * (width, height)
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x, y, x + w, y + h), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    stripes = np.sin(np.arange(width) * rng.uniform(0.2, 1.5))[None, :, None] * 20
    pixels = np.asarray(sky.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.5))), np.float32)
    pixels[: height // 3] += stripes  # a fine texture (grass, fabric) over the top third
    pixels += rng.normal(0, 3, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def preview(width: int, height: int, seed: int = 0) -> bytes:
    """``scene`` as immich's server writes a preview for its machine learning: JPEG at quality 80, whose chroma
    it keeps whole (4:4:4) from quality 80 on, without EXIF (upright already)."""
    return encode(scene(width, height, seed), "JPEG", quality=80, subsampling=0)


def encode(img: Image.Image, fmt: str = "JPEG", **params: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **params)
    return buf.getvalue()


def jpeg(width: int = 640, height: int = 480, seed: int = 0, **params: object) -> bytes:
    return encode(photo(width, height, seed), "JPEG", quality=90, **params)


def jpeg_with_orientation(orientation: int, width: int = 64, height: int = 32) -> bytes:
    img = photo(width, height)
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", exif=exif)


def truncated_jpeg() -> bytes:
    data = jpeg(640, 480)
    return data[: len(data) // 2]


def pixel_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A tiny PNG that claims a huge canvas (1-bit, all black: compresses to almost nothing). Written chunk by chunk:
    Pillow would first make the whole canvas in memory, a byte per pixel."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # bit depth 1, greyscale, no interlace
    rows = bytes(height * (1 + (width + 7) // 8))  # each row: filter type 0, then its packed pixels
    return PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def tiff() -> bytes:
    return encode(photo(32, 32), "TIFF")


def solid(value: int, fmt: str = "PNG") -> bytes:
    """A 40x40 image of one grey (``value`` in each channel): the fake model's answer for it is known."""
    return encode(Image.new("RGB", (40, 40), (value, value, value)), fmt)


def data_url(blob: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(blob).decode()


HTML = b"<!doctype html><html><body>not an image</body></html>"
