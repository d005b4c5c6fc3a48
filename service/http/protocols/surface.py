"""What each protocol tells the app about itself: the paths it owns, which of them are health routes, and
the shape of its error bodies.

Routing errors (404, 405) and body-limit errors (413) happen before a view runs, so the app picks the
error shape by the request's path, never by the blueprint that would have handled it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol


class ErrorBody(Protocol):
    def __call__(self, status: int, error: dict[str, Any], request_id: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Surface:
    name: str
    paths: re.Pattern[str]  # the routes it owns: their errors use its body
    open_paths: re.Pattern[str]  # its health routes: never behind GREENSERVE_API_TOKEN
    error_body: ErrorBody

    def owns(self, path: str) -> bool:
        return self.paths.match(path) is not None


def native_error_body(status: int, error: dict[str, Any], request_id: str) -> dict[str, Any]:
    """greenserve's own shape, which is also OpenAI's: the SDK reads ``error.message/code/type/param``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {**error, "type": kind, "param": None}, "request_id": request_id}


def flat_error_body(status: int, error: dict[str, Any], request_id: str) -> dict[str, Any]:
    """OIP v2 and KServe v1: ``error`` is the message string (tritonclient and kserve read it as one); the
    greenserve code and per-image details ride beside it."""
    return {"error": error["message"], "code": error["code"], "details": error["details"], "request_id": request_id}
