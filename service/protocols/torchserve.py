"""TorchServe's inference API: ``/ping``, ``POST|PUT /predictions/<m>``, and a read-only ``/models``."""

from __future__ import annotations

import re
from typing import Any

from flask import Blueprint

from service.protocols.surface import Surface

bp = Blueprint("torchserve", __name__)


def error_body(status: int, error: dict[str, Any], request_id: str) -> dict[str, Any]:
    return {"code": status, "type": "GreenserveError", "message": error["message"], "error_code": error["code"],
            "details": error["details"], "request_id": request_id}


SURFACE = Surface("torchserve", re.compile(r"^/(ping|predictions|models)(/|$)"), re.compile(r"^/ping$"), error_body)
