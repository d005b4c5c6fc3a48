from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from harness import images
from service.engine.types import Transform
from service.pipeline.decode import decode_image
from service.pipeline.prepare import draft_size
from service.pipeline.preprocess import preprocess


def test_output_is_uint8_crop_hwc() -> None:
    out = preprocess(images.photo(640, 480), Transform(resize_size=232, crop_size=224))
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8


def test_matches_resize_then_center_crop() -> None:
    img = images.photo(400, 300, seed=3).resize((100, 75)).resize((400, 300))  # smooth: no sub-pixel noise
    t = Transform(resize_size=256, crop_size=224)
    resized = img.resize((341, 256), Image.Resampling.BILINEAR)
    left, top = (341 - 224) // 2, (256 - 224) // 2
    reference = np.asarray(resized.crop((left, top, left + 224, top + 224)), dtype=np.float32)
    ours = preprocess(img, t).astype(np.float32)
    assert np.abs(ours - reference).mean() < 2.0  # same picture within a couple of grey levels


@pytest.mark.slow  # many full-size photos
def test_portrait_and_landscape_both_fill_the_crop() -> None:
    t = Transform(resize_size=256, crop_size=224)
    for size in ((3024, 4032), (4032, 3024), (50, 40)):
        assert preprocess(images.photo(*size), t).shape == (224, 224, 3)


@pytest.mark.parametrize("size", [(1920, 1440), (1440, 1920), (2560, 1440), (1440, 1440), (301, 200)])
def test_an_exact_transform_resizes_the_whole_image_then_crops_at_the_truncated_centre(size: tuple[int, int]) -> None:
    img = images.scene(*size, seed=1)
    w, h = size
    resized = (224, int(h / w * 224)) if w < h else (int(w / h * 224), 224)  # immich's resize_pil, then crop_pil
    left, top = int(resized[0] / 2 - 112), int(resized[1] / 2 - 112)
    reference = img.resize(resized, Image.Resampling.BICUBIC).crop((left, top, left + 224, top + 224))
    t = Transform(224, 224, interpolation="bicubic", exact=True)
    assert np.array_equal(preprocess(img, t), np.asarray(reference))
    assert not np.array_equal(preprocess(img, replace(t, exact=False)), np.asarray(reference))


def test_an_exact_transform_decodes_a_jpeg_at_no_less_than_twice_its_size() -> None:
    t = Transform(224, 224, interpolation="bicubic")
    assert draft_size(t) == 224 and draft_size(replace(t, exact=True)) == 448
    preview = images.preview(1920, 1440)
    assert decode_image(preview, max_pixels=10**8, draft_size=draft_size(replace(t, exact=True))).size == (960, 720)
