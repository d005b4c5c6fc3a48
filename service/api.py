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

from service import metrics
from service.balance.gate import Balance
from service.connection import cancel_on_hang_up
from service.engine.runner import Runner
from service.errors import ClientGone, GreenserveError, RequestError, Unauthorized, UnsupportedMediaType, from_http_status
from service.pipeline.inputs import InferenceRequest, parse_form, parse_json
from service.pipeline.orchestrate import Orchestrator
from service.settings import Settings

log = logging.getLogger(__name__)
bp = Blueprint("api", __name__)

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
OFFLOAD_JSON_BYTES = 256 * 1024  # bodies above this are parsed in a decode thread, not on the hub

def parts() -> tuple[Settings, Runner, Orchestrator]:
    ext = current_app.extensions["greenserve"]
    return ext["settings"], ext["runner"], ext["orchestrator"]


# ---------------------------------------------------------------------- request lifecycle


@bp.before_app_request
def _start() -> None:
    g.started = time.monotonic()
    rid = request.headers.get("X-Request-ID", "")
    g.request_id = rid if _REQUEST_ID_RE.match(rid) else uuid.uuid4().hex
    settings = current_app.extensions["greenserve"]["settings"]
    if settings.api_token and request.path.startswith("/v1/"):
        supplied = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(supplied.encode(), settings.api_token.encode()):
            raise Unauthorized("missing or wrong bearer token; send Authorization: Bearer <GREENSERVE_API_TOKEN>")


@bp.after_app_request
def _finish(response: Response) -> Response:
    route = request.url_rule.rule if request.url_rule else "unmatched"
    metrics.REQUESTS.labels(route, str(response.status_code)).inc()
    response.headers["X-Request-ID"] = g.get("request_id", "")
    response.headers["X-Worker-PID"] = str(os.getpid())  # which worker answered: for balance diagnostics
    if "started" in g:  # time inside the app (parsing to JSON), for telling server time from network time
        response.headers["Server-Timing"] = f"app;dur={(time.monotonic() - g.started) * 1000:.1f}"
    return response


@bp.app_errorhandler(GreenserveError)
def handle_error(err: GreenserveError) -> Response:
    if isinstance(err, ClientGone):
        log.info("request_id=%s %s: its remaining work was stopped", g.get("request_id"), err.code)
    elif err.status_code >= 500 and not err.headers:
        log.error("request_id=%s %s: %s", g.get("request_id"), err.code, err.message)
    return error_response(err.status_code, err.to_dict(), err.headers)


@bp.app_errorhandler(HTTPException)
def handle_http(exc: HTTPException) -> Response:
    status = exc.code or 500
    message = exc.description or exc.name
    if status == 413:
        limit = current_app.extensions["greenserve"]["settings"].max_body_bytes
        message = f"the request body exceeds {limit} bytes; send fewer/smaller images or set GREENSERVE_MAX_BODY_BYTES"
    err = from_http_status(status, message)
    return error_response(err.status_code, err.to_dict(), {})


@bp.app_errorhandler(Exception)
def handle_unexpected(exc: Exception) -> Response:
    log.exception("request_id=%s unhandled error", g.get("request_id"))
    return error_response(500, {"code": "internal_error", "message": "internal error; report the request id",
                                "details": []}, {})


def error_response(status: int, error: dict[str, Any], headers: dict[str, str]) -> Response:
    metrics.ERRORS.labels(error["code"]).inc()
    body = orjson.dumps({"error": error, "request_id": g.get("request_id", "")})
    return Response(body, status=status, headers=headers, mimetype="application/json")


# ---------------------------------------------------------------------- inference


@bp.post("/v1/embeddings")
def embeddings() -> Response:
    return _infer("embeddings")


@bp.post("/v1/classify")
def classify() -> Response:
    return _infer("classify")


@bp.post("/v1/rank")
def rank() -> Response:
    """Images ordered by their similarity to a text ``query``: an album searched with a sentence."""
    return _infer("rank")


def _infer(task: str) -> Response:
    balance: Balance = current_app.extensions["greenserve"]["balance"]
    with balance.inference():  # siblings see this worker as busy from here (parsing included)
        return _run(task)


def _run(task: str) -> Response:
    settings, runner, orchestrator = parts()
    req = _parse_request(settings, runner, task)
    _check_task(runner, req, task)
    deadline = _deadline(settings)
    with cancel_on_hang_up(request.environ.get("gunicorn.socket") if settings.cancel_on_disconnect else None):
        body = orchestrator.run(req, task, deadline=deadline, request_id=g.request_id)
    for stage, ms in body["timings_ms"].items():
        metrics.STAGE_SECONDS.labels(stage).observe(ms / 1000)
    body = {"model": runner.info.name if runner.info else "", **body, "request_id": g.request_id}
    # orjson, on the hub: 1.2 ms for 30 x 2,048 float32 arrays (lists of Python floats: 2.0 ms; json.dumps of
    # those lists took 37 ms and had to be offloaded)
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), mimetype="application/json")


def _check_task(runner: Runner, req: InferenceRequest, task: str) -> None:
    """What the loaded model cannot do is refused before any work (while it loads, admission says 503)."""
    info = runner.info
    if info is None:
        return
    if task not in info.tasks:
        raise RequestError(f"the loaded model does not provide {task}; it provides {', '.join(info.tasks)}",
                           code="task_not_supported")
    if (req.text.texts or req.text.prompts) and "text" not in info.towers:
        raise RequestError(f"{info.name} has no text tower, so it cannot embed texts or labels; serve an "
                           "open_clip model (GREENSERVE_MODEL=open_clip:ViT-B-32) for text", code="text_not_supported"
                           if req.text.texts else "labels_not_supported")
    if task == "classify" and not info.labels and not req.text.labels:
        raise RequestError(f'{info.name} has no fixed classes: send the candidate "labels" (and optionally a '
                           f'"template" such as "a photo of a {{}}.")', code="labels_required")
    if task == "classify" and info.labels and req.text.labels:
        raise RequestError(f"{info.name} classifies into its own {len(info.labels)} labels; drop \"labels\" or "
                           "serve an open_clip model for zero-shot labels", code="labels_not_supported")


def _parse_request(settings: Settings, runner: Runner, task: str) -> InferenceRequest:
    mimetype = request.mimetype
    if mimetype == "multipart/form-data":
        files = [(f.filename or "", f.read(settings.max_image_bytes + 1)) for f in request.files.getlist("images")]
        unexpected = sorted(set(request.files) - {"images"})
        if unexpected:
            raise RequestError(f"files in unknown field(s) {', '.join(unexpected)}; use the field 'images'")
        fields = {k: v for k, v in request.form.to_dict().items() if k != "labels"}
        return parse_form(fields, files, settings, task, labels=request.form.getlist("labels"))
    if mimetype in ("application/json", "") or mimetype.endswith("+json"):
        raw = request.get_data(cache=False)
        if len(raw) > OFFLOAD_JSON_BYTES:
            return runner.offload(parse_json, raw, settings, task)
        return parse_json(raw, settings, task)
    raise UnsupportedMediaType(f"Content-Type {mimetype!r} is not accepted; send application/json or "
                               "multipart/form-data")


def _deadline(settings: Settings) -> float:
    timeout = settings.request_timeout_s
    header = request.headers.get("X-Request-Timeout")
    if header:
        try:
            asked = float(header)
        except ValueError:
            raise RequestError(f"X-Request-Timeout={header!r} is not a number of seconds") from None
        if not asked > 0:
            raise RequestError("X-Request-Timeout must be a positive number of seconds")
        timeout = min(timeout, asked)
    return g.started + timeout


# ---------------------------------------------------------------------- info and probes


@bp.get("/v1/models")
def models() -> Response:
    _, runner, _ = parts()
    if runner.info is None:
        return _json({"data": [], "status": "loading"}, 503)
    return _json({"data": [runner.info.public()]})


@bp.get("/metrics")
def prometheus() -> Response:
    text, content_type = metrics.exposition()
    return Response(text, content_type=content_type)


@bp.get("/healthz")
def healthz() -> Response:
    return _json({"status": "ok", "pid": os.getpid()})


@bp.get("/readyz")
def readyz() -> Response:
    _, runner, _ = parts()
    if runner.info is not None:
        return _json({"status": "ready", "pid": os.getpid(), "model": runner.info.name})
    reason = f"model failed to load: {runner.load_error}" if runner.load_error else "model loading"
    return _json({"status": "not_ready", "pid": os.getpid(), "reason": reason}, 503)


def _json(body: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(body), status=status, mimetype="application/json")


def register(app: Flask) -> None:
    app.register_blueprint(bp)
    # werkzeug refuses larger bodies with 413 before the view reads them
    app.config["MAX_CONTENT_LENGTH"] = app.extensions["greenserve"]["settings"].max_body_bytes
    app.config["MAX_FORM_MEMORY_SIZE"] = app.config["MAX_CONTENT_LENGTH"]

