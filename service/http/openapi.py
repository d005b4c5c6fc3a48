"""The native API's OpenAPI 3.1 document, served at ``/openapi.json``.

Built from the code, for this server's settings: the request bodies from the parsers' field lists and
limits (``openapi_schemas.py``), the bearer requirement and its 401 from ``protocols.needs_token``
when ``GREENSERVE_API_TOKEN`` is set. ``tests/unit/http/test_openapi.py`` checks the paths against the app's url rules
and real responses against the schemas; ``tests/e2e/test_e2e_fuzz.py`` fuzzes a real server with schemathesis.
The protocols' own routes (OIP v2, KServe v1, TorchServe) are described by their own specifications.
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

import orjson
from flask import Blueprint, Response

from service.engine.types import ModelInfo
from service.http import current, model_names, protocols
from service.http.openapi_schemas import TASKS, Schema, ref, request_schemas, response_schemas
from service.settings import Settings

OPENAPI_VERSION = "3.1.0"
# what an inference request can be answered with besides 200: every status of the error tree that a
# parsed request reaches (404: a model its body names is not served; 401 is added with a token; 405 is
# routing's)
INFERENCE_STATUSES = (400, 404, 408, 413, 415, 422, 429, 499, 500, 503, 504)
STATUS_TEXT = {
    400: "the request is malformed or asks for what the model cannot do (see error.code)",
    401: "missing or wrong bearer token (Authorization: Bearer <GREENSERVE_API_TOKEN>)",
    404: "no such model",
    408: "the body did not arrive whole within GREENSERVE_BODY_TIMEOUT_S; the connection is closed",
    413: "the body, an image, a text or the number of images/texts/labels is over its limit",
    415: "the Content-Type, or every failing image's format, is not accepted",
    422: "images could not be used (fetch failed, not an image...): error.details has one item per image",
    429: "this caller has its share of the worker's queue (GREENSERVE_MAX_CALLER_IMAGES): retry after "
         "Retry-After seconds (the server may have room for others: that would be 503)",
    499: "the client disconnected; its remaining work was stopped (logged, never read by anyone)",
    500: "internal error or the model failed on the batch; the request id is in the log line",
    503: "the worker is overloaded or its model is still loading: retry after Retry-After seconds",
    504: "the request deadline (GREENSERVE_REQUEST_TIMEOUT_S or X-Request-Timeout) passed",
}
_SUMMARIES = {
    "embeddings": "Image embeddings (images), text embeddings (texts, CLIP) or OpenAI's {model, input}",
    "classify": "Top-k labels per image: the model's classes, or zero-shot labels (CLIP)",
    "rank": "The images ordered by cosine to a text query, best first (CLIP)",
}
_HEADERS: dict[str, Schema] = {
    "X-Request-ID": {"description": "the request's id: the caller's X-Request-ID when it is a safe token, "
                                    "else a fresh one", "required": True,
                     "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"}},
    "X-Worker-PID": {"description": "the worker process that answered", "required": True,
                     "schema": {"type": "string", "pattern": "^[0-9]+$"}},
    "Server-Timing": {"description": "time inside the app", "required": True,
                      "schema": {"type": "string", "pattern": r"^app;dur=[0-9]+\.[0-9]$"}},
    "Retry-After": {"description": "seconds to wait before retrying", "required": True,
                    "schema": {"type": "string", "pattern": "^[0-9]+$"}},
}
_PARAMETERS: dict[str, Schema] = {
    "RequestId": {"name": "X-Request-ID", "in": "header", "required": False,
                  "description": "echoed in the X-Request-ID response header and the body's request_id",
                  "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"}},
    "RequestTimeout": {"name": "X-Request-Timeout", "in": "header", "required": False,
                       "description": "seconds; shortens the deadline of GREENSERVE_REQUEST_TIMEOUT_S (504 once past)",
                       "schema": {"type": "number", "exclusiveMinimum": 0}},
}

bp = Blueprint("openapi", __name__)


@bp.get("/openapi.json")
def document() -> Response:
    plane = current.plane()
    return Response(_encoded(plane.settings, plane.info, plane.model_name), mimetype="application/json")


@functools.lru_cache(maxsize=8)
def _encoded(settings: Settings, info: ModelInfo | None, model: str) -> bytes:
    return orjson.dumps(build(settings, info, model))


def build(settings: Settings, info: ModelInfo | None = None, model: str | None = None) -> dict[str, Any]:
    """The document for a server running with ``settings``, whose default model is served as ``model`` (its
    facts ``info``, None while it loads)."""
    model = model or model_names.served_name(info, settings.model)  # the name requests must use
    dim = info.embedding_dim if info else None
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "greenserve native API", "version": _version(),
                 "description": "Image embeddings, classification and ranking over REST. Errors are "
                                "{error: {code, message, details, type, param}, request_id}; every response "
                                "carries X-Request-ID. Bodies over GREENSERVE_MAX_BODY_BYTES "
                                f"({settings.max_body_bytes} bytes) are refused with 413; other methods on these "
                                "paths are 405."},
        "paths": _paths(settings),
        "components": {"schemas": {**request_schemas(settings, model_names.names(model), dim), **response_schemas()},
                       "headers": _HEADERS, "parameters": _parameters(model)},
    }
    if settings.api_token:
        doc["components"]["securitySchemes"] = {"bearer": {
            "type": "http", "scheme": "bearer", "description": "GREENSERVE_API_TOKEN"}}
    return doc


def _parameters(model: str) -> dict[str, Schema]:
    name = {"name": "name", "in": "path", "required": True,
            "description": "the served model's name (its classes) or <name>-embedding, else 404; a name ending "
                           "in :predict is KServe v1's path",
            "schema": {"type": "string", "pattern": "^(?!.*:predict$)[^/]+$", "examples": model_names.names(model)}}
    return {**_PARAMETERS, "ModelName": name}


def _version() -> str:
    try:
        return metadata.version("greenserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


def _paths(settings: Settings) -> dict[str, Any]:
    paths: dict[str, Any] = {f"/v1/{task}": {"post": _inference(task)} for task in TASKS}
    paths |= {
        "/v1/models": {"get": _operation("models", "The served model: native (data[0]), OpenAI (data[].id), "
                                                   "KServe v1 (models)", {
            200: _json("the model is ready", ref("ModelList")),
            503: _json("the model is loading", ref("ModelListLoading"))})},
        "/v1/models/{name}": {"get": _operation("model", "One model by name (OpenAI retrieve, KServe v1 readiness)", {
            200: _json("the model is ready", ref("Model")), 404: _error(404),
            503: _json("the model is loading", ref("ModelLoading"))}, parameters=("RequestId", "ModelName"))},
        "/healthz": {"get": _operation("healthz", "Liveness: 200 while the worker's hub answers", {
            200: _json("alive", ref("Health"))})},
        "/readyz": {"get": _operation("readyz", "Readiness: 200 once this worker's model is loaded and warm", {
            200: _json("ready", ref("Ready")), 503: _json("loading, or failed to load", ref("NotReady"))})},
        "/metrics": {"get": _operation("metrics", "Prometheus metrics, all workers together", {
            200: _response("Prometheus text exposition", {"text/plain": {"schema": {"type": "string"}}})})},
        "/openapi.json": {"get": _operation("openapi", "This document", {
            200: _json("the OpenAPI document", ref("OpenAPI"))})},
    }
    if settings.api_token:
        for path, item in paths.items():
            if protocols.needs_token(path.replace("{name}", "m")):  # the /v1/ routes; never the probes
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
                    operation["responses"]["401"] = _error(401)
    return paths


def _inference(task: str) -> dict[str, Any]:
    name = task.capitalize()
    errors = {status: _error(status, retry_after=status in (429, 503)) for status in INFERENCE_STATUSES}
    body = {"required": True, "content": {
        "application/json": {"schema": ref(f"{name}Request")},
        "multipart/form-data": {"schema": ref(f"{name}Form"),
                                "encoding": {"images": {"contentType": "application/octet-stream"}}}}}
    ok = _json("results, in request order; streamed (Accept: application/x-ndjson or text/event-stream): a line "
               "per image as it is ready, then a last line with the rest (docs/PROTOCOLS.md)", ref(f"{name}Response"))
    ok["content"] |= {media: {"schema": {"type": "string"}} for media in ("application/x-ndjson", "text/event-stream")}
    return _operation(task, _SUMMARIES[task], {200: ok, **errors},
                      parameters=("RequestId", "RequestTimeout"), requestBody=body)


def _operation(operation_id: str, summary: str, responses: dict[int, Schema], *,
               parameters: tuple[str, ...] = ("RequestId",), **extra: Any) -> dict[str, Any]:
    if 500 not in responses:
        responses = {**responses, 500: _error(500)}
    return {"operationId": operation_id, "summary": summary,
            "parameters": [{"$ref": f"#/components/parameters/{p}"} for p in parameters],
            "responses": {str(status): responses[status] for status in sorted(responses)}, **extra}


def _error(status: int, *, retry_after: bool = False) -> Schema:
    headers = ("Retry-After",) if retry_after else ()
    return _json(STATUS_TEXT[status], ref("Error"), headers)


def _json(description: str, schema: Schema, headers: tuple[str, ...] = ()) -> Schema:
    return _response(description, {"application/json": {"schema": schema}}, headers)


def _response(description: str, content: dict[str, Any], headers: tuple[str, ...] = ()) -> Schema:
    names = ("X-Request-ID", "X-Worker-PID", "Server-Timing", *headers)
    return {"description": description, "content": content,
            "headers": {n: {"$ref": f"#/components/headers/{n}"} for n in names}}
