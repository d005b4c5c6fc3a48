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
