"""timm image backbones: the pooled pre-logits features as the embedding, the head's logits as classes.

Weights are never downloaded here: ``random`` (seeded), a state dict file (mapped onto a model built on
the meta device, shared by the workers), or timm's pretrained file found in the local Hugging Face cache
(``auto``/``imagenet``; ``greenserve download-weights timm:NAME`` fills it on a machine with internet).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import timm
import torch
from torch import nn

from service.engine.model import LoadedModel
from service.engine.types import ModelInfo, ModelLoadError, Transform
from service.engine.weights import RANDOM_SEED, adopt, load_state_dict, unset_tensors

log = logging.getLogger(__name__)

HF_FILE = "model.safetensors"


class Backbone(nn.Module):
    """``forward(x) -> (pooled pre-logits, logits)`` from one pass through the features."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        net: Any = self.net
        feats = net.forward_features(x)
        return net.forward_head(feats, pre_logits=True), net.forward_head(feats)


def load(name: str, weights: str, *, device: torch.device, channels_last: bool = True) -> LoadedModel:
    if name not in timm.list_models():
        raise ModelLoadError(f"GREENSERVE_MODEL=timm:{name} is not a timm model; try timm:resnet50, "
                             "timm:convnext_tiny, timm:vit_base_patch16_224")
    net, source = _build(name, weights)
    net = net.eval().to(device)
    if channels_last:  # a no-op (shared) when the file was saved in channels_last; else a private copy
        net = net.to(memory_format=torch.channels_last)
    transform = _transform(timm.data.resolve_data_config({}, model=net))  # type: ignore[attr-defined,no-untyped-call]
    n_classes = int(getattr(net, "num_classes", 0))
    labels = _labels(n_classes)
    info = ModelInfo(f"timm:{name}", ("embeddings", "classify"), None, labels, str(device), "float32", source,
                     transform, format="timm", family="timm")
    return LoadedModel(info=info, module=Backbone(net), device=device, channels_last=channels_last)


def _build(name: str, weights: str) -> tuple[nn.Module, str]:
    if weights in ("auto", "imagenet"):
        cached = cached_pretrained(name)
        if cached is None and weights != "auto":
            raise ModelLoadError(f"timm:{name}'s pretrained file is not in the local Hugging Face cache; run "
                                 f"`greenserve download-weights timm:{name}` on a machine with internet")
        if cached is None:
            log.warning("NO PRETRAINED WEIGHTS for timm:%s in the local cache: serving RANDOM weights (outputs "
                        "are meaningless). Run `greenserve download-weights timm:%s` or set GREENSERVE_WEIGHTS.",
                        name, name)
            return _random(name), "random"
        return _from_file(name, cached), "pretrained"
    if weights == "random":
        log.warning("GREENSERVE_WEIGHTS=random: timm:%s serves random weights (outputs are meaningless)", name)
        return _random(name), "random"
    return _from_file(name, weights), weights


def _random(name: str) -> nn.Module:
    torch.manual_seed(RANDOM_SEED)
    return timm.create_model(name, pretrained=False)


def _from_file(name: str, path: str) -> nn.Module:
    state = load_state_dict(path)
    cfg = timm.models.get_pretrained_cfg(name)
    head = f"{cfg.classifier}.weight" if cfg is not None and isinstance(cfg.classifier, str) else ""
    kwargs: dict[str, Any] = {"num_classes": int(state[head].shape[0])} if head in state else {}
    with torch.device("meta"):
        net = timm.create_model(name, pretrained=False, **kwargs)
    adopt(net, state, f"timm:{name}")
    if unset_tensors(net):  # buffers the file does not hold (persistent=False): build them for real
        log.info("timm:%s has buffers outside its state dict: built on the CPU, weights copied", name)
        torch.manual_seed(RANDOM_SEED)
        net = timm.create_model(name, pretrained=False, **kwargs)
        net.load_state_dict(state, strict=True)
    return net


def cached_pretrained(name: str, cache_dir: str | None = None) -> str | None:
    """timm's default pretrained file for ``name`` in the local Hugging Face cache, if it is there."""
    from huggingface_hub import try_to_load_from_cache

    hub = timm.models.get_pretrained_cfg(name)
    repo = getattr(hub, "hf_hub_id", None) if hub is not None else None
    if not repo:
        return None
    found = try_to_load_from_cache(repo, HF_FILE, cache_dir=cache_dir)
    return found if isinstance(found, str) and os.path.isfile(found) else None


def download(name: str) -> str:
    from huggingface_hub import hf_hub_download

    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not cfg.hf_hub_id:
        raise ModelLoadError(f"timm has no pretrained file on the Hugging Face hub for {name}")
    return str(hf_hub_download(cfg.hf_hub_id, HF_FILE))


def _transform(cfg: dict[str, Any]) -> Transform:
    size = int(cfg["input_size"][-1])
    mode = "squash" if cfg.get("crop_mode") == "squash" else "shortest"
    interpolation = cfg.get("interpolation", "bilinear")
    return Transform(resize_size=int(math.floor(size / cfg.get("crop_pct", 0.875))), crop_size=size,
                     mean=tuple(cfg["mean"]), std=tuple(cfg["std"]),
                     interpolation=interpolation if interpolation in ("bilinear", "bicubic", "nearest") else "bicubic",
                     resize_mode=mode)


def _labels(n: int) -> tuple[str, ...]:
    if n == 1000:
        from timm.data import ImageNetInfo  # type: ignore[attr-defined]

        names = ImageNetInfo()
        return tuple(names.index_to_description(i).split(",")[0] for i in range(n))
    return tuple(f"class_{i}" for i in range(n))
