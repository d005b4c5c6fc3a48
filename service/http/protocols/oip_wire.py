"""OIP v2 on the wire: an infer request's JSON + binary tensors → an ``InferenceRequest`` and the outputs
asked for; rows → output tensors (JSON or binary). Pure functions: no Flask, no model.

Input: one BYTES tensor whose elements are encoded images. With the binary tensor extension each element
is a 4-byte little-endian length and the bytes (what tritonclient sends: no base64 tax on photos); in JSON
each element is a string: a data: or http(s) URL, else base64 (KServe and TorchServe examples), unless
the input's ``content_type`` parameter says ``url`` (relative names too) or ``base64``.
Outputs: EMBEDDING [N, D] and PROBABILITIES [N, C] FP32, from one forward; ``classification: k`` turns one
into BYTES [N, k] of ``"score:index:label"`` (the classification extension).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.engine.types import Row
from service.errors import RequestError
from service.pipeline import postprocess
from service.pipeline.inputs import base64_ref, bytes_ref, check_count, is_reference, string_ref
from service.pipeline.json_body import load_json
from service.pipeline.requests import ImageRef, InferenceRequest
from service.settings import Settings

INPUT = "IMAGE"
EMBEDDING = "EMBEDDING"
PROBABILITIES = "PROBABILITIES"
HEADER = "Inference-Header-Content-Length"
_PREFIX = 4  # a BYTES element's length: uint32, little-endian
MAX_DATA_DEPTH = 8  # nested lists in a JSON tensor's data (an image batch is 2: [N, 1])
_END = object()
EXAMPLE = '{"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["https://.../a.jpg"]}]}'


@dataclass(frozen=True)
class Output:
    name: str
    binary: bool
    classification: int = 0  # top-k as "score:index:label" strings instead of the FP32 tensor


@dataclass(frozen=True)
class InferCall:
    request: InferenceRequest
    outputs: tuple[Output, ...]
    id: str | None = None
    timeout_s: float | None = None  # the request's ``timeout`` parameter (microseconds on the wire)

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(sorted({"embeddings" if o.name == EMBEDDING else "classify" for o in self.outputs}))


def invalid(message: str) -> RequestError:
    return RequestError(message, code="invalid_tensor")


def parse_request(body: bytes, header: str | None, settings: Settings, available: Sequence[str]) -> InferCall:
    """A whole infer body, with its ``Inference-Header-Content-Length`` (``"0"``: a raw image body)."""
    if header is not None and header.strip() == "0":
        return raw_call(body, settings, available)
    head, binary = split_body(body, header)
    return parse_call(load_json(head, EXAMPLE), binary, settings, available)


def split_body(body: bytes, header: str | None) -> tuple[bytes, memoryview]:
    """The JSON part and the binary part, by ``Inference-Header-Content-Length`` (absent: all JSON)."""
    if header is None:
        return body, memoryview(b"")
    try:
        size = int(header)
    except ValueError:
        size = -1
    if not 0 <= size <= len(body):
        raise invalid(f"{HEADER}: {header!r} must be the JSON part's length in bytes, from 0 to {len(body)}")
    return body[:size], memoryview(body)[size:]


def raw_call(body: bytes, settings: Settings, available: Sequence[str]) -> InferCall:
    """``Inference-Header-Content-Length: 0``: the whole body is one encoded image; every output, binary."""
    if not body:
        raise invalid("the body is empty; with Inference-Header-Content-Length: 0 send one image's bytes")
    if len(body) >= _PREFIX and int.from_bytes(body[:_PREFIX], "little") == len(body) - _PREFIX:
        body = body[_PREFIX:]  # a one-element BYTES tensor, length-prefixed
    ref = bytes_ref(0, f"{INPUT}[0]", body, settings)
    return InferCall(InferenceRequest((ref,)), tuple(Output(name, True) for name in available))


def parse_call(doc: dict[str, Any], binary: memoryview, settings: Settings, available: Sequence[str]) -> InferCall:
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise invalid(f'"inputs" must hold exactly one tensor: {INPUT}, BYTES, one encoded image per element')
    tensor = inputs[0]
    params = _parameters(tensor.get("parameters"), "the input's parameters")
    if tensor.get("datatype") != "BYTES":
        raise invalid(f"input {tensor.get('name')!r} has datatype {tensor.get('datatype')!r}; {INPUT} takes encoded "
                      "images (JPEG, PNG, WebP...) as BYTES, one per element")
    size = params.get("binary_data_size")
    if size is not None:
        refs = _binary_refs(tensor, binary, size, settings)
    else:
        if len(binary):
            raise invalid("unexpected additional input data: binary bytes follow the JSON but no input has "
                          "binary_data_size")
        refs = _json_refs(tensor, params.get("content_type"), settings)
    _check_shape(tensor.get("shape"), len(refs), wildcard=size is None)
    req_params = _parameters(doc.get("parameters"), "the request's parameters")
    normalize = req_params.get("normalize", True)
    if not isinstance(normalize, bool):
        raise invalid(f"parameter normalize must be true or false; got {normalize!r}")
    return InferCall(InferenceRequest(tuple(refs), normalize=normalize),
                     _outputs(doc.get("outputs"), req_params.get("binary_data_output", False), available,
                              settings.max_top_k),
                     _id(doc.get("id")), _timeout(req_params.get("timeout")))


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"{where} must be an object of name: value")
    return value


def _binary_refs(tensor: dict[str, Any], binary: memoryview, size: Any, settings: Settings) -> list[ImageRef]:
    name = tensor.get("name")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise invalid(f"binary_data_size of input {name!r} must be a byte count; got {size!r}")
    if size > len(binary):
        raise invalid(f"unexpected size for input {name!r}, expecting {size} additional bytes; got {len(binary)}")
    if size < len(binary):
        raise invalid("unexpected additional input data: more bytes follow the JSON than binary_data_size says")
    elements: list[memoryview] = []
    offset = 0
    while offset < size:
        if offset + _PREFIX > size:
            raise invalid(f"input {name!r}: a BYTES element's 4-byte length is cut off at byte {offset}")
        length = int.from_bytes(binary[offset:offset + _PREFIX], "little")
        start, offset = offset + _PREFIX, offset + _PREFIX + length
        if offset > size:
            raise invalid(f"input {name!r}: element {len(elements)} says {length} bytes but the tensor ends first")
        elements.append(binary[start:offset])
        check_count(len(elements), settings)
    return [bytes_ref(i, f"{INPUT}[{i}]", bytes(e), settings) for i, e in enumerate(elements)]


def _json_refs(tensor: dict[str, Any], content_type: Any, settings: Settings) -> list[ImageRef]:
    if content_type not in (None, "url", "base64"):
        raise invalid(f'content_type {content_type!r}: use "url" (URLs and relative names) or "base64"')
    data = tensor.get("data")
    if not isinstance(data, list):
        raise invalid(f"input {tensor.get('name')!r} has no data: send the images as BYTES strings (URLs or "
                      "base64) or with the binary tensor extension")
    flat = _flatten(data)
    check_count(len(flat), settings)
    refs = []
    for i, item in enumerate(flat):
        if not isinstance(item, str) or not item.strip():
            raise invalid(f"{INPUT}[{i}] must be a non-empty string (a URL, a data: URL or base64)")
        item = item.strip()
        if content_type == "url" or (content_type is None and is_reference(item)):
            refs.append(string_ref(i, item, settings))
        else:
            refs.append(base64_ref(i, f"{INPUT}[{i}]", item, settings))
    return refs


def _flatten(data: list[Any]) -> list[Any]:
    """A tensor's nested ``data`` in row-major order, at most ``MAX_DATA_DEPTH`` lists deep (a loop, not
    recursion: 900 nested lists must be a 400, not a RecursionError)."""
    out: list[Any] = []
    stack = [(iter(data), 1)]
    while stack:
        items, depth = stack[-1]
        item = next(items, _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            if depth >= MAX_DATA_DEPTH:
                raise invalid(f"{INPUT}'s data nests deeper than {MAX_DATA_DEPTH} lists; a [N, 1] tensor is "
                              "[[...], ...] or flat")
            stack.append((iter(item), depth + 1))
        else:
            out.append(item)
    return out


def _check_shape(shape: Any, n: int, *, wildcard: bool) -> None:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise invalid(f"shape must be a list of whole numbers, like [{n}, 1]; got {shape!r}")
    if n == 0:
        raise invalid(f"{INPUT} has no elements; send at least one image")
    known = [d for d in shape if d != -1]
    wild = len(shape) - len(known)
    if any(d < 0 for d in known) or wild > (1 if wildcard else 0):
        raise invalid(f"shape {shape} has a negative dimension (one -1 is allowed only for JSON data)")
    elements = math.prod(known)
    if (elements == 0 or n % elements) if wild else elements != n:
        raise invalid(f"shape {shape} does not hold the {n} images sent; use [{n}, 1]")


def _outputs(asked: Any, binary_default: Any, available: Sequence[str], max_top_k: int) -> tuple[Output, ...]:
    if not isinstance(binary_default, bool):
        raise invalid(f"binary_data_output must be true or false; got {binary_default!r}")
    if asked is None or asked == []:
        return tuple(Output(name, binary_default) for name in available)
    if not isinstance(asked, list):
        raise invalid('"outputs" must be a list of {"name": ...}')
    outputs: list[Output] = []
    for item in asked:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name not in available:
            raise RequestError(f"unexpected inference output {name!r}; this model has {', '.join(available)}",
                               code="unexpected_output")
        if any(o.name == name for o in outputs):  # each repeat would be the whole answer again
            raise RequestError(f"output {name!r} is asked for twice; ask for each output once",
                               code="duplicate_output")
        params = _parameters(item.get("parameters"), f"output {name}'s parameters")
        binary = params.get("binary_data", binary_default)
        k = params.get("classification", 0)
        if not isinstance(binary, bool) or isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= max_top_k:
            raise invalid(f"output {name}: binary_data must be a boolean and classification a count from 0 to "
                          f"{max_top_k} (GREENSERVE_MAX_TOP_K)")
        outputs.append(Output(name, binary, k))
    return tuple(outputs)


def _id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 256:
        raise invalid("id must be a string of at most 256 characters")
    return value


def _timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise invalid(f"parameter timeout must be a positive number of microseconds; got {value!r}")
    return float(value) / 1e6


def encode_outputs(call: InferCall, rows: Sequence[Row], labels: Sequence[str]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Each output's JSON description, and the binary chunks that follow the JSON (in output order)."""
    described, chunks = [], []
    for out in call.outputs:
        tensor = _tensor(out.name, rows, call.request.normalize)
        if out.classification:
            strings = [_classes(row, out, labels, call.request.normalize) for row in rows]
            shape, datatype = [len(rows), len(strings[0])], "BYTES"
            flat: Any = [s for row_strings in strings for s in row_strings]
        else:
            shape, datatype, flat = list(tensor.shape), "FP32", tensor.ravel()
        item: dict[str, Any] = {"name": out.name, "datatype": datatype, "shape": shape}
        if out.binary:
            chunk = (b"".join(len(s).to_bytes(_PREFIX, "little") + s.encode() for s in flat)
                     if datatype == "BYTES" else np.ascontiguousarray(flat, "<f4").tobytes())
            item["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            item["data"] = flat
        described.append(item)
    return described, chunks


def _tensor(name: str, rows: Sequence[Row], normalize: bool) -> np.ndarray:
    if name == EMBEDDING:
        return np.stack([postprocess.embedding(_features(r), normalize=normalize) for r in rows])
    return np.stack([postprocess.probabilities(_logits(r)) for r in rows]).astype(np.float32)


def _classes(row: Row, out: Output, labels: Sequence[str], normalize: bool) -> list[str]:
    """Triton's classification strings: the same ranking and 6-decimal scores as /v1/classify."""
    if out.name == PROBABILITIES:
        best_classes = postprocess.top_k(_logits(row), out.classification, labels)
        return [f"{c['score']:.6f}:{c['class_id']}:{c['label']}" for c in best_classes]
    vec = postprocess.embedding(_features(row), normalize=normalize)
    best = np.argsort(-vec, kind="stable")[:out.classification]
    return [f"{float(vec[i]):.6f}:{int(i)}" for i in best]  # no labels on an embedding's dimensions


def _features(row: Row) -> np.ndarray:
    assert row.features is not None  # EMBEDDING is offered only by models with features
    return row.features


def _logits(row: Row) -> np.ndarray:
    assert row.logits is not None  # PROBABILITIES is offered only by classifiers
    return row.logits
