"""KServe v1 with a fake model and fetcher: liveness, every instance form, both tasks, the flat error shape."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image

from harness import images
from harness.fakes import FakeFetcher, FakeModel
from service.app import create_app
from service.pipeline.postprocess import label_scores
from service.settings import Settings

BASE = "http://cdn.test/"


def solid(value: int) -> bytes:
    return images.encode(Image.new("RGB", (40, 40), (value, value, value)), "PNG")


def b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode()


def make_client(**settings: object) -> FlaskClient:
    fetcher = FakeFetcher({BASE + f"g{v}.png": solid(v) for v in (10, 100, 200)})
    s = Settings(**{"image_base_url": BASE, "max_images": 8, "max_body_bytes": 64 * 1024, **settings})  # type: ignore[arg-type]
    return create_app(s, model=FakeModel(), fetcher=fetcher).test_client()


@pytest.fixture()
def client() -> FlaskClient:
    return make_client()


def predict(client: FlaskClient, body: object, model: str = "fake", **kw: object):
    return client.post(f"/v1/models/{model}:predict", json=body, **kw)  # type: ignore[arg-type]


def test_root_is_alive(client: FlaskClient) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.json == {"status": "alive", "page": "/ui", "api": "/openapi.json", "ready": "/readyz"}


def test_every_instance_form_is_an_image() -> None:
    """Each form names a solid grey whose brightness picks the fake model's class (value // 26)."""
    client = make_client(max_images=16)
    instances = [
        "g10.png",                                            # a relative name
        BASE + "g200.png",                                    # a URL
        "data:image/png;base64," + b64(solid(100)),           # a data: URL
        {"b64": b64(solid(200))},                             # TF Serving's bytes
        {"image": {"b64": b64(solid(10))}, "key": "k1"},      # one key holding {"b64"}, extra keys ignored
        {"image_bytes": {"b64": b64(solid(100))}},
        {"data": b64(solid(200)), "target": 0},               # TorchServe-on-KServe
        {"data": BASE + "g10.png"},                           # "data" that is a URL
        {"url": "g100.png"},
    ]
    r = predict(client, {"instances": instances, "top_k": 1})
    assert r.status_code == 200, r.json
    assert [list(p) for p in r.json["predictions"]] == [
        ["label0"], ["label7"], ["label3"], ["label7"], ["label0"], ["label3"], ["label7"], ["label0"], ["label3"]]


def test_predictions_equal_native_classify(client: FlaskClient) -> None:
    native = client.post("/v1/classify", json={"images": ["g100.png", "g200.png"], "top_k": 4}).json["data"]
    r = predict(client, {"instances": ["g100.png", "g200.png"], "top_k": 4})
    expected = [{item["label"]: item["score"] for item in d["labels"]} for d in native]
    assert r.json["predictions"] == expected
    for p in r.json["predictions"]:
        assert list(p.values()) == sorted(p.values(), reverse=True)


def test_default_top_k_is_five(client: FlaskClient) -> None:
    assert len(predict(client, {"instances": ["g10.png"]}).json["predictions"][0]) == 5


def test_inputs_is_an_alias_of_instances(client: FlaskClient) -> None:
    r = predict(client, {"inputs": ["g10.png"], "top_k": 2})
    assert r.status_code == 200 and r.json == predict(client, {"instances": ["g10.png"], "top_k": 2}).json


def test_embedding_model_returns_vectors(client: FlaskClient) -> None:
    r = predict(client, {"instances": ["g10.png", {"b64": b64(solid(200))}]}, model="fake-embedding")
    assert r.status_code == 200, r.json
    vectors = r.json["predictions"]
    assert [len(v) for v in vectors] == [6, 6]
    assert all(np.linalg.norm(v) == pytest.approx(1.0, abs=1e-5) for v in vectors)


def test_embedding_normalize_false_equals_native(client: FlaskClient) -> None:
    native = client.post("/v1/embeddings", json={"images": ["g100.png"], "normalize": False}).json["data"]
    r = predict(client, {"instances": ["g100.png"], "normalize": False}, model="fake-embedding")
    np.testing.assert_allclose(r.json["predictions"][0], native[0]["embedding"], atol=1e-6)


def test_content_type_is_ignored(client: FlaskClient) -> None:
    r = client.post("/v1/models/fake:predict", data=b'{"instances": ["g10.png"]}', content_type="text/plain")
    assert r.status_code == 200 and len(r.json["predictions"]) == 1


def test_wrapped_base64_decodes(client: FlaskClient) -> None:
    text = b64(solid(200))
    wrapped = "\n".join(text[i:i + 76] for i in range(0, len(text), 76)) + "\n"  # what `base64 a.png` prints
    r = predict(client, {"instances": [{"b64": wrapped}, {"data": wrapped}], "top_k": 1})
    assert r.status_code == 200, r.json
    assert [list(p) for p in r.json["predictions"]] == [["label7"], ["label7"]]


def test_unknown_model_is_404_with_error_string(client: FlaskClient) -> None:
    r = predict(client, {"instances": ["g10.png"]}, model="nope")
    assert r.status_code == 404
    assert isinstance(r.json["error"], str) and "fake-embedding" in r.json["error"]
    assert r.json["code"] == "model_not_found" and r.json["request_id"] == r.headers["X-Request-ID"]


def test_bad_image_is_422_with_details(client: FlaskClient) -> None:
    r = predict(client, {"instances": ["g10.png", {"b64": b64(b"not an image")}]})
    assert r.status_code == 422
    assert r.json["code"] == "not_an_image" and isinstance(r.json["error"], str)
    assert [(d["index"], d["code"]) for d in r.json["details"]] == [(1, "not_an_image")]


def test_invalid_base64_is_422(client: FlaskClient) -> None:
    r = predict(client, {"instances": [{"b64": "%%%"}]})
    assert r.status_code == 422 and r.json["code"] == "invalid_base64"


def test_tensor_data_is_400_with_a_hint(client: FlaskClient) -> None:
    r = predict(client, {"instances": [{"data": [[0.1, 0.2], [0.3, 0.4]]}]})
    assert r.status_code == 400 and "base64" in r.json["error"]


BAD_BODIES = [
    ("empty body", b"", "invalid_json"),
    ("malformed json", b'{"instances": [', "invalid_json"),
    ("not an object", b'["g10.png"]', "invalid_request"),
    ("no instances", b"{}", "invalid_request"),
    ("empty instances", b'{"instances": []}', "invalid_request"),
    ("both lists", b'{"instances": ["g10.png"], "inputs": ["g10.png"]}', "invalid_request"),
    ("columnar inputs", b'{"inputs": {"image": ["g10.png"]}}', "invalid_request"),
    ("unknown field", b'{"instances": ["g10.png"], "topk": 3}', "invalid_request"),
    ("top_k zero", b'{"instances": ["g10.png"], "top_k": 0}', "invalid_request"),
    ("normalize not a bool", b'{"instances": ["g10.png"], "normalize": "yes"}', "invalid_request"),
    ("a number instance", b'{"instances": [42]}', "invalid_request"),
    ("a blank string", b'{"instances": ["  "]}', "invalid_request"),
    ("two images in one instance", b'{"instances": [{"a": {"b64": "AA=="}, "b": {"b64": "AA=="}}]}',
     "invalid_request"),
    ("b64 not a string", b'{"instances": [{"b64": 7}]}', "invalid_request"),
    ("an unknown object", b'{"instances": [{"pixels": "AA=="}]}', "invalid_request"),
]


@pytest.mark.parametrize("name, body, code", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_body_is_400_with_flat_error(client: FlaskClient, name: str, body: bytes, code: str) -> None:
    r = client.post("/v1/models/fake:predict", data=body, content_type="application/json")
    assert r.status_code == 400, r.json
    assert r.json["code"] == code and isinstance(r.json["error"], str) and r.json["error"]


def test_too_many_instances_is_413(client: FlaskClient) -> None:
    r = predict(client, {"instances": ["g10.png"] * 9})
    assert r.status_code == 413 and r.json["code"] == "too_many_images"


def test_body_over_the_limit_is_413_in_the_flat_shape(client: FlaskClient) -> None:
    r = client.post("/v1/models/fake:predict", data=b"x" * (65 * 1024), content_type="application/json")
    assert r.status_code == 413 and r.json["code"] == "body_too_large" and isinstance(r.json["error"], str)


def test_wrong_method_on_predict_is_405_in_the_flat_shape(client: FlaskClient) -> None:
    r = client.put("/v1/models/fake:predict", json={"instances": ["g10.png"]})
    assert r.status_code == 405 and isinstance(r.json["error"], str)


def test_readiness_and_list_are_the_native_routes(client: FlaskClient) -> None:
    assert client.get("/v1/models/fake").json["ready"] is True
    assert client.get("/v1/models").json["models"] == ["fake", "fake-embedding"]


def test_root_stays_open_and_predict_needs_the_token() -> None:
    client = make_client(api_token="s3cret")
    assert client.get("/").status_code == 200
    r = predict(client, {"instances": ["g10.png"]})
    assert r.status_code == 401 and isinstance(r.json["error"], str)
    ok = predict(client, {"instances": ["g10.png"]}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


def test_label_scores_keep_the_best_score_of_a_shared_name() -> None:
    labels = [{"label": "crane", "score": 0.5}, {"label": "heron", "score": 0.3}, {"label": "crane", "score": 0.1}]
    assert list(label_scores(labels).items()) == [("crane", 0.5), ("heron", 0.3)]
