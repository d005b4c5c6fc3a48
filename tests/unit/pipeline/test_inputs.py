from __future__ import annotations

import base64
import json

import pytest

from service.errors import PayloadTooLarge, RequestError
from service.pipeline.inputs import parse_form, parse_json
from service.settings import Settings

S = Settings(image_base_url="http://cdn.example.com/album/", max_images=3, max_image_bytes=2048)


def body(**doc: object) -> bytes:
    return json.dumps(doc).encode()


def test_urls_names_and_data_urls_become_refs() -> None:
    data = base64.b64encode(b"\xff\xd8jpeg").decode()
    req = parse_json(body(images=["https://x.example/a.jpg", "img001.jpg", f"data:image/jpeg;base64,{data}"]), S)
    a, b, c = req.refs
    assert a.url == "https://x.example/a.jpg"
    assert b.url == "http://cdn.example.com/album/img001.jpg" and b.name == "img001.jpg"
    assert c.data == b"\xff\xd8jpeg" and c.url is None
    assert (req.top_k, req.normalize, req.partial) == (5, True, False)


def test_relative_name_without_base_url_is_a_per_image_error() -> None:
    req = parse_json(body(images=["img001.jpg"]), Settings())
    assert req.refs[0].error is not None and req.refs[0].error.code == "invalid_url"


@pytest.mark.parametrize("ref", ["file:///etc/passwd", "gopher://x/", "ftp://x/a.jpg"])
def test_non_http_schemes_are_invalid_url(ref: str) -> None:
    assert parse_json(body(images=[ref]), S).refs[0].error.code == "invalid_url"  # type: ignore[union-attr]


def test_bad_base64_is_invalid_data_url() -> None:
    assert parse_json(body(images=["data:image/png;base64,@@@"]), S).refs[0].error.code == "invalid_data_url"  # type: ignore[union-attr]


def test_oversized_data_url_is_refused_before_decoding() -> None:
    big = base64.b64encode(b"x" * 4096).decode()
    assert parse_json(body(images=[f"data:image/png;base64,{big}"]), S).refs[0].error.code == "image_too_large"  # type: ignore[union-attr]


@pytest.mark.parametrize("raw, code", [
    (b"", "invalid_json"), (b"{", "invalid_json"), (b"[]", "invalid_request"),
    (b'{"images": []}', "invalid_request"), (b'{"images": [1]}', "invalid_request"),
    (b'{"images": ["a.jpg"], "topk": 3}', "invalid_request"),
    (b'{"images": ["a.jpg"], "top_k": 0}', "invalid_request"),
    (b'{"images": ["a.jpg"], "top_k": true}', "invalid_request"),
    (b'{"images": ["a.jpg"], "partial": "yes"}', "invalid_request"),
])
def test_malformed_requests_are_400(raw: bytes, code: str) -> None:
    with pytest.raises(RequestError) as exc:
        parse_json(raw, S)
    assert exc.value.code == code and exc.value.status_code == 400


def test_too_many_images_is_413() -> None:
    with pytest.raises(PayloadTooLarge) as exc:
        parse_json(body(images=["a.jpg"] * 4), S)
    assert exc.value.code == "too_many_images"


def test_form_files_and_options() -> None:
    req = parse_form({"top_k": "2", "partial": "true"}, [("a.jpg", b"1"), ("", b"2")], S)
    assert [r.name for r in req.refs] == ["a.jpg", "upload-1"]
    assert req.top_k == 2 and req.partial is True


def test_form_without_files_is_400() -> None:
    with pytest.raises(RequestError):
        parse_form({}, [], S)


def test_oversized_upload_is_a_per_image_error() -> None:
    req = parse_form({}, [("a.jpg", b"x" * 4096)], S)
    assert req.refs[0].error.code == "image_too_large"  # type: ignore[union-attr]
