"""Open Inference Protocol v2 (Triton HTTP / KServe v2)."""

from __future__ import annotations

import re

from flask import Blueprint

from service.protocols.surface import Surface, flat_error_body

bp = Blueprint("oip", __name__)
SURFACE = Surface("oip", re.compile(r"^/v2(/|$)"),
                  re.compile(r"^/v2/?$|^/v2/health/(live|ready)$|^/v2/models/[^/]+(/versions/[^/]+)?/ready$"),
                  flat_error_body)
