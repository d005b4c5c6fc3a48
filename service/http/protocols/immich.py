"""immich's machine-learning protocol: what immich's server sends the URL in ``IMMICH_MACHINE_LEARNING_URL``
(immich: ``server/src/repositories/machine-learning.repository.ts``; its ML service: ``machine-learning/immich_ml/``).

    GET  /ping      immich's availability check (every 30 s, 2 s timeout, any 2xx is healthy) is TorchServe's route
                    (``torchserve.ping``): 200 once this worker's models are loaded, 500 while they load
    POST /predict   multipart/form-data: ``entries``, JSON ``{task: {type: {"modelName", "options"?}}}``, and one
                    ``image`` file (the preview JPEG, sent as a nameless Blob: ``filename="blob"``) or one ``text``

    {"clip": {"visual": {"modelName": "ViT-B-32__openai"}}} + image
        → {"clip": "[0.0123,...]", "imageHeight": h, "imageWidth": w}   (the stored image's size, as Pillow reads it)
    {"clip": {"textual": {"modelName": ..., "options": {"language": "de"}}}} + text → {"clip": "[...]"}
    any other task (facial-recognition, ocr)
        → forwarded as it came to GREENSERVE_IMMICH_UPSTREAM, its answer returned as it is (``upstream``); 501 without

The vector is a JSON array inside a string, L2-normalised float32 in orjson's shortest form, as immich's ML service
writes it: immich's server stores that string in pgvector unparsed. Errors are immich's ML service's (FastAPI's
``{"detail": message}``, with greenserve's ``code``): 422 for ``entries`` that do not parse, 400 for neither image
nor text; greenserve's own 404 for a model it does not serve (immich's: 500). Names resolve in
``model_names.resolve_immich``; a query is prepared by ``immich_text``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from flask import Blueprint, Response, current_app, g, request

from service import metrics
from service.errors import NotServed, RequestError, Unprocessable, UnsupportedMediaType
from service.http import current, model_names
from service.http.body import check_form
from service.http.dataplane import DataPlane
from service.http.protocols import immich_text
from service.http.protocols.surface import Surface
from service.http.upstream import Upstream
from service.pipeline.decode import open_checked
from service.pipeline.inputs import bytes_ref
from service.pipeline.requests import InferenceRequest
from service.pipeline.text_options import TextOptions, check_length

bp = Blueprint("immich", __name__)
UPSTREAM = "greenserve.immich_upstream"  # the app's ``Upstream`` or None, in ``app.extensions`` (``create_app``)
CLIP = "clip"
KINDS = ("visual", "textual")
TASKS = ("facial-recognition", "ocr")  # immich's other tasks: the metrics' labels (any other is "other")
EXAMPLE = '{"clip": {"visual": {"modelName": "ViT-B-32__openai"}}}'


def error_body(status: int, error: dict[str, Any], request_id: str) -> dict[str, Any]:
    """FastAPI's ``{"detail": message}`` (what immich's ML service answers), with greenserve's code and details."""
    return {"detail": error["message"], "code": error["code"], "details": error["details"], "request_id": request_id}


SURFACE = Surface("immich", re.compile(r"^/predict$"), re.compile(r"(?!)"), error_body)  # /ping is TorchServe's


@dataclass(frozen=True)
class Entries:
    """What ``entries`` asks for: its tasks, and (for CLIP) which tower, which model and the options."""

    tasks: tuple[str, ...]
    kind: str = ""  # visual | textual: the clip entry's type
    model: str = ""  # the clip entry's modelName
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def forwarded(self) -> bool:
        """Anything but CLIP is immich's own ML service's to answer."""
        return any(task != CLIP for task in self.tasks)

    @property
    def label(self) -> str:
        """The metrics' task label: bounded, whatever a client sends."""
        if not self.forwarded:
            return f"{CLIP}-{self.kind}"
        task = next(t for t in self.tasks if t != CLIP)
        return task if task in TASKS else "other"


def parse_entries(raw: str | None) -> Entries:
    """``entries`` as immich's ML service reads it, or 422 ``invalid_entries`` saying what is wrong."""
    if raw is None:
        raise Unprocessable(f"the form has no 'entries' part; send the tasks as JSON in it, like {EXAMPLE}")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Unprocessable(f"Invalid request format: 'entries' is not JSON ({exc}); send {EXAMPLE}") from None
    if not isinstance(doc, dict) or not doc:
        raise Unprocessable(f"Invalid request format: 'entries' must be an object of tasks, like {EXAMPLE}")
    for task, types in doc.items():
        if not isinstance(types, dict) or not types:
            raise Unprocessable(f"Invalid request format: entries[{task!r}] must be an object of model types")
        for kind, entry in types.items():
            _check_entry(f"entries[{task!r}][{kind!r}]", entry)
    entries = Entries(tuple(doc))
    if entries.forwarded:
        return entries
    clip = doc[CLIP]
    if len(clip) != 1 or next(iter(clip)) not in KINDS:
        raise Unprocessable(f"Invalid request format: entries['clip'] takes one entry, 'visual' or 'textual'; got "
                            f"{', '.join(map(repr, clip))}")
    kind, entry = next(iter(clip.items()))
    return Entries(entries.tasks, kind, entry["modelName"], entry.get("options") or {})


def _check_entry(where: str, entry: Any) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("modelName"), str) or not entry["modelName"].strip():
        raise Unprocessable(f'Invalid request format: {where} must be {{"modelName": "<name>", "options": {{...}}}}')
    if not isinstance(entry.get("options") or {}, dict):
        raise Unprocessable(f"Invalid request format: {where}['options'] must be an object")


@bp.post("/predict")
def predict() -> Response:
    with current.busy() as plane:
        if request.mimetype != "multipart/form-data":
            raise UnsupportedMediaType(f"Content-Type {request.mimetype!r} is not accepted; immich sends "
                                       "multipart/form-data with the parts 'entries' and 'image' or 'text'")
        check_form()
        raw = request.get_data(cache=True)  # kept for a forward; the form is parsed from this copy
        entries = parse_entries(request.form.get("entries"))
        g.immich_task = entries.label
        if entries.forwarded:
            return _forward(plane, raw, entries)
        image, text = request.files.getlist("image"), request.form.get("text") or None  # FastAPI: "" is absent
        if not image and text is None:
            raise RequestError("Either image or text must be provided", code="invalid_request")
        model = model_names.resolve_immich(plane.configured(), entries.model)
        body = _visual(plane, model, image) if entries.kind == "visual" else _textual(plane, model, text, entries)
    return current.json_response(body)


def _visual(plane: DataPlane, model: str, image: list[Any]) -> dict[str, Any]:
    if len(image) != 1:
        raise RequestError(f"the clip visual entry embeds one image; send it in the part 'image' (got {len(image)})")
    settings = plane.settings
    data = image[0].read(settings.max_image_bytes + 1)
    body = current.run(InferenceRequest((bytes_ref(0, "image", data, settings),), model=model), "embeddings")
    width, height = open_checked(data, settings.max_image_pixels).size  # the header: decoded fine just now
    return {CLIP: vector_text(body["data"][0]["embedding"]), "imageHeight": height, "imageWidth": width}


def _textual(plane: DataPlane, model: str, text: str | None, entries: Entries) -> dict[str, Any]:
    if text is None:
        raise RequestError("the clip textual entry embeds a text; send it in the part 'text'")
    language = entries.options.get("language")
    if language is not None and not isinstance(language, str):
        raise Unprocessable(f"Invalid request format: options.language must be a locale like \"de\"; got {language!r}")
    prepared = immich_text.prepare(text, immich_text.rules_for(plane.configured()[model][0]), language)
    check_length("the text", prepared, plane.settings)
    body = current.run(InferenceRequest((), text=TextOptions(texts=(prepared,)), model=model), "embeddings")
    return {CLIP: vector_text(body["data"][0]["embedding"])}


def vector_text(embedding: Any) -> str:
    """The vector as immich's ML service sends it: a JSON array of float32 in their shortest form, as a string."""
    return orjson.dumps(np.asarray(embedding, dtype=np.float32), option=orjson.OPT_SERIALIZE_NUMPY).decode()


def _forward(plane: DataPlane, raw: bytes, entries: Entries) -> Response:
    upstream: Upstream | None = current_app.extensions.get(UPSTREAM)
    task = next(t for t in entries.tasks if t != CLIP)
    if upstream is None:
        raise NotServed(f"greenserve runs immich's CLIP only; {task!r} is for immich's own machine-learning "
                        "service: set GREENSERVE_IMMICH_UPSTREAM to its URL (http://immich-machine-learning:3003), "
                        "where greenserve forwards it (docs/PROTOCOLS.md#immich)")
    ctx = current.context()
    answer = upstream.forward("/predict", raw, request.content_type or "", request_id=ctx.request_id,
                              deadline=ctx.deadline(plane.settings.request_timeout_s))
    return Response(answer.body, status=answer.status, content_type=answer.content_type or "application/octet-stream")


@bp.after_request
def _observe(response: Response) -> Response:
    """Count and time every /predict by its task, its errors included (Flask runs this after an error's handler)."""
    task = g.get("immich_task", "invalid")
    metrics.IMMICH_REQUESTS.labels(task, f"{response.status_code // 100}xx").inc()
    ctx = current.context_or_none()
    if ctx is not None:
        metrics.IMMICH_SECONDS.labels(task).observe(time.monotonic() - ctx.started)
    return response
