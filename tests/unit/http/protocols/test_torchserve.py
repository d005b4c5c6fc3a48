"""TorchServe's API with a fake model: /ping, raw and multipart /predictions, the read-only /models, errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image

from harness import images
from harness.fakes import FakeFetcher, FakeModel
from service.app import create_app
from service.settings import Settings


def solid(value: int) -> bytes:
    return images.encode(Image.new("RGB", (40, 40), (value, value, value)), "PNG")


def make_client(**settings: object) -> FlaskClient:
    s = Settings(**{"max_images": 8, "max_body_bytes": 64 * 1024, "workers": 3, "max_queue_images": 50,
                    **settings})  # type: ignore[arg-type]
    return create_app(s, model=FakeModel(), fetcher=FakeFetcher({})).test_client()


@pytest.fixture()
def client() -> FlaskClient:
    return make_client()


def files(*blobs: bytes, field: str = "data") -> dict[str, object]:
    return {field: [(io.BytesIO(b), f"f{i}.png") for i, b in enumerate(blobs)]}


def test_ping_is_healthy_when_the_model_is_loaded(client: FlaskClient) -> None:
    r = client.get("/ping")
    assert r.status_code == 200 and r.json == {"status": "Healthy"}


def test_ping_is_500_unhealthy_while_loading(client: FlaskClient) -> None:
    client.application.extensions["greenserve"].runner.model = None  # as before the model has loaded
    r = client.get("/ping")
    assert r.status_code == 500 and r.json == {"status": "Unhealthy"}


@pytest.mark.parametrize("method", ["post", "put"])
@pytest.mark.parametrize("content_type", [None, "image/png", "application/octet-stream",
                                          "application/x-www-form-urlencoded"])
def test_raw_body_is_one_image_whatever_its_content_type(client: FlaskClient, method: str,
                                                         content_type: str | None) -> None:
    r = getattr(client, method)("/predictions/fake", data=solid(200), content_type=content_type)
    assert r.status_code == 200, r.json
    assert isinstance(r.json, dict) and len(r.json) == 5 and next(iter(r.json)) == "label7"
    assert list(r.json.values()) == sorted(r.json.values(), reverse=True)


def test_answer_equals_native_classify(client: FlaskClient) -> None:
    native = client.post("/v1/classify", data=files(solid(100), field="images"), content_type="multipart/form-data")
    expected = {item["label"]: item["score"] for item in native.json["data"][0]["labels"]}
    assert client.put("/predictions/fake", data=solid(100)).json == expected


def test_multipart_data_field_and_version_one(client: FlaskClient) -> None:
    for path in ("/predictions/fake", "/predictions/fake/1"):
        r = client.post(path, data=files(solid(10)), content_type="multipart/form-data")
        assert r.status_code == 200, r.json
        assert next(iter(r.json)) == "label0"


def test_several_files_answer_a_list_in_order(client: FlaskClient) -> None:
    r = client.post("/predictions/fake", data=files(solid(10), solid(200), solid(100)),
                    content_type="multipart/form-data")
    assert r.status_code == 200, r.json
    assert [next(iter(d)) for d in r.json] == ["label0", "label7", "label3"]


def test_images_field_is_accepted_too(client: FlaskClient) -> None:
    r = client.post("/predictions/fake", data=files(solid(200), field="images"), content_type="multipart/form-data")
    assert r.status_code == 200 and next(iter(r.json)) == "label7"


def test_top_k_query_parameter(client: FlaskClient) -> None:
    assert len(client.put("/predictions/fake?top_k=3", data=solid(10)).json) == 3


def test_embedding_model_returns_floats(client: FlaskClient) -> None:
    one = client.put("/predictions/fake-embedding", data=solid(100)).json
    assert len(one) == 6 and np.linalg.norm(one) == pytest.approx(1.0, abs=1e-5)
    raw = client.put("/predictions/fake-embedding?normalize=false", data=solid(100)).json
    assert np.linalg.norm(raw) > 1.5
    two = client.post("/predictions/fake-embedding", data=files(solid(10), solid(200)),
                      content_type="multipart/form-data").json
    assert [len(v) for v in two] == [6, 6]


def test_unknown_model_is_404_model_not_found(client: FlaskClient) -> None:
    r = client.put("/predictions/nope", data=solid(10))
    assert r.status_code == 404
    assert r.json["code"] == 404 and r.json["type"] == "ModelNotFoundException"
    assert r.json["error_code"] == "model_not_found" and r.json["message"]
    assert r.json["request_id"] == r.headers["X-Request-ID"]


def test_unknown_version_is_404(client: FlaskClient) -> None:
    r = client.put("/predictions/fake/2.0", data=solid(10))
    assert r.status_code == 404 and r.json["type"] == "ModelNotFoundException"


def test_non_image_is_422_image_error_with_details(client: FlaskClient) -> None:
    r = client.put("/predictions/fake", data=images.HTML)
    assert r.status_code == 422
    assert r.json["code"] == 422 and r.json["type"] == "ImageError" and r.json["error_code"] == "not_an_image"
    assert [(d["index"], d["image"]) for d in r.json["details"]] == [(0, "body")]


def test_unsupported_image_format_is_415_image_error(client: FlaskClient) -> None:
    r = client.put("/predictions/fake", data=images.tiff())
    assert r.status_code == 415 and r.json["type"] == "ImageError"


def test_json_body_is_415_with_a_hint(client: FlaskClient) -> None:
    r = client.post("/predictions/fake", json={"data": "https://example.com/a.jpg"})
    assert r.status_code == 415 and r.json["type"] == "UnsupportedMediaTypeException"
    assert "/v1/classify" in r.json["message"]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"data": b""}, "empty"),
    ({"data": {"text": "no file"}, "content_type": "multipart/form-data"}, "no files"),
    ({"data": files(solid(10), field="photo"), "content_type": "multipart/form-data"}, "photo"),
])
def test_missing_image_is_400(client: FlaskClient, kwargs: dict, fragment: str) -> None:
    r = client.post("/predictions/fake", **kwargs)
    assert r.status_code == 400 and r.json["type"] == "BadRequestException" and fragment in r.json["message"]


@pytest.mark.parametrize("query", ["top_k=0", "top_k=many", "normalize=maybe"])
def test_bad_query_option_is_400(client: FlaskClient, query: str) -> None:
    r = client.put(f"/predictions/fake?{query}", data=solid(10))
    assert r.status_code == 400 and r.json["type"] == "BadRequestException"


def test_too_many_files_and_too_big_bodies_are_413(client: FlaskClient) -> None:
    r = client.post("/predictions/fake", data=files(*[solid(10)] * 9), content_type="multipart/form-data")
    assert r.status_code == 413 and r.json["error_code"] == "too_many_images"
    r = client.put("/predictions/fake", data=b"\xff" * (65 * 1024))
    assert r.status_code == 413 and r.json["code"] == 413 and r.json["error_code"] == "body_too_large"


def test_get_on_predictions_is_405_in_torchserve_shape(client: FlaskClient) -> None:
    r = client.get("/predictions/fake")
    assert r.status_code == 405 and r.json["type"] == "MethodNotAllowedException"


def test_list_models(client: FlaskClient) -> None:
    r = client.get("/models")
    assert r.status_code == 200
    assert r.json == {"models": [{"modelName": "fake", "modelUrl": "random"},
                                 {"modelName": "fake-embedding", "modelUrl": "random"}]}


def test_describe_model(client: FlaskClient) -> None:
    for path in ("/models/fake", "/models/fake/1", "/models/fake/all", "/models/fake-embedding"):
        r = client.get(path)
        assert r.status_code == 200, (path, r.json)
        (desc,) = r.json
        assert desc["modelName"] == path.split("/")[2] and desc["modelVersion"] == "1"
        assert (desc["engine"], desc["runtime"], desc["modelUrl"]) == ("greenserve", "python", "random")
        assert (desc["minWorkers"], desc["maxWorkers"], desc["batchSize"], desc["maxBatchDelay"]) == (3, 3, 32, 40.0)
        assert desc["jobQueueStatus"] == {"remainingCapacity": 50, "pendingRequests": 0}
        (worker,) = desc["workers"]
        assert worker["status"] == "READY" and worker["pid"] == int(r.headers["X-Worker-PID"])
    assert client.get("/models/nope").json["type"] == "ModelNotFoundException"
    assert client.get("/models/fake/7").status_code == 404


@pytest.mark.parametrize("method, path", [("post", "/models?url=x.mar"), ("put", "/models/fake?min_worker=3"),
                                          ("delete", "/models/fake"), ("delete", "/models/fake/1"),
                                          ("put", "/models/fake/1/set-default")])
def test_management_writes_are_405(client: FlaskClient, method: str, path: str) -> None:
    r = getattr(client, method)(path)
    assert r.status_code == 405 and r.json["type"] == "MethodNotAllowedException"
    assert "read-only" in r.json["message"] and r.headers["Allow"] == "GET, HEAD"


def test_ping_stays_open_and_the_rest_needs_the_token() -> None:
    client = make_client(api_token="s3cret")
    assert client.get("/ping").status_code == 200
    r = client.put("/predictions/fake", data=solid(10))
    assert r.status_code == 401 and r.json["type"] == "InvalidKeyException"
    assert client.get("/models").status_code == 401
    ok = client.put("/predictions/fake", data=solid(10), headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
