"""OIP v2 wire format: binary framing, JSON tensors, outputs, and the refusals (no server, no model)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from service.engine.types import Row
from service.errors import PayloadTooLarge, RequestError
from service.http.protocols import needs_token
from service.http.protocols import oip_wire as wire
from service.settings import Settings

SETTINGS = Settings(max_images=4, max_image_bytes=1024, image_base_url="http://images.local/")
BOTH = (wire.EMBEDDING, wire.PROBABILITIES)


def framed(*blobs: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in blobs)


def binary_call(blobs: list[bytes], shape: list[int] | None = None, extra: bytes = b"", **doc: object) -> wire.InferCall:
    tensor = framed(*blobs)
    head = json.dumps({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": shape or [len(blobs), 1],
                                   "parameters": {"binary_data_size": len(tensor)}}], **doc}).encode()
    json_part, binary = wire.split_body(head + tensor + extra, str(len(head)))
    return wire.parse_call(json.loads(json_part), binary, SETTINGS, BOTH)


def test_binary_elements_become_images_in_order() -> None:
    call = binary_call([b"abc", b"", b"xyz"], shape=[1, 3])
    assert [r.data for r in call.request.refs] == [b"abc", b"", b"xyz"]
    assert [o.name for o in call.outputs] == list(BOTH) and not any(o.binary for o in call.outputs)


@pytest.mark.parametrize("blobs, shape, extra, words", [
    ([b"abc"], [2, 1], b"", "does not hold"),
    ([b"abc"], [1, 1], b"!", "unexpected additional input data"),
    ([b"abc"], [-1], b"", "negative"),  # a wildcard only for JSON data
])
def test_binary_tensors_that_do_not_add_up_are_400(blobs: list[bytes], shape: list[int], extra: bytes,
                                                   words: str) -> None:
    with pytest.raises(RequestError, match=words):
        binary_call(blobs, shape=shape, extra=extra)


def test_a_cut_element_and_a_bad_header_are_400() -> None:
    head = json.dumps({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                                   "parameters": {"binary_data_size": 6}}]}).encode()
    body = head + struct.pack("<I", 50) + b"ab"
    json_part, binary = wire.split_body(body, str(len(head)))
    with pytest.raises(RequestError, match="says 50 bytes"):
        wire.parse_call(json.loads(json_part), binary, SETTINGS, BOTH)
    for header in ("-1", "x", str(len(body) + 1)):
        with pytest.raises(RequestError, match="Inference-Header-Content-Length"):
            wire.split_body(body, header)


def test_limits_are_the_native_ones() -> None:
    with pytest.raises(PayloadTooLarge):
        binary_call([b"a"] * 5)  # max_images=4
    call = binary_call([b"a" * 1025])  # max_image_bytes=1024: that image fails, as on /v1
    assert call.request.refs[0].error is not None and call.request.refs[0].error.status_code == 413


def test_json_strings_are_urls_data_urls_or_base64() -> None:
    doc = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [-1],
                       "data": ["https://a.example/1.jpg", "data:image/png;base64,YWJj", "YWJj"]}]}
    refs = wire.parse_call(doc, memoryview(b""), SETTINGS, BOTH).request.refs
    assert refs[0].url == "https://a.example/1.jpg" and refs[1].data == b"abc" and refs[2].data == b"abc"
    doc["inputs"][0]["parameters"] = {"content_type": "url"}
    doc["inputs"][0]["data"] = [["a.jpg"]]  # nested data, relative name
    assert wire.parse_call(doc, memoryview(b""), SETTINGS, BOTH).request.refs[0].url == "http://images.local/a.jpg"


@pytest.mark.parametrize("doc", [
    {},
    {"inputs": []},
    {"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [1], "data": [1]}]},
    {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1]}]},
    {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [7]}]},
    {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": "1", "data": ["YWJj"]}]},
    {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["YWJj"]}], "outputs": [{"name": "X"}]},
    {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["YWJj"]}],
     "outputs": [{"name": "EMBEDDING", "parameters": {"classification": 1000}}]},
    {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["YWJj"]}], "parameters": {"timeout": -1}},
])
def test_malformed_requests_are_400(doc: dict) -> None:
    with pytest.raises(RequestError):
        wire.parse_call(doc, memoryview(b""), SETTINGS, BOTH)


def test_a_raw_body_is_one_image_with_or_without_its_length_prefix() -> None:
    assert wire.raw_call(b"jpegbytes", SETTINGS, BOTH).request.refs[0].data == b"jpegbytes"
    call = wire.raw_call(framed(b"jpegbytes"), SETTINGS, BOTH)
    assert call.request.refs[0].data == b"jpegbytes" and all(o.binary for o in call.outputs)


def test_outputs_encode_as_json_binary_and_classification_strings() -> None:
    rows = [Row(np.array([3.0, 4.0], np.float32), np.array([0.0, 2.0, 1.0], np.float32), 0.0, 0.0, 2),
            Row(np.array([0.0, 2.0], np.float32), np.array([5.0, 0.0, 0.0], np.float32), 0.0, 0.0, 2)]
    call = wire.InferCall(binary_call([b"a", b"b"]).request, (
        wire.Output(wire.EMBEDDING, binary=True), wire.Output(wire.PROBABILITIES, binary=False, classification=2)))
    described, chunks = wire.encode_outputs(call, rows, ["cat", "dog", "fox"])
    assert described[0] == {"name": "EMBEDDING", "datatype": "FP32", "shape": [2, 2],
                            "parameters": {"binary_data_size": 16}}
    np.testing.assert_allclose(np.frombuffer(chunks[0], "<f4"), [0.6, 0.8, 0.0, 1.0], rtol=1e-6)
    assert described[1]["shape"] == [2, 2] and described[1]["datatype"] == "BYTES"
    assert described[1]["data"][0].endswith(":1:dog") and described[1]["data"][2].endswith(":0:cat")


@pytest.mark.parametrize("path, guarded", [
    ("/v2/health/live", False), ("/v2/health/ready", False), ("/v2", False), ("/v2/models/m/ready", False),
    ("/v2/models/m/versions/1/ready", False), ("/ping", False), ("/", False), ("/healthz", False),
    ("/metrics", False), ("/openapi.json", False),
    ("/v2/models/m/infer", True), ("/v2/models/m", True), ("/v2/models/m/config", True), ("/v1/embeddings", True),
    ("/v1/models", True), ("/v1/models/m:predict", True), ("/predictions/m", True), ("/models", True),
])
def test_the_token_guards_inference_and_metadata_never_health(path: str, guarded: bool) -> None:
    assert needs_token(path) is guarded
