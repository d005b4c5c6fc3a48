"""What the cache stores, and under which key.

    model_id(identity)     a digest of everything that decides an image's outputs besides its bytes: the model
                           (family, architecture, a digest of its weights), the served numerics, the device kind,
                           the preprocessing, where JPEGs decode, the torch and Pillow versions
    content_id(data)       sha256 of the image's bytes
    entry_key / url_key    ``e:<model>:<content>`` holds the outputs; ``u:<sha256(url)>`` what a URL last held
                           (its validators, the redirects that led to the URL which sent them, and the content
                           id): the URL alone never finds outputs
    pack / unpack          outputs as raw bytes, exactly as computed, with the key they belong to and a checksum:
                           a corrupt, truncated or misplaced value unpacks as None (a miss)

Nothing of the caller (token, client id, address) is in a key or a value.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMAT = 1  # bumped when the packing or the identity changes: old entries then miss instead of misreading
MAGIC = b"GSE" + bytes([FORMAT])
_CHECK = 16  # blake2b digest bytes at the end of every value


@dataclass(frozen=True)
class Outputs:
    """One image's outputs from the model: what a forward gave it, before any per-request option."""

    features: np.ndarray | None
    logits: np.ndarray | None


@dataclass(frozen=True)
class UrlRecord:
    """What a URL held when it was last fetched: the content's id, the validators to ask again with, and the
    redirects that led to the URL which sent them (``fetch.chain_id``: only that URL, reached so, is asked)."""

    content: str
    etag: str = ""
    last_modified: str = ""
    fresh_until: float = 0.0  # Unix time; before it (the host's max-age, every redirect's too) not asked again
    chain: str = ""


def model_id(identity: Mapping[str, Any]) -> str:
    text = json.dumps({"format": FORMAT, **identity}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def content_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry_key(model: str, content: str) -> str:
    return f"e:{model}:{content}"


def url_key(url: str) -> str:
    return "u:" + hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def pack(key: str, outputs: Outputs) -> bytes:
    arrays = [a for a in (outputs.features, outputs.logits) if a is not None]
    head = json.dumps({"key": key, "shapes": [_shape(outputs.features), _shape(outputs.logits)]}).encode()
    body = b"".join([MAGIC, struct.pack("<I", len(head)), head, *(np.ascontiguousarray(a).tobytes() for a in arrays)])
    return body + _check(body)


def unpack(key: str, blob: bytes | None) -> Outputs | None:
    """The outputs packed under ``key``, or None for anything else: a miss, never a wrong vector."""
    if not blob or len(blob) < len(MAGIC) + 4 + _CHECK or not blob.startswith(MAGIC):
        return None
    body = memoryview(blob)[:-_CHECK]
    if _check(body) != blob[-_CHECK:]:
        return None
    try:
        (size,) = struct.unpack_from("<I", body, len(MAGIC))
        start = len(MAGIC) + 4
        head = json.loads(bytes(body[start:start + size]))
        if head.get("key") != key:
            return None
        offset, arrays = start + size, []
        for shape in head["shapes"]:
            array, offset = _array(body, offset, shape)
            arrays.append(array)
    except (ValueError, KeyError, TypeError, struct.error):
        return None
    return Outputs(arrays[0], arrays[1]) if offset == len(body) else None


def pack_url(key: str, record: UrlRecord) -> bytes:
    return json.dumps({"key": key, "content": record.content, "etag": record.etag, "lm": record.last_modified,
                       "fresh_until": record.fresh_until, "chain": record.chain}).encode()


def unpack_url(key: str, blob: bytes | None) -> UrlRecord | None:
    """The record packed under ``key``, or None. A record without its chain predates it: its validators may
    have come from a redirect's target, so it is not trusted (the next fetch downloads, the content finds the entry)."""
    try:
        value = json.loads(blob) if blob else None
        if not isinstance(value, dict) or value.get("key") != key or len(value["content"]) != 64:
            return None
        return UrlRecord(str(value["content"]), str(value["etag"]), str(value["lm"]), float(value["fresh_until"]),
                         str(value["chain"]))
    except (ValueError, KeyError, TypeError):
        return None


def _shape(a: np.ndarray | None) -> list[Any] | None:
    return None if a is None else [a.dtype.str, list(a.shape)]


def _array(body: memoryview, offset: int, shape: list[Any] | None) -> tuple[np.ndarray | None, int]:
    if shape is None:
        return None, offset
    dtype, dims = np.dtype(shape[0]), tuple(int(d) for d in shape[1])
    count = int(np.prod(dims)) if dims else 1
    end = offset + count * dtype.itemsize
    if end > len(body) or count < 0:
        raise ValueError("truncated")
    # read-only views of the stored bytes: exactly what was computed, and no answer can change them
    return np.frombuffer(body, dtype, count, offset).reshape(dims), end


def _check(body: bytes | memoryview) -> bytes:
    return hashlib.blake2b(body, digest_size=_CHECK).digest()
