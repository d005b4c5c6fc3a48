"""HTTP routes: parse → orchestrate → JSON. One error handler turns every failure into the error shape.

Views have no ``try``: the pipeline raises ``GreenserveError`` subclasses and ``handle_error`` maps them.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import time
import uuid
from typing import Any

import orjson
from flask import Blueprint, Flask, Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from service import logs, metrics, openapi, protocols, serving
from service.engine.model import ModelInfo
from service.errors import ClientGone, GreenserveError, RequestError, Unauthorized, UnsupportedMediaType, from_http_status
from service.pipeline.inputs import InferenceRequest, check_part_names, parse_doc, parse_form
from service.pipeline.json_body import load_json
from service.protocols import openai
from service.settings import Settings

log = logging.getLogger(__name__)
bp = Blueprint("api", __name__)

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

# ---------------------------------------------------------------------- request lifecycle


@bp.before_app_request
def _start() -> None:
    g.started = time.monotonic()
    rid = request.headers.get("X-Request-ID", "")
    g.request_id = rid if _REQUEST_ID_RE.match(rid) else uuid.uuid4().hex
    settings = current_app.extensions["greenserve"]["settings"]
    if settings.api_token and protocols.needs_token(request.path):
        scheme, _, supplied = request.headers.get("Authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110); a bare token with no scheme is not a bearer token
        if scheme.lower() != "bearer" or not hmac.compare_digest(supplied.strip().encode(),
                                                                 settings.api_token.encode()):
            raise Unauthorized("missing or wrong bearer token; send Authorization: Bearer <GREENSERVE_API_TOKEN>")
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity") and not request.path.startswith("/v2/"):  # OIP inflates its own
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not accepted here; send the body "
                                   "uncompressed (OIP v2 infer takes gzip and deflate)",
                                   code="unsupported_content_encoding")


@bp.after_app_request
def _finish(response: Response) -> Response:
    route = request.url_rule.rule if request.url_rule else "unmatched"
    metrics.REQUESTS.labels(route, str(response.status_code)).inc()
    response.headers["X-Request-ID"] = g.get("request_id", "")
    response.headers["X-Worker-PID"] = str(os.getpid())  # which worker answered: for balance diagnostics
    if "started" in g:  # time inside the app (parsing to JSON), for telling server time from network time
        response.headers["Server-Timing"] = f"app;dur={(time.monotonic() - g.started) * 1000:.1f}"
    if current_app.extensions["greenserve"]["settings"].log_format == "json":  # text: gunicorn's access log
        logs.access({"request_id": g.get("request_id", ""), "method": request.method, "route": route,
                     "path": request.path, "status": response.status_code, "images": g.get("images", 0),
                     "timings_ms": g.get("timings_ms", {}), "worker_pid": os.getpid(),
                     "bytes_in": request.content_length or 0, "bytes_out": response.content_length or 0,
                     "duration_ms": round((time.monotonic() - g.get("started", time.monotonic())) * 1000, 1),
                     "remote_addr": request.remote_addr})
    return response


@bp.app_errorhandler(GreenserveError)
def handle_error(err: GreenserveError) -> Response:
    fields = {"request_id": g.get("request_id"), "code": err.code}  # the JSON line's own fields
    if isinstance(err, ClientGone):
        log.info("request_id=%s %s: its remaining work was stopped", g.get("request_id"), err.code, extra=fields)
    elif err.status_code >= 500 and not err.headers:
        log.error("request_id=%s %s: %s", g.get("request_id"), err.code, err.message, extra=fields)
    return error_response(err.status_code, err.to_dict(), err.headers)


@bp.app_errorhandler(HTTPException)
def handle_http(exc: HTTPException) -> Response:
    status = exc.code or 500
    message = exc.description or exc.name
    if status == 413:
        limit = current_app.extensions["greenserve"]["settings"].max_body_bytes
        message = f"the request body exceeds {limit} bytes; send fewer/smaller images or set GREENSERVE_MAX_BODY_BYTES"
        if request.content_length is not None and request.content_length <= limit:  # werkzeug's part count
            message = (f"the form has more than {current_app.config['MAX_FORM_PARTS']} parts; send fewer images "
                       "or labels per request (GREENSERVE_MAX_IMAGES, GREENSERVE_MAX_LABELS)")
    err = from_http_status(status, message)
    return error_response(err.status_code, err.to_dict(), {})


@bp.app_errorhandler(Exception)
def handle_unexpected(exc: Exception) -> Response:
    log.exception("request_id=%s unhandled error", g.get("request_id"),
                  extra={"request_id": g.get("request_id"), "code": "internal_error"})
    return error_response(500, {"code": "internal_error", "message": "internal error; report the request id",
                                "details": []}, {})


def error_response(status: int, error: dict[str, Any], headers: dict[str, str]) -> Response:
    """The error in the shape of the protocol that owns the path (routing errors included)."""
    metrics.ERRORS.labels(error["code"]).inc()
    body = protocols.error_body(request.path, status, error, g.get("request_id", ""))
    if error["code"] == "inference_failed":
        headers = {**headers, "x-should-retry": "false"}  # deterministic: the OpenAI SDK would retry a 500
    return Response(orjson.dumps(body), status=status, headers=headers, mimetype="application/json")


# ---------------------------------------------------------------------- inference


@bp.post("/v1/embeddings")
def embeddings() -> Response:
    """Native ``{"images"|"texts": [...]}`` or OpenAI ``{"model", "input"}``: one response shape for both."""
    with serving.busy() as p:
        req, options = _parse_request(p, "embeddings", openai_too=True)
        body = serving.run(p, req, "embeddings")
    return serving.json_response(openai.embeddings_body(body, req, options))


@bp.post("/v1/classify")
def classify() -> Response:
    return _infer("classify")


@bp.post("/v1/rank")
def rank() -> Response:
    """Images ordered by their similarity to a text ``query``: an album searched with a sentence."""
    return _infer("rank")


def _infer(task: str) -> Response:
    with serving.busy() as p:
        req, _ = _parse_request(p, task)
        return serving.json_response(serving.run(p, req, task))


def _parse_request(p: serving.Parts, task: str, openai_too: bool = False
                   ) -> tuple[InferenceRequest, openai.Options | None]:
    settings = p.settings
    mimetype = request.mimetype
    if mimetype == "multipart/form-data":
        check_part_names([*request.files, *request.form])
        files = [(f.filename or "", f.read(settings.max_image_bytes + 1)) for f in request.files.getlist("images")]
        unexpected = sorted(set(request.files) - {"images"})
        if unexpected:
            raise RequestError(f"files in unknown field(s) {', '.join(unexpected)}; use the field 'images'")
        fields = {k: v for k, v in request.form.to_dict().items() if k != "labels"}
        return parse_form(fields, files, settings, task, labels=request.form.getlist("labels")), None
    if mimetype in ("application/json", "") or mimetype.endswith("+json"):
        return serving.parse_body(p, request.get_data(cache=False), _parse_json, settings, task,
                                  openai_too, p.runner.info, serving.model_name(p))
    raise UnsupportedMediaType(f"Content-Type {mimetype!r} is not accepted; send application/json or "
                               "multipart/form-data")


def _parse_json(raw: bytes, settings: Settings, task: str, openai_too: bool, info: ModelInfo | None,
                name: str) -> tuple[InferenceRequest, openai.Options | None]:
    """The native JSON body, or (on /v1/embeddings) OpenAI's ``{"model", "input"}``."""
    doc = load_json(raw, '{"images": ["https://.../a.jpg"]}')
    if openai_too and openai.is_openai(doc):
        return openai.parse(doc, settings, info, name)
    return parse_doc(doc, settings, task), None


# ---------------------------------------------------------------------- info and probes


@bp.get("/v1/models")
def models() -> Response:
    """Native (``data[0]`` is the model's description), OpenAI (``data[].id``) and KServe v1 (``models``)."""
    runner = serving.parts().runner
    if runner.info is None:
        return _json({"object": "list", "data": [], "models": [], "status": "loading"}, 503)
    return _json(openai.models_body(runner.info))


@bp.get("/v1/models/<name>")
def model(name: str) -> Response:
    """OpenAI's model retrieve and KServe v1's model readiness (``ready``; 503 while loading)."""
    p = serving.parts()
    serving.resolve_model(p, name)
    info = p.runner.info
    if info is None:
        return _json({"id": name, "name": name, "object": "model", "ready": False, "error": "model loading"}, 503)
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
    runner = serving.parts().runner
    if runner.info is not None:
        return _json({"status": "ready", "pid": os.getpid(), "model": runner.info.name})
    return _json({"status": "not_ready", "pid": os.getpid(), "reason": serving.not_ready_reason(runner)}, 503)


def _json(body: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(body), status=status, mimetype="application/json")


def register(app: Flask) -> None:
    app.register_blueprint(bp)
    for blueprint in (*protocols.BLUEPRINTS, openapi.bp):
        app.register_blueprint(blueprint)
    # werkzeug refuses larger bodies with 413 before the view reads them
    app.config["MAX_CONTENT_LENGTH"] = app.extensions["greenserve"]["settings"].max_body_bytes
    app.config["MAX_FORM_MEMORY_SIZE"] = app.config["MAX_CONTENT_LENGTH"]
    settings = app.extensions["greenserve"]["settings"]
    # werkzeug's default of 1,000 form parts would refuse a form within the image and label limits
    app.config["MAX_FORM_PARTS"] = settings.max_images + settings.max_labels + 16

