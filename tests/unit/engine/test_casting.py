"""Weights cast once, per family: the answers stay within the dtype choice's tolerance of float32's, what is kept
in float32 stays there during the forward, and float32 comes back as the very originals."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from service.engine import probes
from service.engine.casting import FLOAT32, KEPT_FLOAT32, Numerics, TowerCast
from service.engine.loading import load_model
from service.engine.model import LoadedModel
from service.engine.types import MIN_COSINE
from service.pipeline import postprocess

pytestmark = pytest.mark.slow  # real models: not in make test-fast

BF16_CAST = Numerics(torch.bfloat16, cast=True)
FAMILIES = ["resnet18", "timm:vit_tiny_patch16_224", "open_clip:ViT-B-32"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> Iterator[LoadedModel]:
    torch.manual_seed(0)
    yield load_model(request.param, "random")


def cosine(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    assert a is not None and b is not None
    return float(nn.functional.cosine_similarity(a.double(), b.double(), dim=1).min())


def norm_dtypes_during(model: LoadedModel, run: Callable[[], object]) -> set[torch.dtype]:
    """The dtypes of every normalisation layer's parameters and buffers while ``run()`` runs the forward."""
    seen: set[torch.dtype] = set()
    hooks = [m.register_forward_pre_hook(lambda mod, _: seen.update(
        t.dtype for t in (*mod.parameters(recurse=False), *mod.buffers(recurse=False)) if t.is_floating_point()))
        for m in model.module.modules() if isinstance(m, KEPT_FLOAT32)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_cast_once_images_agree_with_float32(model: LoadedModel) -> None:
    pixels = probes.probe_pixels(model.info.transform.crop_size)
    f32, logits32 = model.forward(pixels)
    model.set_numerics("image", BF16_CAST)
    try:
        low, logits_low = model.forward(pixels)
        assert low is not None and low.dtype == torch.float32  # rows leave the tower as float32
        assert cosine(f32, low) >= MIN_COSINE
        if logits32 is not None:
            assert logits_low is not None and torch.equal(logits32.argmax(1), logits_low.argmax(1))
    finally:
        model.set_numerics("image", FLOAT32)
    assert torch.equal(model.forward(pixels)[0], f32)  # float32 again is the originals, not a round trip


def test_cast_once_keeps_the_normalisation_layers_in_float32_during_the_forward(model: LoadedModel) -> None:
    pixels = probes.probe_pixels(model.info.transform.crop_size, 2)
    model.set_numerics("image", BF16_CAST)
    try:
        seen = norm_dtypes_during(model, lambda: model.forward(pixels))
        weights = {p.dtype for m in model.module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))
                   for p in m.parameters(recurse=False)}
    finally:
        model.set_numerics("image", FLOAT32)
    assert seen == {torch.float32}, seen  # BatchNorm statistics, LayerNorm weights
    assert torch.bfloat16 in weights  # and the rest really is cast


def test_the_text_tower_casts_alone_and_its_norms_and_logit_scale_stay_float32() -> None:
    torch.manual_seed(0)
    clip_model = load_model("open_clip:ViT-B-32", "random")
    clip = clip_model.module.clip
    ids = clip_model.tokenize(probes.PROBE_TEXTS).ids
    f32 = clip_model.encode_text(ids)
    clip_model.set_numerics("text", BF16_CAST)
    low = clip_model.encode_text(ids)
    assert low.dtype == torch.float32 and cosine(f32, low) >= MIN_COSINE
    assert clip.token_embedding.weight.dtype == torch.bfloat16
    assert clip.transformer.resblocks[0].mlp.c_fc.weight.dtype == torch.bfloat16
    assert clip.ln_final.weight.dtype == torch.float32 and clip.logit_scale.dtype == torch.float32
    assert clip.visual.conv1.weight.dtype == torch.float32  # the image tower is not the text tower's


def test_scores_and_normalisation_run_in_float32_even_on_low_precision_rows() -> None:
    """What comes after the forward: the L2 normalisation and softmax widen what they get (numpy has no
    bf16; float16 stands in for a row that left a tower in low precision)."""
    row = np.random.default_rng(0).standard_normal(512).astype(np.float16)
    vec = postprocess.embedding(row, normalize=True)
    assert vec.dtype == np.float32 and abs(float(np.linalg.norm(vec)) - 1) < 1e-6
    assert postprocess.probabilities(np.array([1.0, 2.0], np.float16)).dtype == np.float64


def test_a_released_tower_cannot_go_back_and_a_float32_one_keeps_its_originals() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    cast = TowerCast(net)
    assert cast.kept == 2 and len(cast.tensors) == 2  # the Linear's weight and bias; the norm's are kept
    original = net[0].weight.data_ptr()
    cast.to(torch.bfloat16)
    assert net[0].weight.dtype == torch.bfloat16 and net[1].weight.dtype == torch.float32
    cast.to(torch.float32)
    assert net[0].weight.data_ptr() == original  # the same memory, not a copy
    cast.to(torch.bfloat16)
    cast.release()
    with pytest.raises(RuntimeError, match="released"):
        cast.to(torch.float32)


def test_a_saved_state_dict_is_cast_from_its_mapped_tensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = tmp_path / "r18.pt"
    torch.save(torchvision.models.resnet18().state_dict(), path)
    model = load_model("resnet18", str(path), numerics=BF16_CAST)
    assert model.info.dtype == "bfloat16" and model.module.backbone.conv1.weight.dtype == torch.bfloat16
    assert model.module.backbone.bn1.running_var.dtype == torch.float32
