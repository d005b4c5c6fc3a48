"""The protocols' model names: which served model, and which task, a name in a request asks for.

KServe v1 and TorchServe clients choose what they get by the model's name only, so a model ``<m>`` is
served under two names:

    <m>              its classes (``classify``)
    <m>-embedding    its embeddings (when it embeds)

OpenAI lists both and embeds under either; the native ``GET /v1/models/<name>`` and the OpenAPI document
use the same two; OIP v2 names the model plainly (its requested outputs choose the task). Every protocol
resolves a name here, so serving several models by name changes this module, not the protocols.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.engine.types import ModelInfo
from service.errors import NotFound

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


def resolve(served: str, asked: str) -> Target:
    """KServe v1, TorchServe, OpenAI and the native routes: ``<served>`` is its classes,
    ``<served>-embedding`` its embeddings; any other name is 404."""
    if asked == served:
        return Target(served, "classify")
    if asked == served + EMBEDDING_SUFFIX:
        return Target(served, "embeddings")
    raise NotFound(f"no model named {asked!r}; this server serves {served!r} (classes) and "
                   f"{served + EMBEDDING_SUFFIX!r} (embeddings)", code="model_not_found")


def resolve_plain(served: str, asked: str) -> str:
    """OIP v2: the model a plain name asks for (Triton's words when there is none: 404)."""
    if asked != served:
        raise NotFound(f"Request for unknown model: {asked!r}; this server serves {served!r}", code="model_not_found")
    return served
