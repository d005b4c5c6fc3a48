"""KServe v1 (TF Serving style): ``GET /`` liveness and ``POST /v1/models/<m>:predict`` with ``instances``."""

from __future__ import annotations

import re

from flask import Blueprint

from service.protocols.surface import Surface, flat_error_body

bp = Blueprint("kserve_v1", __name__)
SURFACE = Surface("kserve_v1", re.compile(r"^/$|^/v1/models/[^/]+:predict$"), re.compile(r"^/$"), flat_error_body)
