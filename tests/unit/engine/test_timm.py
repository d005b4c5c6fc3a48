"""The timm family without a server: a saved state dict loads mapped, embeds its pre-logits features and
classifies with its own head, as timm itself does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from service.engine.loading import load_model

pytestmark = pytest.mark.slow  # real models: not in make test-fast


def test_a_timm_backbone_embeds_its_pre_logits_and_classifies_with_its_head(tmp_path: Path) -> None:
    import timm  # imported here: slow to import, like the family itself

    torch.manual_seed(5)
    net = timm.create_model("resnet18", pretrained=False, num_classes=7).eval()
    path = tmp_path / "timm-r18.pt"
    torch.save(net.state_dict(), path)
    model = load_model("timm:resnet18", str(path))
    info = model.info
    assert (info.family, info.embedding_dim, len(info.labels)) == ("timm", 512, 7)
    assert (info.transform.crop_size, info.transform.resize_size, info.transform.interpolation) == (224, 235, "bicubic")
    pixels = np.random.default_rng(1).integers(0, 255, (2, 224, 224, 3), dtype=np.uint8)
    feats, logits = model.forward(pixels)
    mean = torch.tensor(info.transform.mean).view(1, 3, 1, 1)
    std = torch.tensor(info.transform.std).view(1, 3, 1, 1)
    with torch.inference_mode():
        x = (torch.from_numpy(pixels).permute(0, 3, 1, 2) / 255 - mean) / std
        expected = net.forward_head(net.forward_features(x), pre_logits=True)
        expected_logits = net(x)
    assert feats is not None and logits is not None
    assert torch.allclose(feats, expected, atol=1e-4) and torch.allclose(logits, expected_logits, atol=1e-4)
