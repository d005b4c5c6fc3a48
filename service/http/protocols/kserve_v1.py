"""KServe v1 (TF Serving style): ``GET /`` liveness and ``POST /v1/models/<m>:predict`` with ``instances``.

The model name picks the task, as every v1 client parameterises by name only: ``<m>`` answers each
instance with its top-k ``{label: score}`` (TorchServe's ``image_classifier`` shape, best first),
``<m>-embedding`` with its embedding (a list of floats). An instance is, first match wins:

    "https://.../a.jpg", "a.jpg", "data:..."   a greenserve image reference (URL, relative name, data: URL)
    {"b64": "<base64>"}                        the TF Serving convention for bytes
    {"image": {"b64": "<base64>"}}             one key (image, image_bytes, ...) holding {"b64": ...}
    {"data": "<base64>"}                       TorchServe-on-KServe (a data: or http(s) string is a reference)
    {"url": "https://.../a.jpg"}

Other keys of an instance (``key``, ``target``) are ignored. ``GET /v1/models`` and ``GET /v1/models/<m>``
(readiness) are the native routes (``service.http.routes``). Content-Type is ignored, as KServe reads the body.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from flask import Blueprint, Response

from service.errors import RequestError
from service.http import current, model_names
from service.http.body import read as read_body
from service.http.protocols.surface import Surface, flat_error_body
from service.pipeline import postprocess
from service.pipeline.inputs import base64_ref, check_count, is_reference, request_options, string_ref
from service.pipeline.json_body import load_json
from service.pipeline.requests import ImageRef, InferenceRequest
from service.settings import Settings

bp = Blueprint("kserve_v1", __name__)
SURFACE = Surface("kserve_v1", re.compile(r"^/$|^/v1/models/[^/]+:predict$"), re.compile(r"^/$"), flat_error_body)

FIELDS = ("instances", "inputs", "top_k", "normalize")
EXAMPLE = '{"instances": [{"b64": "<base64 image bytes>"}, "https://.../a.jpg"]}'
_INSTANCE_FORMS = ('an image URL, a relative name or a data: URL, {"b64": ...}, {"image": {"b64": ...}}, '
                   '{"data": "<base64>"} or {"url": ...}')


@bp.get("/")
def alive() -> Response:
    """Server liveness (kserve's ``is_server_live`` reads ``status``): this worker answers; readiness is
    /v1/models/<m>. The rest points a person who opened the server's address at the page and the API (a browser
    is sent to the page before it gets here: ``ui``)."""
    return current.json_response({"status": "alive", "page": "/ui", "api": "/openapi.json", "ready": "/readyz"})


@bp.post("/v1/models/<name>:predict")
def predict(name: str) -> Response:
    with current.busy() as plane:
        target = model_names.resolve(plane.served, name)
        req = replace(plane.parse_body(read_body(), parse_request, plane.settings), model=target.model)
        body = current.run(req, target.task)
    return current.json_response({"predictions": predictions(body, target.task)})


def parse_request(raw: bytes, settings: Settings) -> InferenceRequest:
    """The body as sent → the request (``parse``)."""
    return parse(load_json(raw, EXAMPLE), settings)


def parse(doc: Mapping[str, Any], settings: Settings) -> InferenceRequest:
    """``{"instances": [...], "top_k": 5, "normalize": true}`` → the request (``inputs`` for ``instances``)."""
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(FIELDS)}")
    instances = _instances(doc)
    check_count(len(instances), settings)
    refs = tuple(_instance_ref(i, item, settings) for i, item in enumerate(instances))
    return InferenceRequest(refs, **request_options(doc, settings))


def predictions(body: Mapping[str, Any], task: str) -> list[Any]:
    """The native rows as v1 ``predictions``: ``{label: score}`` per image, or its embedding."""
    if task == "embeddings":
        return [item["embedding"] for item in body["data"]]
    return [postprocess.label_scores(item["labels"]) for item in body["data"]]


def _instances(doc: Mapping[str, Any]) -> list[Any]:
    if "instances" in doc and "inputs" in doc:
        raise RequestError('send "instances" or "inputs", not both')
    if "inputs" in doc and not isinstance(doc["inputs"], list):
        raise RequestError('"inputs" is accepted as a list of instances only (the columnar form is not); '
                           f"send {EXAMPLE}")
    instances = doc.get("instances", doc.get("inputs"))
    if not isinstance(instances, list) or not instances:
        raise RequestError(f'"instances" must be a non-empty list of images; send {EXAMPLE}')
    return instances


def _instance_ref(index: int, item: Any, settings: Settings) -> ImageRef:
    where = f"instances[{index}]"
    if isinstance(item, str) and item.strip():
        return string_ref(index, item.strip(), settings)
    if isinstance(item, dict):
        payload = _b64_payload(where, item)
        if payload is not None:
            return base64_ref(index, where, payload, settings)
        if "data" in item:
            return _data_ref(index, where, item["data"], settings)
        url = item.get("url")
        if isinstance(url, str) and url.strip():
            return string_ref(index, url.strip(), settings)
    raise RequestError(f"{where} must be {_INSTANCE_FORMS}")


def _b64_payload(where: str, item: Mapping[str, Any]) -> str | None:
    """The base64 text of ``{"b64": s}`` or of the one key holding ``{"b64": s}``; None for other forms."""
    if "b64" in item:
        value = item["b64"]
    else:
        keys = [k for k, v in item.items() if isinstance(v, dict) and "b64" in v]
        if not keys:
            return None
        if len(keys) > 1:
            raise RequestError(f"{where} holds {len(keys)} images ({', '.join(keys)}); send one image per instance")
        value = item[keys[0]]["b64"]
    if not isinstance(value, str):
        raise RequestError(f'{where}: "b64" must be a string of base64-encoded image bytes')
    return _unwrapped(value)


def _data_ref(index: int, where: str, value: Any, settings: Settings) -> ImageRef:
    if isinstance(value, str):
        text = value.strip()
        if is_reference(text):
            return string_ref(index, text, settings)
        return base64_ref(index, where, _unwrapped(text), settings)
    if isinstance(value, list):
        raise RequestError(f'{where}: "data" is a list (a preprocessed tensor?); greenserve resizes and '
                           'normalises images itself, so send the image file\'s bytes base64-encoded, '
                           '{"data": "<base64>"} or {"b64": "<base64>"}, or its URL')
    raise RequestError(f'{where}: "data" must be a string of base64-encoded image bytes (or a URL)')


def _unwrapped(payload: str) -> str:
    """Base64 as ``base64 photo.jpg`` prints it, wrapped at 76 columns, decodes like one line."""
    return "".join(payload.split()) if "\n" in payload else payload.strip()
