"""TorchServe's inference API: ``/ping``, ``POST|PUT /predictions/<m>``, and a read-only ``/models``.

    GET       /ping                                  200 {"status": "Healthy"} once this worker's model is
                                                     loaded, else 500 {"status": "Unhealthy"}
    POST|PUT  /predictions/<m>[/1]                   the image as the body (``curl -T kitten.jpg`` is a PUT),
                                                     any or no Content-Type; or multipart files in the field
                                                     ``data`` (or ``images``) → {label: score}, top 5
    POST|PUT  /predictions/<m>-embedding[/1]         → the embedding, a list of floats
    GET       /models, /models/<m>[/1]               TorchServe's management list and description

Extensions: ``?top_k=`` and ``?normalize=false``; several files in one form answer a list (TorchServe keeps
only the last). Deviation: an unusable image is 422 ``ImageError``, not TorchServe's batch-wide 503
"Prediction failed", which invites retries of input that can never succeed.
"""

from __future__ import annotations

import os
import re
import resource
import time
from dataclasses import replace
from typing import Any

from flask import Blueprint, Response, request

from service.errors import MethodNotAllowed, NotFound, RequestError, UnsupportedMediaType
from service.http import current, model_names
from service.http.body import check_form
from service.http.body import read as read_body
from service.http.dataplane import DataPlane
from service.http.protocols import openai
from service.http.protocols.surface import Surface
from service.pipeline import postprocess
from service.pipeline.inputs import bytes_ref, check_count, check_part_names, form_value, request_options
from service.pipeline.requests import InferenceRequest
from service.settings import Settings

bp = Blueprint("torchserve", __name__)

MODEL_VERSION = "1"  # one version of the one model: /predictions/<m>/1 is /predictions/<m>
VERSIONS = (MODEL_VERSION, "1.0")  # torch-model-archiver's default version is "1.0"
FILE_FIELDS = ("data", "images")  # TorchServe's multipart field, and the native one
RAW_NAME = "body"  # TorchServe's name for a non-form body (the image in the details of an error)
WRITE_METHODS = ["POST", "PUT", "DELETE", "PATCH"]
STARTED = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(openai.CREATED))  # this worker's start
# TorchServe's exception names (its ErrorResponse ``type``) for greenserve's statuses
_TYPES = {400: "BadRequestException", 401: "InvalidKeyException", 404: "ResourceNotFoundException",
          405: "MethodNotAllowedException", 413: "PayloadTooLargeException", 415: "UnsupportedMediaTypeException",
          503: "ServiceUnavailableException", 504: "RequestTimeoutException"}
_IMAGE_STATUSES = (413, 415, 422)  # an ImagesFailed has its images' shared status (or 422)


def error_body(status: int, error: dict[str, Any], request_id: str) -> dict[str, Any]:
    """TorchServe's ``{"code", "type", "message"}``, plus greenserve's code and per-image details."""
    return {"code": status, "type": exception_type(status, error), "message": error["message"],
            "error_code": error["code"], "details": error["details"], "request_id": request_id}


def exception_type(status: int, error: dict[str, Any]) -> str:
    if error["code"] == "model_not_found":
        return "ModelNotFoundException"
    if status == 422 or (status in _IMAGE_STATUSES and error["details"]):
        return "ImageError"
    return _TYPES.get(status, "BadRequestException" if status < 500 else "InternalServerException")


SURFACE = Surface("torchserve", re.compile(r"^/(ping|predictions|models)(/|$)"), re.compile(r"^/ping$"), error_body)


@bp.get("/ping")
def ping() -> Response:
    """TorchServe's health check is model readiness: this worker's models are loaded."""
    if current.plane().runner.ready:
        return current.json_response({"status": "Healthy"})
    return current.json_response({"status": "Unhealthy"}, 500)


@bp.route("/predictions/<name>", methods=["POST", "PUT"])
@bp.route("/predictions/<name>/<version>", methods=["POST", "PUT"])
def predict(name: str, version: str | None = None) -> Response:
    with current.busy() as plane:
        target = model_names.resolve(plane.served, name)
        task = target.task
        _check_version(name, version)
        req = replace(parse_request(plane.settings), model=target.model)
        body = current.run(req, task)
    answers = [item["embedding"] if task == "embeddings" else postprocess.label_scores(item["labels"]) for item in body["data"]]
    return current.json_response(answers[0] if len(answers) == 1 else answers)


def parse_request(settings: Settings) -> InferenceRequest:
    """The images (multipart files, or the whole body as one) and the query's options."""
    files = _uploads(settings) if request.mimetype == "multipart/form-data" else [(RAW_NAME, _raw_image())]
    check_count(len(files), settings)
    refs = tuple(bytes_ref(i, filename, data, settings) for i, (filename, data) in enumerate(files))
    return InferenceRequest(refs, **_query_options(settings))


def _uploads(settings: Settings) -> list[tuple[str, bytes]]:
    check_form()
    check_part_names([*request.files, *request.form])
    unexpected = sorted(set(request.files) - set(FILE_FIELDS))
    if unexpected:
        raise RequestError(f"files in unknown field(s) {', '.join(unexpected)}; use the field 'data'")
    files = [(f.filename or f"{field}-{i}", f.read(settings.max_image_bytes + 1))
             for i, (field, f) in enumerate(request.files.items(multi=True))]
    if not files:
        raise RequestError("no files in the form field 'data'; upload with -F data=@kitten.jpg, or send the "
                           "image itself as the body (curl -T kitten.jpg)")
    return files


def _raw_image() -> bytes:
    """The body is the image, whatever its Content-Type says (TorchServe's ``body`` parameter)."""
    raw = read_body()
    if not raw:
        raise RequestError("the request body is empty; send the image's bytes (curl -T kitten.jpg) or a form "
                           "with the file in the field 'data' (curl -F data=@kitten.jpg)")
    if raw[:64].lstrip()[:1] in (b"{", b"["):
        raise UnsupportedMediaType("the body is JSON, but /predictions takes the image's bytes (curl -T "
                                   "kitten.jpg, or -F data=@kitten.jpg); for JSON with URLs or base64 use "
                                   "/v1/classify, /v1/embeddings or /v1/models/<m>:predict")
    return raw


def _query_options(settings: Settings) -> dict[str, Any]:
    """``?top_k=3`` and ``?normalize=false`` (greenserve extensions; other parameters are the handler's)."""
    given = {k: form_value(k, request.args[k]) for k in ("top_k", "normalize") if k in request.args}
    return request_options(given, settings)


def _check_version(name: str, version: str | None) -> None:
    if version is not None and version not in VERSIONS:
        raise NotFound(f"model {name!r} has no version {version!r}; it has version {MODEL_VERSION} only (or "
                       "leave the version out)", code="model_not_found")


# ---------------------------------------------------------------------- management (read-only)


@bp.get("/models")
def list_models() -> Response:
    """``{"models": [{"modelName", "modelUrl"}]}``: each model's classifier and ``<m>-embedding`` (only the first
    while it loads, when what it provides is not known yet)."""
    plane = current.plane()
    models = []
    for served, engine in plane.runner.engines.items():
        info = engine.info
        url = info.weights if info else engine.spec.weights
        models += [{"modelName": n, "modelUrl": url} for n in (model_names.names(served, info.tasks) if info else [served])]
    return current.json_response({"models": models})


@bp.get("/models/<name>")
@bp.get("/models/<name>/<version>")
def describe_model(name: str, version: str | None = None) -> Response:
    """TorchServe's description (a list of one): this worker's view, as each worker answers for itself."""
    plane = current.plane()
    target = model_names.resolve(plane.served, name)
    _check_version(name, None if version == "all" else version)
    return current.json_response([description(plane, name, target.model)])


def description(plane: DataPlane, name: str, model: str | None = None) -> dict[str, Any]:
    """``pendingRequests`` counts images (greenserve admits and batches images, TorchServe requests)."""
    s = plane.settings
    info = plane.info_of(model)
    admitted = plane.runner.admitted()
    return {"modelName": name, "modelVersion": MODEL_VERSION, "modelUrl": info.weights if info else s.weights,
            "engine": "greenserve", "runtime": "python", "minWorkers": s.workers, "maxWorkers": s.workers,
            "batchSize": s.max_batch, "maxBatchDelay": s.max_batch_wait_ms, "responseTimeout": s.request_timeout_s,
            "loadedAtStartup": True, "workers": [_worker(plane, model)],
            "jobQueueStatus": {"remainingCapacity": max(0, s.max_queue_images - admitted),
                               "pendingRequests": admitted}}


def _worker(plane: DataPlane, model: str | None = None) -> dict[str, Any]:
    info = plane.info_of(model)
    status = "READY" if info else "FAILED" if plane.runner.engine(model).load_error else "STARTING"
    device = info.device if info else plane.settings.device
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB: the peak, in bytes
    return {"id": str(os.getpid()), "startTime": STARTED, "status": status, "memoryUsage": peak_rss,
            "pid": os.getpid(), "gpu": device.startswith("cuda"), "gpuUsage": "N/A"}


@bp.route("/models", methods=WRITE_METHODS)
@bp.route("/models/<path:rest>", methods=WRITE_METHODS)
def manage(rest: str = "") -> Response:
    """Registering, scaling and unregistering are TorchServe's, not greenserve's: one model per server."""
    raise MethodNotAllowed("the management API is read-only here: greenserve serves one model, chosen with "
                           "GREENSERVE_MODEL and GREENSERVE_WEIGHTS, on GREENSERVE_WORKERS workers; change "
                           "those and restart", headers={"Allow": "GET, HEAD"})
