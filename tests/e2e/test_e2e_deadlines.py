"""A request deadline that runs out while its images are being fetched answers 504 ``deadline_exceeded`` in
each protocol's error shape, as a deadline anywhere else does (it was 422 ``fetch_timeout`` for the image),
and the same worker answers afterwards. A deadline already passed when the request arrives is 504 at once,
its image in the embedding cache or not. An image host slower than GREENSERVE_FETCH_TIMEOUT_S, within the
request's deadline, is still that image's 422."""

from __future__ import annotations

import time

import pytest
import requests

from harness.launch import GunicornServer
from harness.servers import E2E_MODEL

pytestmark = pytest.mark.e2e
SLOW = "img006.jpg?delay=1.5&deadline=1"  # the e2e servers' fetch timeout is 2 s: only the deadline cuts it
LATE = {"X-Request-Timeout": "0.4", "Cache-Control": "no-store"}


@pytest.mark.parametrize(("path", "body", "error_of"), [
    ("/v1/embeddings", {"images": [SLOW]}, lambda j: j["error"]["code"]),
    ("/v1/embeddings", {"images": ["img000.jpg", SLOW], "partial": True}, lambda j: j["error"]["code"]),
    ("/v1/classify", {"images": [SLOW]}, lambda j: j["error"]["code"]),
    (f"/v1/models/{E2E_MODEL}:predict", {"instances": [SLOW]}, lambda j: j["error"]),  # KServe v1: a string
], ids=["native", "native partial", "classify", "kserve v1"])
def test_a_deadline_passing_in_the_fetch_is_504(server: GunicornServer, path: str, body: dict, error_of) -> None:
    pids = server.worker_pids()
    r = requests.post(server.url + path, json=body, headers=LATE, timeout=30)
    assert r.status_code == 504, r.text
    if path.startswith("/v1/models/"):
        assert "deadline" in error_of(r.json())
    else:
        assert error_of(r.json()) == "deadline_exceeded"
    ok = requests.post(server.url + "/v1/embeddings", json={"images": ["img000.jpg"]}, timeout=30)
    assert ok.status_code == 200 and int(ok.headers["X-Worker-PID"]) in pids


def test_a_slow_host_within_the_deadline_is_still_the_images_422(server: GunicornServer) -> None:
    r = requests.post(server.url + "/v1/embeddings", json={"images": ["img006.jpg?delay=3&slow=1"]},
                      headers={"X-Request-Timeout": "20"}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["details"][0]["code"] == "fetch_timeout", r.text


def oip_body(**parameters: object) -> dict[str, object]:
    inputs = [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["img001.jpg"],
               "parameters": {"content_type": "url"}}]  # a relative name, not base64
    return {"inputs": inputs, **({"parameters": parameters} if parameters else {})}


@pytest.mark.parametrize(("path", "body", "passed"), [
    ("/v1/embeddings", {"images": ["img001.jpg"]}, {"headers": {"X-Request-Timeout": "1e-9"}}),
    (f"/v2/models/{E2E_MODEL}/infer", oip_body(), {"json": oip_body(timeout=1)}),  # OIP: 1 µs
], ids=["native X-Request-Timeout 1e-9", "OIP timeout of 1 µs"])
def test_a_deadline_already_passed_is_504_at_once_even_from_the_cache(server: GunicornServer, path: str, body: dict,
                                                                      passed: dict) -> None:
    pids = server.worker_pids()
    for _ in range(len(pids)):  # each worker answers it once: its image is in the embedding cache
        assert requests.post(server.url + path, json=body, timeout=30).status_code == 200
    t0 = time.monotonic()
    r = requests.post(server.url + path, **{"json": body, "timeout": 30, **passed})
    took = time.monotonic() - t0
    print(f"\n{path}: {r.status_code} after {took * 1000:.0f} ms")
    assert r.status_code == 504 and "deadline" in r.text, r.text
    assert took < 0.5 and int(r.headers["X-Worker-PID"]) in pids
    ok = requests.post(server.url + "/v1/embeddings", json={"images": ["img000.jpg"]}, timeout=30)
    assert ok.status_code == 200 and int(ok.headers["X-Worker-PID"]) in pids
