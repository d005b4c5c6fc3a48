"""The protocols' model names: which served model, and which task, a name in a request asks for.

KServe v1 and TorchServe clients choose what they get by the model's name only, so a model ``<m>`` is
served under two names:

    <m>              its classes (``classify``)
    <m>-embedding    its embeddings (when it embeds)

OpenAI lists both and embeds under either; the native ``GET /v1/models/<name>`` and the OpenAPI document
use the same two; OIP v2 names the model plainly (its requested outputs choose the task); immich names a CLIP
``<architecture>__<pretrained tag>`` (``resolve_immich``). Every protocol resolves a name here, so serving several
models by name changes this module, not the protocols.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.engine.types import ModelInfo
from service.errors import NotFound, RequestError

EMBEDDING_SUFFIX = "-embedding"
TASKS = ("classify", "embeddings")  # what a model may be named for (its classes, its embeddings)


@dataclass(frozen=True)
class Target:
    """What a protocol's model name asks for."""

    model: str  # the served model's name
    task: str  # "classify" or "embeddings"


def served_name(info: ModelInfo | None, configured: str) -> str:
    """The served model's name: its own once loaded, ``GREENSERVE_MODEL`` (``configured``) until then."""
    return info.name if info else configured


def names(model: str, tasks: Sequence[str] = TASKS) -> list[str]:
    """What a protocol may call ``model``: its name (its classes) and ``<name>-embedding`` if it embeds."""
    return [model] + ([model + EMBEDDING_SUFFIX] if "embeddings" in tasks else [])


Served = str | Sequence[str]  # the served models' names, the default first (or one name)


def _all(served: Served) -> list[str]:
    return [served] if isinstance(served, str) else list(served)


def resolve(served: Served, asked: str) -> Target:
    """KServe v1, TorchServe, OpenAI and the native routes: ``<m>`` is model m's classes, ``<m>-embedding``
    its embeddings; any other name is 404, naming what is served."""
    if not isinstance(asked, str):
        raise RequestError(f"model must be a string naming a served model; got {type(asked).__name__}")
    models = _all(served)
    if asked in models:
        return Target(asked, "classify")
    if asked.endswith(EMBEDDING_SUFFIX) and asked[:-len(EMBEDDING_SUFFIX)] in models:
        return Target(asked[:-len(EMBEDDING_SUFFIX)], "embeddings")
    listed = "; ".join(f"{m!r} (classes) and {m + EMBEDDING_SUFFIX!r} (embeddings)" for m in models)
    raise NotFound(f"no model named {asked!r}; this server serves {listed}", code="model_not_found")


def resolve_plain(served: Served, asked: str) -> str:
    """OIP v2: the model a plain name asks for (Triton's words when there is none: 404)."""
    models = _all(served)
    if asked not in models:
        raise NotFound(f"Request for unknown model: {asked!r}; this server serves {', '.join(map(repr, models))}",
                       code="model_not_found")
    return asked


# ---------------------------------------------------------------------- immich

# immich names a CLIP ``<open_clip architecture>__<pretrained tag>`` (ViT-B-32__openai, ViT-B-16-SigLIP__webli,
# nllb-clip-base-siglip__v1), read as its ML service reads a name: the part after the last "/", ":" and "\" as
# "_", dots dropped (``immich-app/ViT-B-32::openai`` is ``ViT-B-32__openai``)
IMMICH_SEPARATOR = "__"
_IMMICH_CLEAN = str.maketrans(":\\", "__", ".")
_NOT_TAGS = ("auto", "imagenet", "random")  # GREENSERVE_WEIGHTS values that name no pretrained tag

Configured = Mapping[str, tuple[str, str]]  # each served model's (model, weights), as GREENSERVE_MODELS says


def immich_clean(name: str) -> str:
    return name.split("/")[-1].translate(_IMMICH_CLEAN)


def resolve_immich(configured: Configured, asked: str) -> str:
    """immich's ``modelName``: the served model of that name (its configuration must not say otherwise); else the
    one served as ``open_clip:<architecture>__<tag>`` (immich's own name: served the immich way, docs/MODELS.md);
    else one served as ``open_clip:<architecture>`` with that pretrained tag (the same weights, open_clip's way).
    Architectures in any case, "-" and "_" alike in tags (immich writes ``laion2b-s34b-b79k`` for open_clip's
    ``laion2b_s34b_b79k``). Any other name is 404, naming what is served: never another model's vectors."""
    name = immich_clean(asked)
    arch, sep, tag = name.partition(IMMICH_SEPARATOR)
    if name in configured:
        model, weights = configured[name]
        if sep and not _agrees(arch, tag, model, weights, exact=False):
            raise NotFound(f"the served model {name!r} is {_describe(model, weights)}, which is not {arch} with "
                           f"{tag}; fix GREENSERVE_MODELS", code="model_not_found")
        return name
    found = [served for served, (model, weights) in configured.items() if sep and _agrees(arch, tag, model, weights)]
    if found:  # the immich way first
        return min(found, key=lambda served: IMMICH_SEPARATOR not in configured[served][0])
    listed = "; ".join(f"{served!r} ({_describe(*spec)})" for served, spec in configured.items())
    hint = f" (GREENSERVE_MODELS={name}=open_clip:{name})" if sep else ""
    raise NotFound(f"immich asks for {asked!r}, which this server does not serve; it serves {listed}. Serve it"
                   f"{hint}, or choose a served model in immich's Smart Search settings", code="model_not_found")


def _agrees(arch: str, tag: str, model: str, weights: str, *, exact: bool = True) -> bool:
    """Whether ``model`` with ``weights`` serves ``open_clip:<arch>`` with ``tag``: the same architecture and
    tag. ``exact`` false: weights that name no tag (a file, random) may be it too."""
    family, _, own = model.partition(":")
    own_arch, sep, own_tag = own.partition(IMMICH_SEPARATOR)
    if family != "open_clip" or own_arch.lower() != arch.lower():
        return False
    if sep:  # immich's own name: its tag names the weights (a file or random ones may stand in)
        return _same_tag(own_tag, tag)
    if not _is_tag(weights):
        return not exact
    return _same_tag(weights, tag)


def _same_tag(a: str, b: str) -> bool:
    return a.lower().replace("-", "_") == b.lower().replace("-", "_")


def _is_tag(weights: str) -> bool:
    return weights not in _NOT_TAGS and "/" not in weights and not weights.endswith((".pt", ".pth", ".bin", ".safetensors"))


def _describe(model: str, weights: str) -> str:
    """A served model for a message: a tag as it is, a file by its kind only (a path on the server is none of
    the client's business)."""
    shown = weights if _is_tag(weights) or weights in _NOT_TAGS else "from a file"
    return model if IMMICH_SEPARATOR in model and weights == "auto" else f"{model} with weights {shown}"
