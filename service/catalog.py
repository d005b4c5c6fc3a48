"""Which models can be served, by name: each family's own list, as its library gives it.

    torchvision   torchvision.models.list_models(): its classifiers (resnet50; a bare name is torchvision's)
    open_clip     open_clip.list_models(): its architectures (open_clip:ViT-B-32), and immich's names of them with
                  their weights (open_clip:ViT-B-32__openai: ARCH__TAG, served the immich way)
    timm          timm.list_models() (timm:convnext_tiny)

Looking a name up imports that family's library (seconds) and builds no model, so the gunicorn master checks
``GREENSERVE_MODEL`` here before it forks (a typo stops the start in one line, not after every worker's load),
as ``greenserve settings`` does; ``greenserve models`` lists and searches these names. The family modules
(``service.engine``) check the same lists again when a worker loads.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
from typing import Any

from service.settings_parse import SettingsError

FAMILIES = ("torchvision", "open_clip", "timm")
# what each family's list holds, and a few of its names people serve (the overview and the error messages)
KINDS = {"torchvision": "classifiers", "open_clip": "CLIP and SigLIP architectures", "timm": "backbones"}
EXAMPLES = {"torchvision": ("resnet50", "resnet18", "efficientnet_b0", "convnext_tiny", "vit_b_16"),
            "open_clip": ("open_clip:ViT-B-32", "open_clip:ViT-B-16", "open_clip:ViT-L-14", "open_clip:ViT-B-16-SigLIP"),
            "timm": ("timm:resnet50", "timm:convnext_tiny", "timm:vit_base_patch16_224")}


def split(spec: str) -> tuple[str, str]:
    """``open_clip:ViT-B-32`` → (open_clip, ViT-B-32); a bare name is torchvision's."""
    family, sep, name = spec.partition(":")
    if not sep:
        return "torchvision", spec
    if family not in FAMILIES or not name:
        raise SettingsError(f"GREENSERVE_MODEL={spec!r}: the family must be one of {', '.join(FAMILIES)} "
                            "(torchvision:resnet50, open_clip:ViT-B-32, timm:convnext_tiny; a bare name is torchvision's)")
    return family, name


def names(family: str) -> list[str]:
    """Every name ``family`` can serve, without its family prefix (imports the family's library)."""
    library: Any = importlib.import_module(family)
    if family == "torchvision":
        return list(library.models.list_models(module=library.models))
    return list(library.list_models())


def full_name(family: str, name: str) -> str:
    return name if family == "torchvision" else f"{family}:{name}"


def check(spec: str) -> None:
    """SettingsError unless ``spec`` (``GREENSERVE_MODEL``) names a model its family lists; the message offers
    the closest names."""
    family, name = split(spec)
    known = names(family)
    if name in known or family == "open_clip" and _immich_name(name, known):
        return
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(full_name(family, c) for c in close)}?" if close
            else f"try {', '.join(EXAMPLES[family])}")
    raise SettingsError(f"GREENSERVE_MODEL={spec!r} is not one of the {len(known)} {KINDS[family]} {family} lists; "
                        f"{hint} (`greenserve models` lists and searches them)")


def _immich_name(name: str, architectures: list[str]) -> bool:
    """immich's name of an open_clip model: an architecture (any case) and one of its pretrained tags,
    ``ARCH__TAG`` (ViT-B-32__openai, ViT-B-32__laion2b-s34b-b79k; ``open_clip_family.IMMICH_SEPARATOR``)."""
    arch, sep, tag = name.partition("__")
    arch = next((a for a in architectures if a.lower() == arch.lower()), "")
    return bool(sep and arch and importlib.import_module("open_clip").get_pretrained_cfg(arch, tag))


def matching(pattern: str, families: tuple[str, ...] = FAMILIES) -> list[str]:
    """The full names in ``families`` that the shell-style ``pattern`` matches, ignoring case, with or without
    the family prefix (``vit*``, ``open_clip:*L-14*``). Only the families the pattern can match are imported."""
    wanted = pattern.lower()
    prefix, sep, _ = wanted.partition(":")
    if sep and prefix in FAMILIES:
        families = tuple(f for f in families if f == prefix)
    out = []
    for family in families:
        for name in names(family):
            full = full_name(family, name)
            if fnmatch.fnmatchcase(name.lower(), wanted) or fnmatch.fnmatchcase(full.lower(), wanted):
                out.append(full)
    return out


def overview() -> str:
    """What ``greenserve models`` says with no pattern: the families, a few names each, how to search (instant:
    no library is imported)."""
    lines = ["Models greenserve can serve (GREENSERVE_MODEL), by family:"]
    for family in FAMILIES:
        lines.append(f"  {family:<12} {KINDS[family]}: {', '.join(EXAMPLES[family])}, ...")
    lines += ["", "List or search them (shell-style patterns, any case; each family's library is imported, seconds):",
              "  greenserve models --family open_clip      every name of one family",
              "  greenserve models 'resnet*'               names that match, in every family",
              "  greenserve models 'timm:*convnext*'       in one family"]
    return "\n".join(lines)
