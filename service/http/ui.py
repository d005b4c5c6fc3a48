"""The album page at ``/ui`` (a browser asking for ``/`` is sent there; any other client still gets KServe
v1's liveness answer at ``/``): plain HTML, CSS and JS from ``page-files/``, no build step and no
library. It calls this server's own API (streamed /v1/embeddings or /v1/classify, a few photos a request,
then text embeddings for search and zero-shot labels); its Content-Security-Policy lets it reach nothing else
but the images of the URLs a user pastes. With GREENSERVE_API_TOKEN set the page asks for the token before it
does anything."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, redirect, request, send_from_directory

bp = Blueprint("ui", __name__)
STATIC = Path(__file__).resolve().parent / "page-files"  # not a name Python could import: data, not a package
FILES = ("album.js", "send.js", "app.js", "style.css")
# the page talks to this origin only; the photos it shows are the user's own files (blob: URLs) and the URLs
# the user pasted, loaded as images (no referrer), which is all img-src lets reach another origin
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data: http: https:; "
       "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")


@bp.before_app_request
def _browser_at_root() -> Response | None:
    """``/`` is KServe v1's liveness route (kserve's ``is_server_live``); a browser, which prefers HTML
    to JSON, is sent to the page instead."""
    accept = request.accept_mimetypes
    if request.path == "/" and request.method == "GET" and accept["text/html"] > accept["application/json"]:
        return redirect("/ui", code=302)  # type: ignore[return-value]
    return None


@bp.get("/ui")
def page() -> Response:
    return _static("index.html")


@bp.get("/ui/<name>")
def asset(name: str) -> Response:
    if name not in FILES:
        return Response("not found\n", status=404, mimetype="text/plain")
    return _static(name)


def _static(name: str) -> Response:
    response = send_from_directory(STATIC, name, max_age=300)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response
