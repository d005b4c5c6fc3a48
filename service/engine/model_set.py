"""The models a server serves: ``GREENSERVE_MODELS``, or ``GREENSERVE_MODEL`` alone as a set of one, and how each
tower stays in memory (``Residency``). Torch-free and metric-free: the gunicorn master reads it.

    GREENSERVE_MODELS=search=open_clip:ViT-B-32@laion2b_s34b_b79k,labels=resnet50@/srv/weights/resnet50.pt

Each entry is ``name=model[@weights][;image=R][;text=R]`` (weights default to ``GREENSERVE_WEIGHTS``; R a tower's
residency, ``Residency``: pinned, lazy or ttl:<seconds>); the first is the default, the model a request
without a model name goes to. Without a residency, a text tower is pinned (searches never wait for a load) and an
image tower unloads after 15 idle minutes (a backfill's tower gives its memory back between runs).

A list in one variable, rather than a file, because that is what a systemd unit, a container and a Kubernetes
manifest pass most easily, and one line per model says all a model needs. Names are what every protocol routes
by (``http.model_names``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from service.settings import Settings, SettingsError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")
PINNED, LAZY, TTL = "pinned", "lazy", "ttl"
_TTL_RE = re.compile(r"^ttl:(\d+(?:\.\d+)?)(s|m|h)?$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


@dataclass(frozen=True)
class Residency:
    """How a tower stays in memory: pinned (loaded at start, never unloaded), lazy (loaded on first use), or
    ttl (unloaded after ``ttl_s`` with no request using it, loaded again on demand)."""

    kind: str = PINNED
    ttl_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Residency:
        """``pinned``, ``lazy`` or ``ttl:<seconds>`` (``ttl:600``, ``ttl:10m``, ``ttl:1h``)."""
        text = text.strip().lower()
        if text in (PINNED, LAZY):
            return cls(text)
        if m := _TTL_RE.match(text):
            return cls(TTL, float(m.group(1)) * _UNITS[m.group(2)])
        raise ValueError(f"{text!r} is not pinned, lazy or ttl:<seconds> (ttl:600, ttl:10m)")


TOWERS = ("image", "text")
DEFAULT_RESIDENCY = {"image": Residency(TTL, 900.0), "text": Residency(PINNED)}


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what requests call it
    model: str  # a GREENSERVE_MODEL value: resnet50, open_clip:ViT-B-32, timm:convnext_tiny
    weights: str  # a GREENSERVE_WEIGHTS value
    residency: dict[str, Residency] = field(default_factory=lambda: dict(DEFAULT_RESIDENCY))  # per tower


def default_name(model: str) -> str:
    """The name a lone ``GREENSERVE_MODEL`` is served under: a torchvision model's bare name, else the spec
    (as ``ModelInfo.name`` says it)."""
    family, sep, arch = model.partition(":")
    return arch if sep and family == "torchvision" else model


def model_set(settings: Settings) -> tuple[ModelSpec, ...]:
    """The served models, the default first."""
    if not settings.models.strip():
        return (ModelSpec(default_name(settings.model), settings.model, settings.weights),)
    specs = tuple(_entry(part.strip(), settings.weights) for part in settings.models.split(",") if part.strip())
    names = [s.name for s in specs]
    if not specs or len(set(names)) != len(names):
        raise SettingsError(f"GREENSERVE_MODELS={settings.models!r}: give each model a name of its own "
                            "(name=model[@weights], comma-separated)")
    return specs


def _entry(text: str, weights: str) -> ModelSpec:
    head, *options = text.split(";")
    name, sep, rest = head.partition("=")
    model, _, own_weights = rest.partition("@")
    if not sep or not _NAME_RE.match(name.strip()) or not model.strip():
        raise SettingsError(f"GREENSERVE_MODELS entry {text!r} is not name=model[@weights] (a name of letters, "
                            "digits, '.', '_', ':', '-'), e.g. search=open_clip:ViT-B-32@laion2b_s34b_b79k")
    residency = dict(DEFAULT_RESIDENCY)
    for option in options:
        tower, _, value = option.partition("=")
        try:
            if tower.strip() not in TOWERS:
                raise ValueError(f"{tower.strip()!r} is not a tower ({', '.join(TOWERS)})")
            residency[tower.strip()] = Residency.parse(value)
        except ValueError as exc:
            raise SettingsError(f"GREENSERVE_MODELS entry {text!r}: {exc}; e.g. ;image=ttl:600;text=pinned") from None
    return ModelSpec(name.strip(), model.strip(), own_weights.strip() or weights, residency)
