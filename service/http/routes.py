"""The native routes: ``/v1/embeddings``, ``/v1/classify``, ``/v1/rank``, the model list, the probes
and ``/metrics``. Each parses its body into an ``InferenceRequest`` and hands it to the data plane."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import orjson
from flask import Blueprint, Response, request

from service import metrics
from service.engine.types import ModelInfo
from service.errors import RequestError, UnsupportedMediaType
from service.http import current, model_names
from service.http.body import check_form
from service.http.body import read as read_body
from service.http.dataplane import DataPlane
from service.http.protocols import openai
from service.pipeline.inputs import check_part_names, parse_doc, parse_form
from service.pipeline.json_body import load_json
from service.pipeline.requests import InferenceRequest
from service.settings import Settings

bp = Blueprint("routes", __name__)


# ---------------------------------------------------------------------- inference


@bp.post("/v1/embeddings")
def embeddings() -> Response:
    """Native ``{"images"|"texts": [...]}`` or OpenAI ``{"model", "input"}``: one response shape for both."""
    with current.busy() as plane:
        req, options = _parse_request(plane, "embeddings", openai_too=True)
        media_type = current.streamed_format()
        if media_type and options is None:  # an OpenAI body gets OpenAI's JSON, whatever it accepts
            return current.stream(req, "embeddings", media_type)
        body = current.run(req, "embeddings")
    return current.json_response(openai.embeddings_body(body, req, options))


@bp.post("/v1/classify")
def classify() -> Response:
    return _infer("classify")


@bp.post("/v1/rank")
def rank() -> Response:
    """Images ordered by their similarity to a text ``query``: an album searched with a sentence."""
    return _infer("rank")


def _infer(task: str) -> Response:
    with current.busy() as plane:
        req, _ = _parse_request(plane, task)
        media_type = current.streamed_format()
        if media_type:
            return current.stream(req, task, media_type)
        return current.json_response(current.run(req, task))


def _parse_request(plane: DataPlane, task: str, openai_too: bool = False
                   ) -> tuple[InferenceRequest, openai.Options | None]:
    settings = plane.settings
    mimetype = request.mimetype
    if mimetype == "multipart/form-data":
        check_form()
        check_part_names([*request.files, *request.form])
        files = [(f.filename or "", f.read(settings.max_image_bytes + 1)) for f in request.files.getlist("images")]
        unexpected = sorted(set(request.files) - {"images"})
        if unexpected:
            raise RequestError(f"files in unknown field(s) {', '.join(unexpected)}; use the field 'images'")
        fields = {k: v for k, v in request.form.to_dict().items() if k != "labels"}
        return _named(plane, parse_form(fields, files, settings, task, labels=request.form.getlist("labels"))), None
    if mimetype in ("application/json", "") or mimetype.endswith("+json"):
        req, options = plane.parse_body(read_body(), _parse_json, settings, task, openai_too, plane.infos())
        return (req, options) if options is not None else (_named(plane, req), None)
    raise UnsupportedMediaType(f"Content-Type {mimetype!r} is not accepted; send application/json or "
                               "multipart/form-data")


def _parse_json(raw: bytes, settings: Settings, task: str, openai_too: bool,
                models: Mapping[str, ModelInfo | None]) -> tuple[InferenceRequest, openai.Options | None]:
    """The native JSON body, or (on /v1/embeddings) OpenAI's ``{"model", "input"}``."""
    doc = load_json(raw, '{"images": ["https://.../a.jpg"]}')
    if openai_too and openai.is_openai(doc):
        return openai.parse(doc, settings, models)
    return parse_doc(doc, settings, task), None


def _named(plane: DataPlane, req: InferenceRequest) -> InferenceRequest:
    """A native request's ``model``, resolved to a served name (404 naming those served)."""
    return replace(req, model=model_names.resolve_plain(plane.served, req.model)) if req.model else req


# ---------------------------------------------------------------------- info and probes


@bp.get("/v1/models")
def models() -> Response:
    """Every served model: native (``data[0]`` is the default model's description), OpenAI (``data[].id``) and
    KServe v1 (``models``); 503 while none is loaded."""
    plane = current.plane()
    body = openai.models_body(plane.states(), {name: plane.residency(name) for name in plane.served})
    return _json(body if plane.info_of() else {**body, "status": "loading"}, 200 if plane.info_of() else 503)


@bp.get("/v1/models/<name>")
def model(name: str) -> Response:
    """OpenAI's model retrieve and KServe v1's model readiness (``ready``; 503 while it loads)."""
    plane = current.plane()
    target = model_names.resolve(plane.served, name)
    if plane.info_of(target.model) is None:
        return _json({"id": name, "name": name, "object": "model", "ready": False,
                      "error": plane.not_ready_reason(target.model)}, 503)
    return _json({**openai.model_card(name), "name": name, "ready": True})


@bp.get("/metrics")
def prometheus() -> Response:
    text, content_type = metrics.exposition()
    return Response(text, content_type=content_type)


@bp.get("/healthz")
def healthz() -> Response:
    return _json({"status": "ok", "pid": os.getpid()})


@bp.get("/readyz")
def readyz() -> Response:
    plane = current.plane()
    if plane.runner.ready:
        return _json({"status": "ready", "pid": os.getpid(), "model": plane.model_name, "models": list(plane.served)})
    return _json({"status": "not_ready", "pid": os.getpid(), "reason": plane.not_ready_reason()}, 503)


def _json(body: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(body), status=status, mimetype="application/json")
