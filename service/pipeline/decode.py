"""Stage 2: bytes → an RGB Pillow image, safely and fast. Runs in the worker's decode thread pool.

Safety: an allow-list of decoders, a pixel limit checked from the header before any pixel
is decoded (Pillow's DecompressionBombWarning is made an error too), truncated files refused (``load()``
catches what ``verify()`` misses), ``LOAD_TRUNCATED_IMAGES`` left off. Speed: JPEG draft mode lets libjpeg
decode at 1/2, 1/4 or 1/8 scale when the model needs far fewer pixels than the photo has.
"""

from __future__ import annotations

import io
import logging
import warnings

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from service.engine.types import EncodedJpeg
from service.errors import ImageTooLarge, NotAnImage, UnsupportedImage

log = logging.getLogger(__name__)

# Decoders that phones, browsers and CDNs produce. (Phones' MPO files open through the JPEG decoder.)
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
# Magic numbers of image formats we recognise but refuse (most decoder CVEs live in these).
_REFUSED_MAGIC = (
    (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"8BPS", "PSD"), (b"%!PS", "EPS"), (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"), (b"\xffO\xffQ", "JPEG 2000"), (b"SIMPLE  =", "FITS"),
    (b"\x00\x00\x01\x00", "ICO"), (b"icns", "ICNS"), (b"%PDF", "PDF"), (b"qoif", "QOI"), (b"DDS ", "DDS"),
)
ORIENTATION_TAG = 0x0112
_FTYP_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF", b"avif": "AVIF", b"avis": "AVIF"}


def configure_pillow(max_pixels: int) -> None:
    """Process-wide Pillow safety switches; called once per worker by ``create_app``."""
    Image.MAX_IMAGE_PIXELS = max_pixels
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    # Pillow only raises above 2x the limit; between 1x and 2x it warns. Make that an error too.
    warnings.simplefilter("error", Image.DecompressionBombWarning)


def decode_image(data: bytes, *, max_pixels: int, draft_size: int | None = None) -> Image.Image:
    """Decode ``data`` into an RGB image (first frame, EXIF orientation applied).

    ``draft_size`` is the shortest side the caller will resize to; JPEGs are decoded at the smallest
    libjpeg scale that still covers it.
    """
    return decode_opened(open_checked(data, max_pixels), data, draft_size=draft_size)


def decode_opened(img: Image.Image, data: bytes, *, draft_size: int | None = None) -> Image.Image:
    """``decode_image`` for an image ``open_checked`` already opened from ``data``."""
    if draft_size and img.format in ("JPEG", "MPO"):
        img.draft("RGB", (draft_size, draft_size))
    # Hand the decoder all the bytes in one call instead of Pillow's 64 KB blocks: it drops the GIL
    # for each call, and taking it back ~50 times per phone photo is what made decode threads get in
    # the hub's way (docs/SCHEDULING.md#hub-turns).
    img.decodermaxblock = max(img.decodermaxblock, len(data))  # type: ignore[attr-defined]  # an ImageFile's
    try:
        img.load()
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        if "truncated" in str(exc).lower() or isinstance(exc, EOFError):
            raise NotAnImage(f"the {img.format} file is truncated ({exc}); send the complete file",
                             code="truncated_image") from exc
        raise NotAnImage(f"the {img.format} data is corrupt ({exc})", code="invalid_image") from exc
    img = _upright(img)
    return to_rgb(img)


def jpeg_for_device(img: Image.Image, data: bytes) -> EncodedJpeg | None:
    """For ``data`` that passed ``open_checked`` (``img``) and is a complete RGB or greyscale JPEG: its bytes
    and EXIF orientation for the device to decode; None for anything else (CMYK, another format, no end
    marker): Pillow decodes those (``decode_opened``)."""
    if img.format not in ("JPEG", "MPO") or img.mode not in ("RGB", "L"):
        return None
    # a cut-off file goes to Pillow, which names it truncated_image (a device decoder may fill it in grey)
    if not data.rstrip(b"\x00\r\n ").endswith(b"\xff\xd9"):
        return None
    return EncodedJpeg(np.frombuffer(data, np.uint8).copy(), _orientation(img))


def open_checked(data: bytes, max_pixels: int) -> Image.Image:
    """The checks made before any pixel is decoded: not empty, an allowed format (refused ones named), the
    pixel limit from the header."""
    if not data:
        raise NotAnImage("the image is empty (0 bytes)", code="empty_image")
    img = _open(data)
    width, height = img.size
    if width * height > max_pixels:
        raise ImageTooLarge(f"image is {width}x{height} = {width * height / 1e6:.1f} MP; the limit is "
                            f"{max_pixels / 1e6:.1f} MP. Send a smaller image or set "
                            "GREENSERVE_MAX_IMAGE_PIXELS to raise it")
    return img


def _orientation(img: Image.Image) -> int:
    try:
        value = img.getexif().get(ORIENTATION_TAG, 1)
    except (OSError, SyntaxError, ValueError, KeyError, TypeError) as exc:
        log.info("ignoring unreadable EXIF orientation: %s", exc)  # as ``_upright`` does
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _open(data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"{exc}. Send a smaller image or set GREENSERVE_MAX_IMAGE_PIXELS") from exc
    except UnidentifiedImageError as exc:
        refused = sniff_refused_format(data)
        if refused:
            raise UnsupportedImage(f"{refused} images are not accepted; send "
                                   f"{', '.join(ALLOWED_FORMATS)}") from exc
        raise NotAnImage("the data is not a recognised image (JPEG, PNG, WebP, GIF or BMP); check the URL "
                         "or file really points at an image", code="not_an_image") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise NotAnImage(f"the image header is corrupt ({exc})", code="invalid_image") from exc


def sniff_refused_format(data: bytes) -> str | None:
    """Name the image format of ``data`` when it is one we recognise but refuse."""
    head = data[:32]
    for magic, name in _REFUSED_MAGIC:
        if head.startswith(magic):
            return name
    if head[4:8] == b"ftyp":
        return _FTYP_BRANDS.get(head[8:12], "ISO media (HEIC/AVIF)")
    text = head.lstrip().lower()
    if text.startswith(b"<svg") or text.startswith(b"<?xml") and b"<svg" in data[:1024].lower():
        return "SVG"
    return None


def _upright(img: Image.Image) -> Image.Image:
    try:
        return ImageOps.exif_transpose(img) or img
    except (OSError, SyntaxError, ValueError, KeyError, TypeError) as exc:
        # A broken EXIF block is common in the wild; the pixels are still good.
        log.info("ignoring unreadable EXIF orientation: %s", exc)
        return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode → 8-bit RGB: 16-bit scaled (not clipped), alpha composited over white."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode == "I":
        arr = np.asarray(img, dtype=np.float32) if mode != "I" else np.asarray(img).astype(np.float32)
        top = 65535.0 if mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        gray = np.clip(arr * (255.0 / top) + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(gray, "L").convert("RGB")
    if mode == "F":
        gray = np.clip(np.asarray(img, dtype=np.float32), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, "L").convert("RGB")
    if mode == "P" and "transparency" in img.info or mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")
