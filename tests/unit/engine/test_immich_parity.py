"""greenserve against immich for the same weights and the same preview JPEG (issue 42): a seeded random CLIP exported
the way immich's model exporter does and run the way immich's machine learning runs it (``harness.immich``), and the
same weights served under immich's name (``open_clip:ARCH__TAG``) through greenserve's own decode, preprocess and
forward. ``pytest -s`` prints the figures docs/MODELS.md (immich) quotes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from harness import images
from harness.servers import CLIP_ARCH
from service.engine.loading import load_model
from service.engine.model import LoadedModel
from service.engine.types import Transform
from service.pipeline.decode import decode_image
from service.pipeline.prepare import decode_and_crop
from service.pipeline.preprocess import preprocess

pytestmark = pytest.mark.slow  # a real model exported to ONNX: not in make test-fast

NAME = f"open_clip:{CLIP_ARCH}__parity"  # immich's form of a name: served the immich way
IMAGE_COSINE, TEXT_COSINE = 0.999, 0.9999  # issue 42's bar
SERVED_IMAGE_COSINE = 0.9999  # the bar for a cheaper way from JPEG to tensor (issue 44)
MAX_MEAN_GREY_DELTA = 0.3  # the served crop against immich's: 0.18 measured (the draft decode at twice the size)
MAX_PIXELS = 40_000_000
# immich's previews: the shorter side 1440 (sharp's fit "outside"), at phones' and cameras' aspect ratios
PREVIEWS = ((1920, 1440), (1440, 1920), (2560, 1440), (2160, 1440), (1440, 1440), (1440, 3120))
# searches as people type them: curly quotes (phones' keyboards), HTML entities, ligatures, full-width letters,
# decomposed accents, other scripts, emoji, whitespace, and texts past the context length
TEXTS = ("a photo of a dog on the beach", "Sunset over the MOUNTAINS", "  two\tspaces\n\nand  lines  ",
         "my dog’s “favourite” toy", "Tom &amp; Jerry", "ﬁreworks over the ﬁeld", "ＣＡＴ　ｐｈｏｔｏ",
         "cafe\u0301 in Paris", "東京の夜景", "🐶 at the park 🌳", "İstanbul ΟΔΟΣ straße", "2019 birthday party",
         "can't won't it's", "word " * 100, "a very long caption about a family picnic " * 9)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    import open_clip

    torch.manual_seed(42)
    clip = open_clip.create_model(CLIP_ARCH, pretrained=None).eval()
    path = tmp_path_factory.mktemp("parity") / "clip.pt"
    torch.save(clip.state_dict(), path)
    return path, clip


@pytest.fixture(scope="module")
def immich(weights: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    from harness.immich import ImmichClip, export

    return ImmichClip(export(weights[1], tmp_path_factory.mktemp("immich-model")))


@pytest.fixture(scope="module")
def served(weights: tuple[Path, Any]) -> LoadedModel:
    return load_model(NAME, str(weights[0]))


@pytest.fixture(scope="module")
def previews() -> dict[str, bytes]:
    return {f"{w}x{h}": images.preview(w, h, seed=i) for i, (w, h) in enumerate(PREVIEWS)}


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def vector(model: LoadedModel, crop: np.ndarray) -> np.ndarray:
    features, _ = model.forward(np.stack([crop]))  # a batch, as the pipeline stacks it (writable)
    assert features is not None
    return unit(features[0].numpy())


def test_an_immich_name_is_served_with_the_references_preprocessing(served: LoadedModel) -> None:
    t = served.info.transform
    assert t.exact and (t.resize_mode, t.interpolation, t.crop_size) == ("shortest", "bicubic", 224)
    assert served.info.name == NAME and served.info.public()["preprocessing"]["exact"] is True


def test_the_resize_and_crop_are_immichs_pixel_for_pixel(served: LoadedModel, immich: Any,
                                                         previews: dict[str, bytes]) -> None:
    for name, data in previews.items():
        ours = preprocess(decode_image(data, max_pixels=MAX_PIXELS), served.info.transform)  # every pixel decoded
        assert np.array_equal(ours, immich.crop(data)), name


def test_the_served_crops_are_within_a_fraction_of_a_grey_level(served: LoadedModel, immich: Any,
                                                                 previews: dict[str, bytes]) -> None:
    """Decoded at libjpeg's draft scale (no less than twice the resize size), then immich's resize and crop."""
    for name, data in previews.items():
        delta = np.abs(decode_and_crop(data, served.info.transform, MAX_PIXELS).astype(np.int16)
                       - immich.crop(data).astype(np.int16))
        assert delta.mean() <= MAX_MEAN_GREY_DELTA, (name, delta.mean())


def test_image_vectors_agree_with_immichs_onnx_model(served: LoadedModel, immich: Any,
                                                     previews: dict[str, bytes]) -> None:
    t = served.info.transform
    cosines = {name: float(vector(served, decode_and_crop(data, t, MAX_PIXELS)) @ unit(immich.image(data)))
               for name, data in previews.items()}
    print("\nimage cosines, greenserve vs immich:", {k: round(v, 7) for k, v in cosines.items()})
    assert min(cosines.values()) >= max(IMAGE_COSINE, SERVED_IMAGE_COSINE), cosines


def test_text_tokens_and_vectors_agree_with_immichs(served: LoadedModel, immich: Any) -> None:
    tokens = served.tokenize(list(TEXTS))
    for i, text in enumerate(TEXTS):
        theirs, n = immich.tokens(text), tokens.lengths[i]
        assert tokens.ids[i, :n].tolist() == theirs[:n].tolist(), text
        assert set(theirs[n:].tolist()) <= {theirs[n - 1]}, text  # immich pads with the end token, greenserve with 0
    ours = served.encode_text(tokens.ids).numpy()
    cosines = {text[:24]: float(unit(ours[i]) @ unit(immich.text(text))) for i, text in enumerate(TEXTS)}
    print("\ntext cosines, greenserve vs immich:", {k: round(v, 7) for k, v in cosines.items()})
    assert min(cosines.values()) >= TEXT_COSINE, cosines


def _fast(data: bytes, t: Transform) -> np.ndarray:
    return decode_and_crop(data, replace(t, exact=False), MAX_PIXELS)


def _draft_only(data: bytes, t: Transform) -> np.ndarray:
    return preprocess(decode_image(data, max_pixels=MAX_PIXELS, draft_size=t.resize_size), t)


def _draft_twice(data: bytes, t: Transform) -> np.ndarray:
    return preprocess(decode_image(data, max_pixels=MAX_PIXELS, draft_size=2 * t.resize_size), t)


def _gap_only(data: bytes, t: Transform) -> np.ndarray:
    return preprocess(decode_image(data, max_pixels=MAX_PIXELS), replace(t, exact=False))


def _box_only(data: bytes, t: Transform) -> np.ndarray:
    img = decode_image(data, max_pixels=MAX_PIXELS)
    size = (t.crop_size, t.crop_size)
    return np.asarray(img.resize(size, Image.Resampling.BICUBIC, box=t.crop_box(*img.size)), np.uint8)


def _bilinear(data: bytes, t: Transform) -> np.ndarray:
    return preprocess(decode_image(data, max_pixels=MAX_PIXELS), replace(t, interpolation="bilinear"))


def _squash(data: bytes, t: Transform) -> np.ndarray:
    return preprocess(decode_image(data, max_pixels=MAX_PIXELS), replace(t, resize_mode="squash"))


# each way greenserve (or a configuration) can differ from immich's pixels, alone
VARIANTS: dict[str, Callable[[bytes, Transform], np.ndarray]] = {
    "other models' fast path (the next three)": _fast,
    "JPEG draft decode at the resize size": _draft_only,
    "JPEG draft decode at twice it (served)": _draft_twice,
    "crop-box resample, reducing gap 3": _gap_only,
    "crop-box resample, no reducing gap": _box_only,
    "bilinear for bicubic": _bilinear,
    "squash for shortest+crop": _squash,
}


def test_what_each_difference_from_immich_costs(served: LoadedModel, immich: Any, previews: dict[str, bytes]) -> None:
    t = served.info.transform
    theirs = {name: unit(immich.image(data)) for name, data in previews.items()}
    ref = {name: immich.crop(data).astype(np.int16) for name, data in previews.items()}
    vectors = list(theirs.values())
    apart = min(float(a @ b) for i, a in enumerate(vectors) for b in vectors[i + 1:])
    print(f"\n{'difference':45} min cosine  mean |Δ| grey levels   (two different previews: {apart:.5f})")
    for label, crop in VARIANTS.items():
        crops = {name: crop(data, t) for name, data in previews.items()}
        cosine = min(float(vector(served, c) @ theirs[name]) for name, c in crops.items())
        delta = np.mean([np.abs(c.astype(np.int16) - ref[name]).mean() for name, c in crops.items()])
        print(f"{label:45} {cosine:.6f}   {delta:.2f}")
        assert delta > 0, label  # the crops tell each of them from immich's
    ours = vector(served, decode_and_crop(previews["1920x1440"], t, MAX_PIXELS))
    assert float(ours @ theirs["1920x1440"]) > apart  # a preview is nearer its own vector than another's


def test_open_clips_text_cleaning_would_give_other_tokens(served: LoadedModel, immich: Any) -> None:
    import open_clip

    from service.engine.open_clip_family import ClipText

    plain = ClipText(torch.nn.Identity(), open_clip.get_tokenizer(CLIP_ARCH)).tokenize(list(TEXTS))
    ours = served.encode_text(plain.ids).numpy()
    differ = {text: float(unit(ours[i]) @ unit(immich.text(text))) for i, text in enumerate(TEXTS)
              if plain.ids[i, :plain.lengths[i]].tolist() != immich.tokens(text)[:plain.lengths[i]].tolist()}
    print("\nopen_clip's cleaning (ftfy, HTML) vs immich's, the texts whose tokens differ:",
          {k[:24]: round(v, 5) for k, v in differ.items()})
    assert {"my dog’s “favourite” toy", "Tom &amp; Jerry", "ﬁreworks over the ﬁeld"} <= set(differ)
