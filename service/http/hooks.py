"""Around every request: the request id, the token, the timing headers, the answer's send bound and the
access line; one error handler turns every failure into the error shape of the protocol that owns the path.

Views have no ``try``: the pipeline raises ``GreenserveError`` subclasses and ``handle_error`` maps them.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import time
from typing import Any

import orjson
from flask import Blueprint, Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from service import logs, metrics
from service.errors import ClientGone, GreenserveError, RequestError, Unauthorized, from_http_status
from service.http import current, protocols, streaming
from service.http.connection import SendBound
from service.http.context import RequestContext

log = logging.getLogger(__name__)
bp = Blueprint("hooks", __name__)
_CONTEXT_HEADERS = ("X-Request-ID", "X-Request-Timeout", "Authorization", "X-Client-ID", "X-Real-IP", "X-Forwarded-For",
                    "Cache-Control", "Priority")

# ---------------------------------------------------------------------- request lifecycle


@bp.before_app_request
def _start() -> None:
    plane = current.plane()
    headers = {k: request.headers[k] for k in _CONTEXT_HEADERS if k in request.headers}
    g.context = RequestContext.begin(headers, request.environ.get("gunicorn.socket"), time.monotonic(),
                                     remote_addr=request.remote_addr, who=plane.identities)
    tokens = [t.strip().encode() for t in plane.settings.api_token.split(",") if t.strip()]
    if tokens and protocols.needs_token(request.path):
        scheme, _, supplied = request.headers.get("Authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110); a bare token with no scheme is not a bearer token
        given = supplied.strip().encode()
        if scheme.lower() != "bearer" or not any([hmac.compare_digest(given, token) for token in tokens]):
            raise Unauthorized("missing or wrong bearer token; send Authorization: Bearer <GREENSERVE_API_TOKEN>")


@bp.after_app_request
def _finish(response: Response) -> Response:
    ctx, work = current.context_or_none(), current.served()
    route = request.url_rule.rule if request.url_rule else "unmatched"
    metrics.REQUESTS.labels(route, str(response.status_code)).inc()
    response.headers["X-Request-ID"] = _request_id()
    response.headers["X-Worker-PID"] = str(os.getpid())  # which worker answered: for balance diagnostics
    took_ms = (time.monotonic() - ctx.started) * 1000 if ctx else 0.0
    if ctx:  # time inside the app (parsing to JSON), for telling server time from network time
        response.headers["Server-Timing"] = f"app;dur={took_ms:.1f}"
        _bound_send(response, ctx)
    if work and work.cache and response.status_code == 200:  # RFC 9211; not on a stream: sent before it knows
        response.headers["Cache-Status"] = work.cache.header()
    if current.plane().settings.log_format != "json":  # text: gunicorn's access log
        return response
    fields = {"request_id": _request_id(), "method": request.method, "route": route,
              "path": request.path, "status": response.status_code, "images": work.images if work else 0,
              "timings_ms": work.timings_ms if work else {}, "worker_pid": os.getpid(),
              "bytes_in": request.content_length or 0, "bytes_out": response.content_length or 0,
              "duration_ms": round(took_ms, 1), "remote_addr": request.remote_addr}
    stream = current.stream_or_none()
    if stream is not None and ctx is not None:  # its work is still going: the line waits for its end
        response.call_on_close(functools.partial(_stream_ended, fields, stream, ctx.started))
    else:
        logs.access(fields)
    return response


def _bound_send(response: Response, ctx: RequestContext) -> None:
    """The answer's writes end by the request's deadline (``connection.SendBound``; a stream re-arms it before
    each line): a client that does not read cannot hold the connection, nor the requests pipelined behind."""
    timeout_s = current.plane().settings.request_timeout_s
    try:
        deadline = ctx.deadline(timeout_s)
    except RequestError:  # a bad X-Request-Timeout: this answer is its 400
        deadline = ctx.started + timeout_s
    bound = SendBound(ctx.client, deadline, time.monotonic())
    bound.arm()
    response.call_on_close(bound.release)


def _stream_ended(fields: dict[str, Any], stream: streaming.Stream, started: float) -> None:
    served = stream.served()
    logs.access({**fields, "streamed": True, "duration_ms": round((time.monotonic() - started) * 1000, 1),
                 **({"images": served.images, "timings_ms": served.timings_ms} if served else {})})


@bp.app_errorhandler(GreenserveError)
def handle_error(err: GreenserveError) -> Response:
    fields = {"request_id": _request_id(), "code": err.code}  # the JSON line's own fields
    if isinstance(err, ClientGone):
        log.info("request_id=%s %s: its remaining work was stopped", _request_id(), err.code, extra=fields)
    elif err.status_code >= 500 and not err.headers:
        log.error("request_id=%s %s: %s", _request_id(), err.code, err.message, extra=fields)
    return error_response(err.status_code, err.to_dict(), err.headers)


@bp.app_errorhandler(HTTPException)
def handle_http(exc: HTTPException) -> Response:
    status = exc.code or 500
    message = exc.description or exc.name
    if status == 413:
        limit = current.plane().settings.max_body_bytes
        message = f"the request body exceeds {limit} bytes; send fewer/smaller images or set GREENSERVE_MAX_BODY_BYTES"
        if request.content_length is not None and request.content_length <= limit:  # werkzeug's part count
            message = (f"the form has more than {current_app.config['MAX_FORM_PARTS']} parts; send fewer images "
                       "or labels per request (GREENSERVE_MAX_IMAGES, GREENSERVE_MAX_LABELS)")
    err = from_http_status(status, message)
    return error_response(err.status_code, err.to_dict(), {})


@bp.app_errorhandler(Exception)
def handle_unexpected(exc: Exception) -> Response:
    log.exception("request_id=%s unhandled error", _request_id(),
                  extra={"request_id": _request_id(), "code": "internal_error"})
    return error_response(500, {"code": "internal_error", "message": "internal error; report the request id",
                                "details": []}, {})


def error_response(status: int, error: dict[str, Any], headers: dict[str, str]) -> Response:
    """The error in the shape of the protocol that owns the path (routing errors included)."""
    metrics.ERRORS.labels(error["code"]).inc()
    body = protocols.error_body(request.path, status, error, _request_id())
    if error["code"] == "inference_failed":
        headers = {**headers, "x-should-retry": "false"}  # deterministic: the OpenAI SDK would retry a 500
    return Response(orjson.dumps(body), status=status, headers=headers, mimetype="application/json")


def _request_id() -> str:
    ctx = current.context_or_none()
    return ctx.request_id if ctx else ""
