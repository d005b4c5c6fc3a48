"""The one request body reader (``http.body``): every route that takes a body accepts it gzip or deflate
compressed with the same answer as uncompressed, within the body cap; other encodings, a compressed form,
and a compressed stream that is cut short are refused with stable codes, and the worker answers after."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
from flask.testing import FlaskClient

from harness.fakes import BASE, FakeFetcher, FakeModel
from harness.images import solid
from service.app import create_app
from service.settings import Settings

ROUTES = ["/v1/embeddings", "/v1/classify", "/v1/models/fake:predict"]


@pytest.fixture()
def client() -> FlaskClient:
    s = Settings(image_base_url=BASE, max_images=8, max_body_bytes=64 * 1024)
    fetcher = FakeFetcher({BASE + f"g{v}.png": solid(v) for v in (10, 100)})
    return create_app(s, model=FakeModel(), fetcher=fetcher).test_client()


def body_for(path: str) -> bytes:
    doc = {"instances": ["g10.png", {"url": "g100.png"}]} if path.endswith(":predict") else {"images": ["g10.png", "g100.png"]}
    return json.dumps(doc).encode()


def answer(client: FlaskClient, path: str, data: bytes, encoding: str | None) -> dict[str, object]:
    headers = {"Content-Type": "application/json", **({"Content-Encoding": encoding} if encoding else {})}
    r = client.post(path, data=data, headers=headers)
    assert r.status_code == 200, (path, encoding, r.json)
    doc = dict(r.json)
    doc.pop("timings_ms", None), doc.pop("request_id", None)
    return doc


@pytest.mark.parametrize("path", ROUTES)
def test_a_gzip_or_deflate_body_answers_as_the_plain_one(client: FlaskClient, path: str) -> None:
    plain = answer(client, path, body_for(path), None)
    assert answer(client, path, gzip.compress(body_for(path)), "gzip") == plain
    assert answer(client, path, zlib.compress(body_for(path)), "deflate") == plain
    assert answer(client, path, body_for(path), "identity") == plain


def test_torchserve_takes_a_gzipped_image_body(client: FlaskClient) -> None:
    plain = client.post("/predictions/fake", data=solid(10))
    zipped = client.post("/predictions/fake", data=gzip.compress(solid(10)), headers={"Content-Encoding": "GZIP"})
    assert plain.status_code == zipped.status_code == 200 and zipped.json == plain.json


@pytest.mark.parametrize("path", [*ROUTES, "/predictions/fake", "/v2/models/fake/infer"])
def test_other_encodings_are_415_and_the_worker_answers_after(client: FlaskClient, path: str) -> None:
    r = client.post(path, data=body_for(path), headers={"Content-Type": "application/json", "Content-Encoding": "br"})
    assert r.status_code == 415 and "unsupported_content_encoding" in r.text and "gzip, deflate" in r.text
    assert client.post("/v1/embeddings", json={"images": ["g10.png"]}).status_code == 200


def test_a_compressed_form_is_415(client: FlaskClient) -> None:
    r = client.post("/v1/embeddings", data={"images": (iter([solid(10)]), "a.png")},  # type: ignore[dict-item]
                    headers={"Content-Encoding": "gzip"}, content_type="multipart/form-data")
    assert r.status_code == 415 and r.json["error"]["code"] == "unsupported_content_encoding"
    assert "uncompressed" in r.json["error"]["message"]


def test_cut_short_trailing_garbage_and_bombs_are_refused(client: FlaskClient) -> None:
    member = gzip.compress(body_for("/v1/embeddings"))
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    for data in (member[: len(member) // 2], member + b"garbage!", b"not gzip at all"):
        r = client.post("/v1/embeddings", data=data, headers=headers)
        assert r.status_code == 400 and r.json["error"]["code"] == "malformed_body", r.json
    bomb = gzip.compress(b" " * (1 << 20), compresslevel=9)  # 1 MiB of whitespace in ~1 KB: past the 64 KiB cap
    r = client.post("/v1/embeddings", data=member + bomb, headers=headers)
    assert r.status_code == 413 and r.json["error"]["code"] == "body_too_large"
    assert client.post("/v1/embeddings", data=member, headers=headers).status_code == 200
