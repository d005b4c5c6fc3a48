"""The standard protocols, each beside the native routes and sharing their request path (``service.http.dataplane``):

    oip         Open Inference Protocol v2 (Triton / KServe v2 / OpenVINO / MLServer clients)   /v2/...
    openai      OpenAI embeddings: the same /v1/embeddings and /v1/models, answered as supersets
    kserve_v1   KServe v1 (TF Serving style) ``instances``                                     / and /v1/models/<m>:predict
    torchserve  TorchServe's inference API (and a read-only /models)                           /ping, /predictions, /models
    immich      immich's machine-learning service: CLIP here, faces and OCR forwarded           /predict (and /ping)
"""

from __future__ import annotations

import re
from typing import Any

from service.http.protocols import immich, kserve_v1, oip, torchserve
from service.http.protocols.surface import Surface, native_error_body

BLUEPRINTS = (oip.bp, kserve_v1.bp, torchserve.bp, immich.bp)
SURFACES: tuple[Surface, ...] = (oip.SURFACE, kserve_v1.SURFACE, torchserve.SURFACE, immich.SURFACE)
# the native API's routes that need no token: probes, metrics and the API description
_NATIVE_OPEN = re.compile(r"^/(healthz|readyz|metrics|openapi\.json)$")


def surface_for(path: str) -> Surface | None:
    return next((s for s in SURFACES if s.owns(path)), None)


def error_body(path: str, status: int, error: dict[str, Any], request_id: str) -> dict[str, Any]:
    surface = surface_for(path)
    return (surface.error_body if surface else native_error_body)(status, error, request_id)


def needs_token(path: str) -> bool:
    """With GREENSERVE_API_TOKEN set: every protocol's inference and metadata routes, never its health ones."""
    surface = surface_for(path)
    if surface is not None:
        return surface.open_paths.match(path) is None
    return path.startswith("/v1/") and _NATIVE_OPEN.match(path) is None
