from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from harness import images
from service.engine.types import Transform
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
