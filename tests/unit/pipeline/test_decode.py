from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from harness import images
from service.errors import ImageTooLarge, NotAnImage, UnsupportedImage
from service.pipeline.decode import configure_pillow, decode_image, to_rgb

MAX_PIXELS = 30_000_000


@pytest.fixture(autouse=True)
def _pillow() -> None:
    configure_pillow(MAX_PIXELS)


def decode(data: bytes, **kw: object) -> Image.Image:
    return decode_image(data, max_pixels=MAX_PIXELS, **kw)


def test_jpeg_decodes_to_rgb() -> None:
    img = decode(images.jpeg(320, 240))
    assert img.mode == "RGB" and img.size == (320, 240)


def test_the_decoder_gets_the_whole_file_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decoder call drops and retakes the GIL: one per photo, not one per 64 KB (the hub waits)."""
    calls: list[int] = []
    real = Image._getdecoder

    class Counting:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def decode(self, buffer: bytes) -> tuple[int, int]:
            calls.append(len(buffer))
            return self.inner.decode(buffer)  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    data = images.jpeg(1200, 900, seed=3)
    assert len(data) > 4 * 65536
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    monkeypatch.setattr(Image, "_getdecoder", lambda *a, **kw: Counting(real(*a, **kw)))
    assert np.array_equal(np.asarray(decode(data)), expected)
    assert len(calls) == 1, f"{len(calls)} decoder calls"


def test_draft_mode_decodes_big_jpeg_at_reduced_scale_but_covers_target() -> None:
    big = images.encode(Image.new("RGB", (4000, 3000), (90, 120, 150)), "JPEG")  # plain: a photo takes seconds to make
    img = decode(big, draft_size=256)
    assert img.size == (500, 375)  # libjpeg 1/8 scale: still >= 256 on the short side
    assert min(img.size) >= 256


@pytest.mark.parametrize("orientation, size", [(1, (64, 32)), (3, (64, 32)), (6, (32, 64)), (8, (32, 64))])
def test_exif_orientation_is_applied(orientation: int, size: tuple[int, int]) -> None:
    assert decode(images.jpeg_with_orientation(orientation)).size == size


def test_empty_file_is_empty_image() -> None:
    with pytest.raises(NotAnImage) as exc:
        decode(b"")
    assert exc.value.code == "empty_image"


def test_truncated_jpeg_is_refused() -> None:
    with pytest.raises(NotAnImage) as exc:
        decode(images.truncated_jpeg())
    assert exc.value.code == "truncated_image"


def test_html_is_not_an_image() -> None:
    with pytest.raises(NotAnImage) as exc:
        decode(images.HTML)
    assert exc.value.code == "not_an_image"


def test_tiff_is_unsupported_format() -> None:
    with pytest.raises(UnsupportedImage) as exc:
        decode(images.tiff())
    assert exc.value.code == "unsupported_image_format" and exc.value.status_code == 415


def test_pixel_bomb_is_refused_before_decoding() -> None:
    with pytest.raises(ImageTooLarge) as exc:
        decode(images.pixel_bomb())
    assert "GREENSERVE_MAX_IMAGE_PIXELS" in exc.value.message


def test_image_just_over_limit_is_refused_not_warned() -> None:
    # between 1x and 2x the limit Pillow only warns; that must be an error too
    with pytest.raises(ImageTooLarge):
        decode_image(images.encode(Image.new("L", (200, 200)), "PNG"), max_pixels=30_000)


def test_grayscale_becomes_rgb() -> None:
    img = decode(images.encode(Image.new("L", (8, 8), 77), "PNG"))
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (77, 77, 77)


def test_16bit_grayscale_is_scaled_not_clipped() -> None:
    arr = np.full((8, 8), 32768, dtype=np.uint16)
    data = images.encode(Image.fromarray(arr), "PNG")
    px = decode(data).getpixel((0, 0))
    assert px[0] == pytest.approx(128, abs=1)


def test_palette_with_transparency_composites_over_white() -> None:
    img = Image.new("P", (4, 4), 0)
    img.putpalette([0, 0, 0] * 256)
    img.info["transparency"] = 0
    out = decode(images.encode(img, "PNG", transparency=0))
    assert out.getpixel((0, 0)) == (255, 255, 255)


def test_rgba_half_transparent_blends_with_white() -> None:
    out = to_rgb(Image.new("RGBA", (2, 2), (0, 0, 0, 128)))
    assert out.getpixel((0, 0))[0] == pytest.approx(127, abs=1)


def test_cmyk_jpeg_becomes_rgb() -> None:
    data = images.encode(images.photo(16, 16).convert("CMYK"), "JPEG")
    assert decode(data).mode == "RGB"


def test_animated_gif_gives_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    r, g, b = decode(buf.getvalue()).getpixel((0, 0))
    assert r > 200 and b < 50


def test_webp_and_bmp_are_accepted() -> None:
    for fmt in ("WEBP", "BMP"):
        assert decode(images.encode(images.photo(16, 16), fmt)).size == (16, 16)
