import base64
import json
import os

import pytest

from service.errors import GreenserveError, PayloadTooLarge, RequestError
from service.pipeline import json_body
from service.pipeline.json_body import LONG, MAX_SKELETON, load_json

B64 = base64.b64encode(os.urandom(3 * LONG)).decode()  # 4 * LONG characters, with '/' and '+'
URL = "data:image/jpeg;base64," + B64


def test_long_strings_come_back_where_they_were_values_keys_and_nested() -> None:
    doc = {"images": [URL, "img1.jpg", URL[:-8]], "x": {B64: [1, {"deep": B64[::-1]}]}, "texts": ["a\nb"]}
    assert load_json(json.dumps(doc).encode()) == doc


def test_orjson_parses_only_the_skeleton(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = json_body.orjson.loads
    monkeypatch.setattr(json_body.orjson, "loads", lambda b: seen.append(len(b)) or real(b))
    body = json.dumps({"images": [URL] * 20}).encode()
    assert load_json(body)["images"] == [URL] * 20
    assert len(body) > 20 * LONG and seen == [pytest.approx(20 * 40, abs=200)]


def test_phps_escaped_slashes_are_unescaped_in_a_long_string() -> None:
    body = json.dumps({"images": [URL]}).replace("/", "\\/").encode()
    assert b"\\/" in body and load_json(body)["images"] == [URL]


@pytest.mark.parametrize("inner", ["\\n", '\\"', "\\\\", "\\u0041", "\\\\/"])
def test_other_escapes_in_a_long_string_are_refused(inner: str) -> None:
    body = b'{"images": ["' + (B64[:LONG] + inner + B64[:LONG]).encode() + b'"]}'
    with pytest.raises(RequestError) as err:
        load_json(body)
    assert err.value.code == "invalid_json" and "escape" in err.value.message


def test_a_long_run_between_strings_stays_in_the_skeleton() -> None:
    spaces = {"a": "x", "b": [0.5] * (LONG // 4), "c": "y"}  # a long run of numbers between two quotes
    assert load_json(json.dumps(spaces).encode()) == spaces
    padded = b'{"a": "x",' + b" " * (2 * LONG) + b'"b": "' + B64.encode() + b'"}'
    assert load_json(padded) == {"a": "x", "b": B64}


def test_a_placeholder_cannot_be_forged() -> None:
    doc = {"images": [URL], "x": "greenserve-0000000000000000-0"}
    assert load_json(json.dumps(doc).encode()) == doc


def test_invalid_json_with_long_strings_is_invalid_json() -> None:
    with pytest.raises(RequestError) as err:
        load_json(json.dumps({"images": [URL]}).encode()[:-1])
    assert err.value.code == "invalid_json" and "in a body of" in err.value.message
    with pytest.raises(RequestError) as err:  # not UTF-8 inside a long string
        load_json(b'{"images": ["' + b"\xff" * (2 * LONG) + b'"]}')
    assert err.value.code == "invalid_json"


def test_the_skeleton_is_bounded_when_strings_are_just_short_of_long() -> None:
    body = json.dumps({"x": [B64[:LONG - 1]] * (MAX_SKELETON // LONG + 1)}).encode()
    with pytest.raises(PayloadTooLarge) as err:
        load_json(body)
    assert err.value.code == "json_too_complex"


def test_long_strings_that_start_like_the_space_between_strings_stay_in_the_skeleton() -> None:
    doc = {"x": [" " + B64, ":" + B64, "]" + B64]}
    assert load_json(json.dumps(doc).encode()) == doc


@pytest.mark.parametrize(("body", "code"), [
    (b"", "invalid_json"), (b"[1]", "invalid_request"), (b"[" * 2000 + b"]" * 2000, "json_too_deep"),
    (b'{"x": [' + b",".join([b"[]"] * 100_001) + b"]}", "json_too_complex"),
    (b'{"x": [' + b",".join([b"1"] * 250_002) + b"]}", "json_too_complex"),
])
def test_bodies_no_request_is_are_refused_with_their_codes(body: bytes, code: str) -> None:
    with pytest.raises(GreenserveError) as err:
        load_json(body)
    assert err.value.code == code


def test_a_body_with_long_strings_has_few_items() -> None:
    body = json.dumps({"images": [URL], "outputs": [{"name": "EMBEDDING"}] * 10_000}).encode()
    with pytest.raises(PayloadTooLarge) as err:
        load_json(body)
    assert err.value.code == "json_too_complex" and "multipart" in err.value.message
    assert len(load_json(json.dumps({"images": [URL], "labels": ["cat"] * 1000}).encode())["labels"]) == 1000
