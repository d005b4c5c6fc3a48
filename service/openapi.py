"""The native API's OpenAPI document, served at /openapi.json (being written)."""

from __future__ import annotations

from flask import Blueprint, Response

bp = Blueprint("openapi", __name__)


@bp.get("/openapi.json")
def document() -> Response:
    return Response("{}", mimetype="application/json")
