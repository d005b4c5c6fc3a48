"""Reading a fetched image's body: streamed against the byte cap, decompressed within it, and sniffed, so a web
page served as image/jpeg or a gzip bomb stops early, not at the cap."""

from __future__ import annotations

import zlib
from typing import Protocol

import gevent
import requests
from urllib3.exceptions import HTTPError as Urllib3Error

from service.errors import FetchError, ImageTooLarge, NotAnImage
from service.pipeline.decode import sniff_refused_format

CHUNK_BYTES = 64 * 1024
SNIFF_BYTES = 1024  # enough for every magic number decode.py knows, SVG's "<svg" included
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM")


class Pace(Protocol):
    """What the hub does between two chunks of a body (``engine.urgency.Urgency``: also waits while a
    forward someone waits on has the cores)."""

    def turn(self) -> None: ...


class Yield:
    """Between two chunks, let the hub's other greenlets run: a socket that already holds data never makes
    its reader wait, so one fetch could read megabytes before /healthz gets a turn. Every chunk, not every
    millisecond: gevent's loop runs 50 queued callbacks between looks at the clock before it polls for I/O
    (figures: docs/SCHEDULING.md#hub-turns)."""

    def turn(self) -> None:
        gevent.sleep(0)


YIELD = Yield()


def read_body(resp: requests.Response, cap: int, pace: Pace = YIELD) -> bytes:
    """The body streamed against ``cap`` (Content-Length first, then as bytes arrive); gzip/deflate
    decoded here within the same cap; the first bytes, not Content-Type, decide whether it is an image;
    ``pace`` takes its turn after each chunk."""
    declared = resp.headers.get("Content-Length", "").strip()
    if declared.isdigit() and int(declared) > cap:
        raise _too_large(int(declared), cap)
    decoder = _decoder(resp.headers.get("Content-Encoding", ""))
    # the pieces are joined once at the end: growing one buffer copied each photo again on every
    # resize, on the hub (docs/SCHEDULING.md#hub-turns)
    parts: list[bytes] = []
    size = received = 0
    sniffed = False
    try:
        for chunk in resp.raw.stream(CHUNK_BYTES, decode_content=False):
            received += len(chunk)
            if received > cap:
                raise _too_large(received, cap, more=True)
            piece = _inflate(decoder, chunk, size, cap)
            parts.append(piece)
            size += len(piece)
            if size > cap:
                raise _too_large(size, cap, more=True)
            if not sniffed and size >= SNIFF_BYTES:
                sniffed = _sniff(b"".join(parts))  # a web page served as image/jpeg stops here, not at the cap
            pace.turn()
        if decoder is not None:
            parts.append(decoder.flush())
            size += len(parts[-1])
            if not decoder.eof or size > cap:
                raise FetchError("the compressed body is truncated or too large", code="fetch_failed")
    except (Urllib3Error, OSError, zlib.error) as exc:
        raise FetchError(f"the connection broke while reading the image: {reason(exc)}",
                         code="fetch_failed") from exc
    body = b"".join(parts)
    if body and not sniffed:
        _sniff(body)
    return body


def _inflate(decoder: zlib._Decompress | None, chunk: bytes, size: int, cap: int) -> bytes:
    """One chunk of the body as the image's bytes; ``max_length``: a bomb never inflates past the cap."""
    if decoder is None:
        return chunk
    piece = decoder.decompress(chunk, cap + 1 - size)
    if decoder.unconsumed_tail:
        raise _too_large(size + len(piece), cap, more=True)
    return piece


def _decoder(header: str) -> zlib._Decompress | None:
    codings = [c.strip().lower() for c in header.split(",") if c.strip().lower() not in ("", "identity")]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(wbits=32 + zlib.MAX_WBITS)  # 32: gzip or zlib header, detected
    raise FetchError(f"the image host sent Content-Encoding {header!r}; only gzip and deflate are decoded",
                     code="fetch_failed")


def _sniff(head: bytes | bytearray) -> bool:
    """True when ``head`` starts like an image (one decode accepts or names); NotAnImage otherwise."""
    head = bytes(head[:SNIFF_BYTES])
    if head.startswith(_IMAGE_MAGIC) or head[:4] == b"RIFF" and head[8:12] == b"WEBP" or sniff_refused_format(head):
        return True
    raise NotAnImage("the URL did not return an image (JPEG, PNG, WebP, GIF or BMP); check that it points at "
                     "the image itself, not a web page", code="not_an_image")


def _too_large(size: int, cap: int, more: bool = False) -> ImageTooLarge:
    return ImageTooLarge(f"the image is {'more than ' if more else ''}{size} bytes; the limit is {cap} bytes. "
                         "Send a smaller image or set GREENSERVE_MAX_IMAGE_BYTES")


def reason(exc: BaseException) -> str:
    """The root cause in words ("Connection refused"), not requests' and urllib3's wrappers around it."""
    for _ in range(8):  # requests error -> MaxRetryError.reason -> NewConnectionError -> OSError
        last = exc.args[-1] if exc.args else None
        inner = getattr(exc, "reason", None) or (last if isinstance(last, BaseException) else None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    text = exc.strerror if isinstance(exc, OSError) and isinstance(exc.strerror, str) else str(exc)
    return text if len(text) < 200 else text[:200] + "..."
