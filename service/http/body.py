"""The request body every route reads: ``read()`` is the body as sent, or inflated when it comes with
``Content-Encoding: gzip`` or ``deflate`` (tritonclient's request_compression_algorithm; any client that
compresses an album of data: URLs), never past the body cap. Any other encoding is 415.

A form (multipart) is parsed by werkzeug from the raw stream, so it must come uncompressed (``check_form``).
Inflating runs in a decode thread: a 64 MiB inflate would hold the hub's GIL for tens of ms.
"""

from __future__ import annotations

import zlib

from flask import request

from service.errors import PayloadTooLarge, RequestError, UnsupportedMediaType
from service.http import current

COMPRESSED = ("gzip", "deflate")
_GZIP_MAGIC = b"\x1f\x8b"


def read(*, bad_code: str = "malformed_body") -> bytes:
    """The whole body, inflated if compressed; a compressed body that does not inflate is 400 ``bad_code``
    (OIP says ``invalid_tensor``, as for its other framing faults)."""
    encoding = _encoding()
    raw = request.get_data(cache=False)
    if encoding == "identity":
        return raw
    plane = current.plane()
    return plane.runner.offload(_inflate, raw, encoding, plane.settings.max_body_bytes, bad_code)


def check_form() -> None:
    """A form's body must not be compressed (werkzeug reads it from the wire); any other is refused."""
    encoding = _encoding()
    if encoding != "identity":
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not accepted on a form; send the form "
                                   "uncompressed (a JSON body may be gzip or deflate)",
                                   code="unsupported_content_encoding")


def _encoding() -> str:
    encoding = request.headers.get("Content-Encoding", "").strip().lower() or "identity"
    if encoding not in ("identity", *COMPRESSED):
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not accepted; use gzip, deflate or none",
                                   code="unsupported_content_encoding")
    return encoding


def _inflate(body: bytes, encoding: str, limit: int, bad_code: str) -> bytes:
    """Every gzip member in turn (a gzip stream may have several), all within ``limit``; what is not a whole
    stream (cut short, or followed by bytes that are not another member) is refused, not half-read."""
    out, rest = bytearray(), body
    while True:
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)  # either header: gzip or zlib
        try:
            out += inflater.decompress(rest, limit + 1 - len(out))  # at least 1: 0 would mean no cap
        except zlib.error as exc:
            raise RequestError(f"the {encoding} body does not inflate ({exc})", code=bad_code) from exc
        if len(out) > limit:
            raise PayloadTooLarge(f"the body inflates past {limit} bytes; send fewer/smaller images or set "
                                  "GREENSERVE_MAX_BODY_BYTES")
        if not inflater.eof:
            raise RequestError(f"the {encoding} body ends before its compressed stream does (cut short?)",
                               code=bad_code)
        rest = inflater.unused_data
        if not rest:
            return bytes(out)
        if encoding != "gzip" or not rest.startswith(_GZIP_MAGIC):
            raise RequestError(f"the {encoding} body has {len(rest)} bytes after its compressed stream",
                               code=bad_code)
