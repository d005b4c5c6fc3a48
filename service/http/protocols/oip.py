"""Open Inference Protocol v2 (Triton HTTP, KServe v2, OpenVINO Model Server, MLServer clients):
health, server/model metadata, Triton's model config, and ``infer`` through the shared request path.

Health follows what every client can read: 200 with ``{"live"|"ready": true}`` bodies (kserve's client
parses them; tritonclient reads only the status), and 503 while this worker's model loads (Triton says
400, which k8s probes treat the same). ``error`` in every error body is the message string: tritonclient
reads ``body["error"]`` as one. Content-Type is ignored on ``infer`` (tritonclient sends none, ``curl -d``
sends a form type), so the body is never parsed as a form.
"""

from __future__ import annotations

import gzip
import os
import re
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version

import orjson
from flask import Blueprint, Response, request

from service import metrics
from service.engine.types import ModelInfo
from service.errors import NotFound, Overloaded
from service.http import current, model_names
from service.http.body import read as read_body
from service.http.dataplane import DataPlane
from service.http.protocols import oip_stats
from service.http.protocols import oip_wire as wire
from service.http.protocols.surface import Surface, flat_error_body

bp = Blueprint("oip", __name__)
SURFACE = Surface("oip", re.compile(r"^/v2(/|$)"),
                  re.compile(r"^/v2/?$|^/v2/health/(live|ready)$|^/v2/models/[^/]+(/versions/[^/]+)?/ready$"),
                  flat_error_body)
EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration", "parameters", "statistics"]
VERSION = "1"  # one model, one version: /versions/1 is accepted, any other is 404
_MODEL = "/v2/models/<name>"
_VERSIONED = "/v2/models/<name>/versions/<version>"


def _package_version() -> str:
    try:
        return version("greenserve")
    except PackageNotFoundError:
        return "0"


@bp.get("/v2")
@bp.get("/v2/")
def server_metadata() -> Response:
    return current.json_response({"name": "greenserve", "version": _package_version(), "extensions": EXTENSIONS})


@bp.get("/v2/health/live")
def live() -> Response:
    return current.json_response({"live": True})


@bp.get("/v2/health/ready")
def ready() -> Response:
    plane = current.plane()
    if plane.runner.ready:
        return current.json_response({"ready": True})
    return current.json_response({"ready": False, "error": plane.not_ready_reason()}, 503)


@bp.get("/v2/models")
def models() -> Response:
    """KServe's list: the model names (readiness is /v2/models/<m>/ready)."""
    return current.json_response({"models": list(current.plane().served)})


@bp.post("/v2/repository/index")
def repository_index() -> Response:
    """Every served model and its state on this worker."""
    states = {"ready": "READY", "loading": "LOADING", "failed": "UNAVAILABLE", "unloaded": "UNAVAILABLE"}
    return current.json_response([{"name": name, "version": VERSION, "state": states[state]}
                                  for name, (_, _, state) in current.plane().states().items()])


@bp.post("/v2/repository/models/<name>/load")
def repository_load(name: str) -> Response:
    """Serve a configured model again on every worker (its towers back in memory); 200 once all do."""
    return _repository(name, serve=True)


@bp.post("/v2/repository/models/<name>/unload")
def repository_unload(name: str) -> Response:
    """Stop serving a model on every worker and give its memory back; 200 once all have."""
    return _repository(name, serve=False)


def _repository(name: str, *, serve: bool) -> Response:
    plane = current.plane()
    _check_model(plane, name, None)
    read_body()  # Triton's optional parameters (a config to load with) are not offered: the model is configured
    assert plane.repository is not None
    if not plane.repository.set(name, serve, REPOSITORY_TIMEOUT_S):
        raise Overloaded(f"not every worker has {'loaded' if serve else 'unloaded'} {name!r} within "
                         f"{REPOSITORY_TIMEOUT_S:.0f}s; ask again to wait on", retry_after_s=5, code="not_ready")
    return current.json_response({})


@bp.get(_MODEL + "/ready")
@bp.get(_VERSIONED + "/ready")
def model_ready(name: str, version: str | None = None) -> Response:
    plane = current.plane()
    _check_model(plane, name, version)
    ok = plane.info_of(name) is not None
    return current.json_response({"name": name, "ready": ok, **({} if ok else {"error": plane.not_ready_reason(name)})},
                                 200 if ok else 503)


@bp.get(_MODEL)
@bp.get(_VERSIONED)
def model_metadata(name: str, version: str | None = None) -> Response:
    plane = current.plane()
    _check_model(plane, name, version)
    info = plane.require_info(name)
    outputs = [{"name": n, "datatype": "FP32", "shape": [-1, dim]} for n, dim in _outputs(info)]
    return current.json_response({"name": name, "versions": [VERSION], "platform": _platform(info),
                                  "inputs": [{"name": wire.INPUT, "datatype": "BYTES", "shape": [-1, 1]}],
                                  "outputs": outputs})


@bp.get(_MODEL + "/config")
@bp.get(_VERSIONED + "/config")
def model_config(name: str, version: str | None = None) -> Response:
    """The JSON form of Triton's ModelConfig, for clients that size their batches from it."""
    plane = current.plane()
    _check_model(plane, name, version)
    info = plane.require_info(name)
    s = plane.settings
    outputs = [{"name": n, "data_type": "TYPE_FP32", "dims": [dim], "label_filename": ""} for n, dim in _outputs(info)]
    return current.json_response({
        "name": name, "platform": _platform(info), "backend": "greenserve", "max_batch_size": s.max_images,
        "input": [{"name": wire.INPUT, "data_type": "TYPE_STRING", "format": "FORMAT_NONE", "dims": [1]}],
        "output": outputs,
        "dynamic_batching": {"max_queue_delay_microseconds": int(s.max_batch_wait_ms * 1000),
                             "preferred_batch_size": [s.max_batch]},
        "version_policy": {"latest": {"num_versions": 1}}})


@bp.get("/v2/models/stats")
@bp.get(_MODEL + "/stats")
@bp.get(_VERSIONED + "/stats")
def statistics(name: str | None = None, version: str | None = None) -> Response:
    """Triton's inference statistics (``/v2/models/stats``: every model). The counters are the server's, not yet
    counted per model: each model's entry reads them all."""
    plane = current.plane()
    if name is not None:
        _check_model(plane, name, version)
    samples = metrics.samples()
    return current.json_response({"model_stats": [oip_stats.model_stats(samples, model, VERSION)
                                                  for model in ([name] if name else plane.served)]})


@bp.post(_MODEL + "/infer")
@bp.post(_VERSIONED + "/infer")
def infer(name: str, version: str | None = None) -> Response:
    with current.busy() as plane:
        _check_model(plane, name, version)
        info = plane.require_info(name)
        call = _parse(plane, [n for n, _ in _outputs(info)])
        rows = current.run_rows(replace(call.request, model=name), call.tasks, timeout_s=call.timeout_s)
    outputs, chunks = wire.encode_outputs(call, rows.rows, rows.info.labels)
    doc = {"model_name": name, "model_version": VERSION, **({"id": call.id} if call.id is not None else {}),
           "parameters": {"request_id": current.context().request_id, "worker_pid": os.getpid()}, "outputs": outputs}
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return _compressed(head, "application/json", {})
    return _compressed(head + b"".join(chunks), "application/octet-stream", {wire.HEADER: str(len(head))})


def _parse(plane: DataPlane, available: list[str]) -> wire.InferCall:
    body = read_body(bad_code="invalid_tensor")
    return plane.parse_body(body, wire.parse_request, request.headers.get(wire.HEADER), plane.settings, available)


def _compressed(body: bytes, mimetype: str, headers: dict[str, str]) -> Response:
    """gzip the answer when the client asked (tritonclient's response_compression_algorithm)."""
    accepted = request.headers.get("Accept-Encoding", "").lower()
    if "gzip" in accepted and len(body) > 1024:
        body = gzip.compress(body, compresslevel=1)
        headers = {**headers, "Content-Encoding": "gzip"}
    return Response(body, headers=headers, mimetype=mimetype)


REPOSITORY_TIMEOUT_S = 120.0  # a load of every worker's towers (the first load of a CLIP takes ~10 s on 2 cores)


def _check_model(plane: DataPlane, name: str, version: str | None) -> None:
    model_names.resolve_plain(plane.served, name)
    if version not in (None, VERSION):
        raise NotFound(f"Request for unknown model version: {name!r} version {version!r}; the only version is "
                       f"{VERSION}", code="model_not_found")


def _outputs(info: ModelInfo) -> list[tuple[str, int]]:
    """The model's output tensors and their widths: what its tasks can give from one forward."""
    out = []
    if "embeddings" in info.tasks and info.embedding_dim:
        out.append((wire.EMBEDDING, info.embedding_dim))
    if info.labels:
        out.append((wire.PROBABILITIES, len(info.labels)))
    return out


def _platform(info: ModelInfo) -> str:
    return "pytorch_torchscript" if info.format == "torchscript" else f"pytorch_{info.family}"
