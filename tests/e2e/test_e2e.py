"""End to end: a real gunicorn -k gevent greenserve (2 workers, resnet18 from a saved state dict) and a
real local image host. Every input mode, every bad-input class, and the workers surviving them."""

from __future__ import annotations

import base64
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from harness import images
from harness.imagehost import ImageHost
from harness.launch import GunicornServer, free_port
from harness.servers import e2e_env

pytestmark = pytest.mark.e2e
TIMEOUT = 60


def post(server: GunicornServer, path: str, **kw: object) -> requests.Response:
    return requests.post(server.url + path, timeout=TIMEOUT, **kw)  # type: ignore[arg-type]


def test_embeddings_have_model_dimension_and_unit_norm(server: GunicornServer) -> None:
    r = post(server, "/v1/embeddings", json={"images": ["img000.jpg", "img001.jpg"]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 2
    for item in data:
        assert len(item["embedding"]) == 512
        assert np.linalg.norm(item["embedding"]) == pytest.approx(1.0, abs=1e-4)
    assert not np.allclose(data[0]["embedding"], data[1]["embedding"])


def test_same_image_same_embedding_from_either_worker(server: GunicornServer) -> None:
    by_pid: dict[str, list[float]] = {}

    def embed() -> None:  # each worker's own forward, not an entry of the cache they share
        r = post(server, "/v1/embeddings", json={"images": ["img003.jpg"]}, headers={"Cache-Control": "no-cache"})
        by_pid.setdefault(r.headers["X-Worker-PID"], r.json()["data"][0]["embedding"])

    # Two at once: the accept gate sends the second connection to the worker without one in progress (one at a
    # time, both workers are idle at each connect and the kernel may wake the same one every time).
    for _ in range(10):
        pair = [threading.Thread(target=embed) for _ in range(2)]
        for t in pair:
            t.start()
        for t in pair:
            t.join()
        if len(by_pid) == 2:
            break
    assert len(by_pid) == 2, "only one worker answered 10 pairs of concurrent connections"
    a, b = by_pid.values()
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_classify_top_k_sorted_with_imagenet_names(server: GunicornServer) -> None:
    r = post(server, "/v1/classify", json={"images": ["img002.jpg"], "top_k": 4})
    labels = r.json()["data"][0]["labels"]
    assert len(labels) == 4
    assert [item["score"] for item in labels] == sorted((item["score"] for item in labels), reverse=True)
    imagenet = requests.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]
    assert imagenet["labels_count"] == 1000
    assert all(isinstance(item["label"], str) and not item["label"].startswith("class_") for item in labels)


def test_all_input_modes_agree(server: GunicornServer, image_host: ImageHost, album: dict[str, bytes]) -> None:
    blob = album["img004.jpg"]
    by_url = post(server, "/v1/embeddings", json={"images": [image_host.url("img004.jpg")]})
    by_name = post(server, "/v1/embeddings", json={"images": ["img004.jpg"]})
    by_data = post(server, "/v1/embeddings",
                   json={"images": ["data:image/jpeg;base64," + base64.b64encode(blob).decode()]})
    by_file = post(server, "/v1/embeddings", files=[("images", ("img004.jpg", blob, "image/jpeg"))])
    vectors = []
    for r in (by_url, by_name, by_data, by_file):
        assert r.status_code == 200, r.text
        vectors.append(r.json()["data"][0]["embedding"])
    for v in vectors[1:]:
        np.testing.assert_allclose(v, vectors[0], atol=1e-5)


def test_multipart_several_files_with_options(server: GunicornServer, album: dict[str, bytes]) -> None:
    files = [("images", (f"img00{i}.jpg", album[f"img00{i}.jpg"], "image/jpeg")) for i in range(3)]
    r = post(server, "/v1/classify", files=files, data={"top_k": "2"})
    assert r.status_code == 200, r.text
    assert [d["image"] for d in r.json()["data"]] == ["img000.jpg", "img001.jpg", "img002.jpg"]
    assert all(len(d["labels"]) == 2 for d in r.json()["data"])


BAD_INPUTS = [
    ("empty file", {"json": {"images": ["empty.jpg"]}}, 422, "empty_image"),
    ("truncated jpeg", {"json": {"images": ["truncated.jpg"]}}, 422, "truncated_image"),
    ("html served as jpg", {"json": {"images": ["page.jpg"]}}, 422, "not_an_image"),
    ("pixel bomb", {"json": {"images": ["bomb.png"]}}, 413, "image_too_large"),
    ("unsupported format", {"json": {"images": ["scan.tif"]}}, 415, "unsupported_image_format"),
    ("too many images", {"json": {"images": ["img000.jpg"] * 41}}, 413, "too_many_images"),
    ("body too large", {"data": b"x" * (9 * 1024 * 1024), "headers": {"Content-Type": "application/json"}},
     413, "body_too_large"),
    ("malformed json", {"data": b'{"images": [', "headers": {"Content-Type": "application/json"}}, 400,
     "invalid_json"),
    ("404 from image host", {"json": {"images": ["nope.jpg"]}}, 422, "fetch_failed"),
    ("slow image host", {"json": {"images": ["img000.jpg?delay=4"]}}, 422, "fetch_timeout"),
    ("wrong content type header", {"data": b"{}", "headers": {"Content-Type": "text/csv"}}, 415,
     "unsupported_content_type"),
    ("broken data url", {"json": {"images": ["data:image/png;base64,%%%"]}}, 422, "invalid_data_url"),
    ("file url", {"json": {"images": ["file:///etc/passwd"]}}, 422, "invalid_url"),
    ("unknown field", {"json": {"images": ["img000.jpg"], "topk": 3}}, 400, "invalid_request"),
    ("top_k out of range", {"json": {"images": ["img000.jpg"], "top_k": 0}}, 400, "invalid_request"),
    ("bad deadline header", {"json": {"images": ["img000.jpg"]}, "headers": {"X-Request-Timeout": "soon"}}, 400,
     "invalid_request"),
]


@pytest.mark.parametrize("name, kwargs, status, code", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_status_and_code(server: GunicornServer, name: str, kwargs: dict, status: int,
                                        code: str) -> None:
    r = post(server, "/v1/embeddings", **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    assert body["request_id"] == r.headers["X-Request-ID"]


def test_unreachable_url_is_fetch_failed(unreachable_server: GunicornServer, unreachable_url: str) -> None:
    r = post(unreachable_server, "/v1/embeddings", json={"images": [unreachable_url]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "fetch_failed"


def test_workers_survive_every_bad_input(server: GunicornServer, image_host: ImageHost) -> None:
    before = server.worker_pids()
    for _, kwargs, _, _ in BAD_INPUTS:
        post(server, "/v1/classify", **kwargs)
    partial = post(server, "/v1/embeddings", json={"images": ["img000.jpg", "page.jpg", "bomb.png"], "partial": True})
    assert partial.status_code == 200
    assert [e["code"] for e in partial.json()["errors"]] == ["not_an_image", "image_too_large"]
    assert server.worker_pids() == before
    assert server.healthz_pids() == before
    assert "WORKER TIMEOUT" not in server.log() and "Traceback" not in server.log()


@pytest.fixture(scope="module")
def unreachable_url() -> str:
    return f"http://127.0.0.1:{free_port()}/gone.jpg"  # nothing listens there


@pytest.fixture(scope="module")
def unreachable_server(weights_file: Path, image_host: ImageHost, unreachable_url: str):
    origin = unreachable_url.rsplit("/", 1)[0]
    with GunicornServer(e2e_env(weights_file, image_host, GREENSERVE_FETCH_ALLOW=origin), workers=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def one_worker(weights_file: Path, image_host: ImageHost):
    with GunicornServer(e2e_env(weights_file, image_host, GREENSERVE_MAX_BATCH="64"), workers=1) as srv:
        yield srv


def test_hub_answers_healthz_while_model_busy(one_worker: GunicornServer, album: dict[str, bytes]) -> None:
    """Functional check with a wide margin: the same worker answers /healthz during a long inference."""
    blob = "data:image/jpeg;base64," + base64.b64encode(images.jpeg(256, 256, seed=5)).decode()
    done = threading.Event()
    result: dict[str, object] = {}

    def long_request() -> None:
        r = post(one_worker, "/v1/embeddings", json={"images": [blob] * 40})
        result["status"], result["timings"] = r.status_code, r.json().get("timings_ms")
        done.set()

    threading.Thread(target=long_request, daemon=True).start()
    time.sleep(0.3)
    latencies = []
    while not done.is_set() and len(latencies) < 200:
        t0 = time.perf_counter()
        r = requests.get(one_worker.url + "/healthz", timeout=10)
        latencies.append(time.perf_counter() - t0)
        assert r.status_code == 200
        time.sleep(0.02)
    done.wait(TIMEOUT)
    assert result["status"] == 200
    assert len(latencies) >= 3, f"inference finished too fast to probe: {result['timings']}"
    assert max(latencies) < 1.0, f"/healthz took {max(latencies):.2f}s while the model was busy"


def test_upstream_status_is_reported_per_image(server: GunicornServer) -> None:
    r = post(server, "/v1/embeddings", json={"images": ["img000.jpg", "nope.jpg"], "partial": True})
    assert r.status_code == 200
    (error,) = r.json()["errors"]
    assert error["code"] == "fetch_failed" and error["upstream_status"] == 404 and error["index"] == 1
