"""The error tree in ``service/errors.py``'s docstring is the one table of codes: it cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

from service import errors

SERVICE = Path(errors.__file__).parent


def _codes_in_code() -> set[str]:
    found = set()
    for path in SERVICE.rglob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r'\bcode="([a-z_]+)"', text))
        found |= set(re.findall(r'^\s+code = "([a-z_]+)"', text, re.M))
    return found


def test_every_code_the_service_raises_is_in_the_tree() -> None:
    tree = errors.__doc__ or ""
    missing = sorted(code for code in _codes_in_code() if code not in tree)
    assert not missing, f"codes raised but not in the errors.py tree: {missing}"


def test_framework_http_errors_map_onto_the_tree() -> None:
    assert errors.from_http_status(404, "x").code == "not_found"
    assert errors.from_http_status(405, "x").code == "method_not_allowed"
    assert errors.from_http_status(413, "x").code == "body_too_large"
    teapot = errors.from_http_status(418, "x")
    assert (teapot.status_code, teapot.code) == (418, "http_error")
