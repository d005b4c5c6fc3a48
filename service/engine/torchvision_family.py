"""torchvision classifiers: load by name and weights mode (meta device + mmap), split at the classifier head.

One forward gives both outputs: the backbone's pooled penultimate features (the embedding) and the
classifier head's logits.
"""

from __future__ import annotations

import logging
import os
import warnings
import zipfile
from typing import Any, cast

import torch
import torchvision
from torch import nn
from torchvision.models import get_model_builder, get_model_weights, list_models

from service.engine.model import LoadedModel
from service.engine.types import ModelInfo, ModelLoadError, Transform
from service.engine.weights import RANDOM_SEED, adopt, check_all_set, load_state_dict

log = logging.getLogger(__name__)



class EmbedClassify(nn.Module):
    """A torchvision classifier split at its last Linear: ``forward(x) -> (features, logits)``."""

    def __init__(self, backbone: nn.Module, head: nn.Linear, head_name: str) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.head_name = head_name  # where the head sat in ``backbone`` (for export)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self.backbone(x)
        return feats, self.head(feats)


def classification_models() -> list[str]:
    return cast(list[str], list_models(module=torchvision.models))


def _module_for(name: str, weights: str, device: torch.device) -> tuple[nn.Module, str, str]:
    """The module for a weights mode: (module, where its weights came from, torchvision | torchscript)."""
    if weights in ("auto", "imagenet"):
        cached = cached_weights_path(name)
        if cached is None and weights == "imagenet":
            raise ModelLoadError(f"no pretrained {name} file in the torch cache ({torch.hub.get_dir()}); run "
                                 f"`greenserve download-weights {name}` on a machine with internet")
        if cached is None:
            log.warning("NO PRETRAINED WEIGHTS for %s in %s: serving RANDOM weights (outputs are "
                        "meaningless). Run `greenserve download-weights %s` or set GREENSERVE_WEIGHTS.",
                        name, torch.hub.get_dir(), name)
            return _random_model(name), "random", "torchvision"
        return _from_state_dict(name, load_state_dict(cached)), "imagenet", "torchvision"
    if weights == "random":
        log.warning("GREENSERVE_WEIGHTS=random: %s serves random weights (outputs are meaningless)", name)
        return _random_model(name), weights, "torchvision"
    if is_torchscript(weights):
        return _load_torchscript(weights, device), weights, "torchscript"
    return _from_state_dict(name, load_state_dict(weights)), weights, "torchvision"


def load(name: str, weights: str, *, device: torch.device, channels_last: bool = True) -> LoadedModel:
    """Load ``name`` with ``weights`` = auto | imagenet | random | path (state dict or TorchScript)."""
    if name not in classification_models():
        raise ModelLoadError(f"GREENSERVE_MODEL={name!r} is not a torchvision classification model; try "
                             "resnet50, resnet18, efficientnet_b0, convnext_tiny, vit_b_16, or open_clip:ViT-B-32")
    enum = get_model_weights(name).DEFAULT
    transform = transform_of(enum)
    labels = tuple(enum.meta["categories"])
    module, source, fmt = _module_for(name, weights, device)
    if fmt == "torchvision":
        split = split_head(module)
        module, n_out = split, split.head.out_features
        if n_out != len(labels):
            labels = tuple(f"class_{i}" for i in range(n_out))
    module.eval()
    module = module.to(device)
    if channels_last and fmt == "torchvision":
        if not _is_channels_last(module):
            log.info("converting %s to channels_last: a private copy of the weights in each worker; "
                     "`greenserve export` writes a checkpoint that is shared instead", name)
        # a no-op (no private copy) when the checkpoint was exported in channels_last already
        module = module.to(memory_format=torch.channels_last)
    # a TorchScript file gives logits only: the loading tail drops "embeddings" then, and names the classes
    # class_i when its head's width is not the label list's
    info = ModelInfo(name, ("embeddings", "classify"), None, labels, str(device), "float32", source, transform,
                     format=fmt)
    return LoadedModel(info=info, module=module, device=device, channels_last=channels_last)


def export_checkpoint(name: str, weights: str, out: str, *, channels_last: bool = True) -> dict[str, Any]:
    """Write ``name``'s weights as a state dict already in the serving layout, so that workers map it
    from the page cache and share it (an in-place conversion after loading would copy it per worker).

    Conv+BN folding is not applied: it measured no faster on a CPU (docs/BENCHMARKS.md#precision) and
    would make the file unloadable as a plain torchvision state dict.
    """
    model = load(name, weights, device=torch.device("cpu"), channels_last=channels_last)
    if model.info.format != "torchvision":
        raise ModelLoadError("export takes torchvision weights (auto, imagenet, random or a state dict)")
    split = model.module
    assert isinstance(split, EmbedClassify)
    state = _rejoin_head(split).state_dict()
    torch.save(state, out)
    return {"model": name, "weights": model.info.weights, "out": out, "channels_last": channels_last,
            "tensors": len(state), "bytes": os.path.getsize(out)}


def _rejoin_head(split: EmbedClassify) -> nn.Module:
    """Put the classifier head back where ``split_head`` took it, for a torchvision-shaped state dict."""
    _swap(split.backbone, split.head_name, split.head)
    return split.backbone


def _is_channels_last(module: nn.Module) -> bool:
    return all(p.dim() != 4 or p.is_contiguous(memory_format=torch.channels_last) for p in module.parameters())


def transform_of(enum: Any) -> Transform:
    t = enum.transforms()
    return Transform(resize_size=int(t.resize_size[0]), crop_size=int(t.crop_size[0]),
                     mean=tuple(t.mean), std=tuple(t.std), interpolation=t.interpolation.value)


def cached_weights_path(name: str) -> str | None:
    """Where torchvision's pretrained file for ``name`` lives in the local torch cache, if it is there."""
    url = get_model_weights(name).DEFAULT.url
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url))
    return path if os.path.isfile(path) else None


def is_torchscript(path: str) -> bool:
    try:
        with zipfile.ZipFile(path) as zf:
            return any(n.endswith("constants.pkl") or "/code/" in n for n in zf.namelist())
    except zipfile.BadZipFile:
        return False


def split_head(model: nn.Module) -> EmbedClassify:
    """Cut ``model`` at its last ``nn.Linear``: what feeds it is the embedding."""
    last = _last_linear_name(model)
    if last is None:
        raise ModelLoadError(f"{type(model).__name__} has no Linear classifier head; embeddings need one")
    head = _swap(model, last, nn.Identity())
    assert isinstance(head, nn.Linear)  # what _last_linear_name found
    return EmbedClassify(model, head, last)


def _last_linear_name(model: nn.Module) -> str | None:
    last = None
    for qualname, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            last = qualname
    return last


def _swap(model: nn.Module, qualname: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``qualname`` inside ``model``; return what was there."""
    parent_name, _, attr = qualname.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old: nn.Module = getattr(parent, attr)
    setattr(parent, attr, new)
    return old


def _load_torchscript(path: str, device: torch.device) -> nn.Module:
    # torch deprecates TorchScript in favour of torch.export, but users still ship .ts/.pt archives;
    # say it once in our log instead of a FutureWarning per worker.
    log.info("loading TorchScript archive %s (deprecated upstream; a state dict loads faster and shares memory)",
             path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.load` is deprecated", category=FutureWarning)
        try:
            return cast(nn.Module, torch.jit.load(path, map_location=device))  # type: ignore[no-untyped-call]
        except RuntimeError as exc:
            raise ModelLoadError(f"cannot load TorchScript file {path!r}: {str(exc)[:300]}") from exc


def _random_model(name: str) -> nn.Module:
    torch.manual_seed(RANDOM_SEED)
    return cast(nn.Module, get_model_builder(name)(weights=None))


def _from_state_dict(name: str, state: dict[str, torch.Tensor]) -> nn.Module:
    """Build on the meta device and adopt the (mmapped) tensors: no second copy of the weights."""
    builder = get_model_builder(name)
    kwargs: dict[str, Any] = {}
    with torch.device("meta"):
        model: nn.Module = builder(weights=None)
    head_key = f"{_last_linear_name(model)}.weight"
    if head_key in state and state[head_key].shape[0] != model.get_submodule(head_key[:-7]).out_features:
        kwargs["num_classes"] = state[head_key].shape[0]
        with torch.device("meta"):
            model = builder(weights=None, **kwargs)
    if name.startswith(("inception", "googlenet")) and not any(k.startswith("aux") or "Aux" in k for k in state):
        with torch.device("meta"):
            model = builder(weights=None, aux_logits=False, init_weights=False, **kwargs)
    adopt(model, state, name, "; check GREENSERVE_MODEL matches the architecture the file was saved from")
    check_all_set(model, name)
    return model

