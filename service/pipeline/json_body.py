"""A request body that must be one JSON object, parsed without holding the GIL (and the hub) for long.

orjson, not the standard library: it refuses lone surrogates (which no answer could echo back), nests at
most 1,024 deep (the standard library's recursion runs out on deep nesting), and builds the document
several times faster. But one ``orjson.loads`` is one C call holding the GIL for the whole body, and the
hub's ``/healthz`` waits that long (figures: docs/SCHEDULING.md#hub-turns). So before it:

- counts of the body's arrays, objects and commas bound what parsing may allocate (an empty list costs
  Python far more than its two bytes);
- long strings (base64 images, the only long strings a request has) are cut out, found with a few
  ``find`` calls, and put back after parsing, each made by one fast UTF-8 decode; what is left for orjson
  (the skeleton) is bounded too.

Every C call here runs over at most ``GIL_STEP`` bytes or one long string, so the hub gets a turn between.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from service.errors import PayloadTooLarge, RequestError

# arrays + objects in one JSON body: the largest real request (OIP JSON, 64 images as [[...]]) has ~130
MAX_JSON_CONTAINERS = 100_000
# commas: an upper bound on the body's items, each a Python object once parsed while parsing holds the GIL
# (the hub's too): the bound keeps that hold to tens of ms. A real request has ~2,000 items (1,024 texts,
# 1,000 labels or 64 images); the rest of the bound is room for commas inside texts
MAX_JSON_ITEMS = 250_000
# the pre-scans and base64 decoding go in steps of this (a multiple of 4 characters): one C call holds
# the GIL throughout, and the interpreter can hand it to the hub only between calls
GIL_STEP = 1 << 20
# strings at least this long are taken out before orjson; a string shorter than this and not escaped is
# always seen, because every run of LONG bytes holds a multiple of LONG
LONG = 64 << 10
# what orjson may parse in one call, long strings taken out: tens of ms of GIL. A real request's is at most
# ~12 MB (1,024 texts of 2,000 characters, each escaped as \\uXXXX)
MAX_SKELETON = 16 << 20
# items (arrays, objects, commas) in a body with long strings: putting them back walks the document in
# Python, slower an item than parsing. A real one has images and at most ~1,000 labels
MAX_ITEMS_WITH_LONG = 20_000
_AFTER_A_STRING = frozenset(b' \t\r\n:,]}')


def load_json(body: bytes, example: str = '{"images": ["https://.../a.jpg"]}') -> dict[str, Any]:
    """The body as a JSON object (every protocol's JSON goes through here), or a ``RequestError``."""
    if not body.strip():
        raise RequestError(f"the request body is empty; send JSON like {example}", code="invalid_json")
    items = _check_counts(body)
    skeleton, held = _take_long_strings(body) if len(body) > LONG else (body, {})
    if held and items > MAX_ITEMS_WITH_LONG:
        raise PayloadTooLarge(f"the JSON body has strings over {LONG:,} bytes (base64 images) and {items:,} "
                              f"items; with such strings at most {MAX_ITEMS_WITH_LONG:,}: send the images as "
                              "multipart uploads or URLs", code="json_too_complex")
    if len(skeleton) > MAX_SKELETON:
        raise PayloadTooLarge(f"the JSON body has {len(skeleton):,} bytes outside its long strings (at most "
                              f"{MAX_SKELETON:,}); send fewer texts or labels per request, or images as "
                              "multipart uploads", code="json_too_complex")
    try:
        doc = orjson.loads(skeleton)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):
            raise RequestError("the JSON body nests deeper than 1,024 levels; a request nests 3 or 4",
                               code="json_too_deep") from exc
        # a position in the skeleton is not one in the body
        where = exc if not held else f"{exc.msg}, in a body of {len(body):,} bytes"
        raise RequestError(f"the body is not valid JSON ({where}); send {example}", code="invalid_json") from exc
    if not isinstance(doc, dict):
        raise RequestError(f"the JSON body must be an object like {example}")
    return _restore(doc, held) if held else doc


def _count(body: bytes, byte: bytes) -> int:
    """``body.count(byte)`` in ``GIL_STEP`` steps (one call over a whole body holds the GIL for tens of ms)."""
    return sum(body.count(byte, i, i + GIL_STEP) for i in range(0, len(body), GIL_STEP))


def _check_counts(body: bytes) -> int:
    """The body's items (arrays, objects and commas), within the bounds."""
    containers = _count(body, b"[") + _count(body, b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise PayloadTooLarge(f"the JSON body has {containers:,} arrays and objects; a request needs a few "
                              f"(at most {MAX_JSON_CONTAINERS:,}): send images as strings in one list",
                              code="json_too_complex")
    items = _count(body, b",")
    if items > MAX_JSON_ITEMS:
        raise PayloadTooLarge(f"the JSON body has {items:,} commas, more than any request within the limits "
                              f"({MAX_JSON_ITEMS:,}); send fewer items per request", code="json_too_complex")
    return containers + items


def _take_long_strings(body: bytes) -> tuple[bytes, dict[str, str]]:
    """The body with each long string replaced by a placeholder string, and the strings they were.

    A run of ``LONG`` or more bytes between two quotes is a string, or the space between two strings;
    after a string's closing quote JSON allows only whitespace, ``:``, ``,``, ``]`` or ``}``, so a run
    that starts with none of them is a string (or the body is not JSON either way). A run that starts
    with one stays for orjson, within ``MAX_SKELETON``. A placeholder is a fresh random nonce each time:
    a caller cannot forge one.
    """
    nonce = f"greenserve-{secrets.token_hex(8)}-"
    pieces: list[bytes] = []
    held: dict[str, str] = {}
    start = end = 0
    for probe in range(LONG, len(body), LONG):
        if probe < end:
            continue  # inside the last long run: scanning it again would cost its length each time
        opened, closed = body.rfind(b'"', 0, probe), body.find(b'"', probe)
        if opened < 0 or closed < 0 or closed - opened - 1 < LONG:
            continue
        end = closed
        if body[opened + 1] in _AFTER_A_STRING:
            continue
        key = f"{nonce}{len(held)}"
        held[key] = _text(body, opened, closed)
        pieces += [body[start:opened], b'"', key.encode(), b'"']
        start = closed + 1
    if not held:
        return body, {}
    pieces.append(body[start:])
    return b"".join(pieces), held


def _text(body: bytes, opened: int, closed: int) -> str:
    """A long string's content. Base64 needs no escapes but ``\\/`` (PHP's json_encode writes ``/`` so);
    another escape in a string this long is refused, since only a hostile body has one."""
    escaped = opened > 0 and body[opened - 1] == 0x5C  # the opening quote may be an escaped one in a string
    if not escaped and body.find(b"\\", opened, closed) < 0:
        return _utf8(memoryview(body)[opened + 1:closed])  # no copy before the decode
    pieces = []
    at = opened + 1
    while at < closed and not escaped:
        stop = min(closed, at + GIL_STEP)
        stop += body[stop - 1] == 0x5C  # never split an escape (a longer run of backslashes is refused)
        piece = body[at:stop]
        escaped = piece.count(b"\\") != piece.count(b"\\/")
        pieces.append(piece.replace(b"\\/", b"/"))
        at = stop
    if escaped:
        raise RequestError(f"a JSON string of {closed - opened - 1:,} bytes has escape sequences; a string "
                           f"this long (over {LONG:,} bytes) must be base64, which needs none",
                           code="invalid_json")
    return _utf8(memoryview(b"".join(pieces)))


def _utf8(data: memoryview) -> str:
    try:
        return str(data, "utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"the body is not valid UTF-8 ({exc}); send JSON in UTF-8", code="invalid_json") from exc


def _restore(doc: dict[str, Any], held: dict[str, str]) -> dict[str, Any]:
    """Put the long strings back where their placeholders are (values and keys), without recursion."""
    stack: list[Any] = [doc]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            for key in [k for k in node if k in held]:
                node[held[key]] = node.pop(key)
        for k, value in list(node.items() if type(node) is dict else enumerate(node)):
            kind = type(value)
            if kind is str:
                if value in held:
                    node[k] = held[value]
            elif kind is dict or kind is list:
                stack.append(value)
    return doc
