"""End to end, KServe v1 and TorchServe clients' requests (plain ``requests``: the ``kserve`` package drags in
grpcio, kubernetes and pandas, and TorchServe has no client library) against a real gunicorn -k gevent
greenserve (2 workers, resnet18) and a real image host, compared with the native endpoints."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from harness.launch import GunicornServer
from harness.servers import GUARD_TOKEN as TOKEN

pytestmark = pytest.mark.e2e
TIMEOUT = 60
NAMES = ["img000.jpg", "img001.jpg", "img002.jpg", "img003.jpg"]
# one request's images may be batched differently from another's (and a worker may borrow idle cores), so
# the same image's scores, rounded to 6 decimals, can differ in their last digit
SCORE_ATOL = 2e-6


def post(server: GunicornServer, path: str, **kw: Any) -> requests.Response:
    return requests.post(server.url + path, timeout=TIMEOUT, **kw)


def b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode()


def native_labels(server: GunicornServer, names: list[str], top_k: int = 5) -> list[list[dict[str, Any]]]:
    r = post(server, "/v1/classify", json={"images": names, "top_k": top_k})
    assert r.status_code == 200, r.text
    return [d["labels"] for d in r.json()["data"]]


def assert_scores_match(got: dict[str, float], labels: list[dict[str, Any]]) -> None:
    """``{label: score}`` best first, as the native top-k (a name two classes share keeps its best score)."""
    expected: dict[str, float] = {}
    for item in labels:
        expected.setdefault(item["label"], item["score"])
    assert list(got) == list(expected)
    np.testing.assert_allclose(list(got.values()), list(expected.values()), atol=SCORE_ATOL)
    assert list(got.values()) == sorted(got.values(), reverse=True)


def assert_workers_still_answer(server: GunicornServer, before: set[int]) -> None:
    assert server.worker_pids() == before
    answered = {int(post(server, "/v1/classify", json={"images": ["img000.jpg"]}).headers["X-Worker-PID"])
                for _ in range(6)}
    assert answered <= before
    assert server.healthz_pids() == before
    assert "Traceback" not in server.log()


# ---------------------------------------------------------------------- KServe v1


def test_kserve_root_is_alive(server: GunicornServer) -> None:
    r = requests.get(server.url + "/", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"status": "alive", "page": "/ui", "api": "/openapi.json", "ready": "/readyz"}


def test_kserve_model_is_ready(server: GunicornServer) -> None:
    for name in ("resnet18", "resnet18-embedding"):
        r = requests.get(f"{server.url}/v1/models/{name}", timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["ready"] is True and r.json()["name"] == name


def kserve_instances(album: dict[str, bytes]) -> list[Any]:
    return [{"image": {"b64": b64(album["img000.jpg"])}}, {"data": b64(album["img001.jpg"])},
            {"b64": b64(album["img002.jpg"])}, "img003.jpg"]


def test_kserve_predict_equals_native_classify(server: GunicornServer, album: dict[str, bytes]) -> None:
    r = post(server, "/v1/models/resnet18:predict", json={"instances": kserve_instances(album)})
    assert r.status_code == 200, r.text
    predictions = r.json()["predictions"]
    assert len(predictions) == 4
    for got, labels in zip(predictions, native_labels(server, NAMES), strict=True):
        assert len(got) == 5
        assert_scores_match(got, labels)


def test_kserve_embedding_predict_equals_native_embeddings(server: GunicornServer, album: dict[str, bytes]) -> None:
    r = post(server, "/v1/models/resnet18-embedding:predict", json={"instances": kserve_instances(album)})
    assert r.status_code == 200, r.text
    vectors = np.array(r.json()["predictions"])
    native = post(server, "/v1/embeddings", json={"images": NAMES}).json()["data"]
    assert vectors.shape == (4, 512)
    np.testing.assert_allclose(vectors, [d["embedding"] for d in native], atol=1e-6)


def test_kserve_unknown_model_is_404_with_an_error_string(server: GunicornServer) -> None:
    r = post(server, "/v1/models/nope:predict", json={"instances": ["img000.jpg"]})
    assert r.status_code == 404
    assert isinstance(r.json()["error"], str) and "resnet18" in r.json()["error"]
    assert r.json()["code"] == "model_not_found"


def test_kserve_bad_image_is_422_and_workers_survive(server: GunicornServer) -> None:
    before = server.worker_pids()
    r = post(server, "/v1/models/resnet18:predict", json={"instances": ["img000.jpg", {"b64": b64(b"not an image")}]})
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "not_an_image" and isinstance(r.json()["error"], str)
    assert r.json()["details"][0]["index"] == 1
    assert_workers_still_answer(server, before)


# ---------------------------------------------------------------------- TorchServe


def test_torchserve_ping_is_healthy(server: GunicornServer) -> None:
    r = requests.get(server.url + "/ping", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"status": "Healthy"}


def test_torchserve_raw_and_multipart_equal_native_classify(server: GunicornServer, album: dict[str, bytes]) -> None:
    blob = album["img004.jpg"]
    (labels,) = native_labels(server, ["img004.jpg"])
    answers = [
        requests.put(server.url + "/predictions/resnet18", data=blob, timeout=TIMEOUT),  # what curl -T sends
        post(server, "/predictions/resnet18", data=blob),
        post(server, "/predictions/resnet18", files={"data": ("img004.jpg", blob, "image/jpeg")}),
        post(server, "/predictions/resnet18/1", files={"data": ("img004.jpg", blob, "image/jpeg")}),
    ]
    for r in answers:
        assert r.status_code == 200, r.text
        assert isinstance(r.json(), dict) and len(r.json()) == 5
        assert_scores_match(r.json(), labels)


def test_torchserve_two_files_answer_a_list(server: GunicornServer, album: dict[str, bytes]) -> None:
    files = [("data", (name, album[name], "image/jpeg")) for name in NAMES[:2]]
    r = post(server, "/predictions/resnet18", files=files)
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2
    for got, labels in zip(r.json(), native_labels(server, NAMES[:2]), strict=True):
        assert_scores_match(got, labels)


def test_torchserve_top_k_query(server: GunicornServer, album: dict[str, bytes]) -> None:
    r = post(server, "/predictions/resnet18?top_k=3", data=album["img005.jpg"])
    assert r.status_code == 200 and len(r.json()) == 3


def test_torchserve_embedding(server: GunicornServer, album: dict[str, bytes]) -> None:
    r = requests.put(server.url + "/predictions/resnet18-embedding", data=album["img001.jpg"], timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    vector = r.json()
    assert len(vector) == 512 and all(isinstance(x, float) for x in vector)
    native = post(server, "/v1/embeddings", json={"images": ["img001.jpg"]}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(vector, native, atol=1e-6)


def test_torchserve_unknown_model_is_404(server: GunicornServer, album: dict[str, bytes]) -> None:
    r = post(server, "/predictions/nope", data=album["img000.jpg"])
    assert r.status_code == 404
    assert r.json()["code"] == 404 and r.json()["type"] == "ModelNotFoundException" and r.json()["message"]


def test_torchserve_non_image_is_422_and_workers_survive(server: GunicornServer, album: dict[str, bytes]) -> None:
    before = server.worker_pids()
    r = post(server, "/predictions/resnet18", data=album["page.jpg"])
    assert r.status_code == 422, r.text
    assert (r.json()["code"], r.json()["type"], r.json()["error_code"]) == (422, "ImageError", "not_an_image")
    assert_workers_still_answer(server, before)


def test_torchserve_models_list_and_description(server: GunicornServer, weights_file: Path) -> None:
    r = requests.get(server.url + "/models", timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.json() == {"models": [{"modelName": "resnet18", "modelUrl": str(weights_file)},
                                   {"modelName": "resnet18-embedding", "modelUrl": str(weights_file)}]}
    r = requests.get(server.url + "/models/resnet18", timeout=TIMEOUT)
    assert r.status_code == 200
    (desc,) = r.json()
    assert {k: desc[k] for k in ("modelName", "modelVersion", "modelUrl", "engine", "runtime", "minWorkers",
                                 "maxWorkers", "batchSize")} == {
        "modelName": "resnet18", "modelVersion": "1", "modelUrl": str(weights_file), "engine": "greenserve",
        "runtime": "python", "minWorkers": 2, "maxWorkers": 2, "batchSize": 32}
    assert isinstance(desc["maxBatchDelay"], (int, float))
    assert desc["workers"][0]["pid"] == int(r.headers["X-Worker-PID"]) and desc["workers"][0]["status"] == "READY"
    assert set(desc["jobQueueStatus"]) == {"remainingCapacity", "pendingRequests"}
    assert requests.delete(server.url + "/models/resnet18", timeout=TIMEOUT).status_code == 405


# ---------------------------------------------------------------------- auth


def test_health_routes_are_open_and_inference_needs_the_token(guarded: GunicornServer,
                                                              album: dict[str, bytes]) -> None:
    url = guarded.url
    assert requests.get(url + "/ping", timeout=TIMEOUT).status_code == 200
    assert requests.get(url + "/", timeout=TIMEOUT).status_code == 200
    auth = {"Authorization": f"Bearer {TOKEN}"}
    calls = [lambda **kw: requests.put(url + "/predictions/resnet18", data=album["img000.jpg"], timeout=TIMEOUT, **kw),
             lambda **kw: requests.post(url + "/v1/models/resnet18:predict", json={"instances": ["img000.jpg"]},
                                        timeout=TIMEOUT, **kw)]
    for call in calls:
        refused = call()
        assert refused.status_code == 401, refused.text
        assert call(headers=auth).status_code == 200
