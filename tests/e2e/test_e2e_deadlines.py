"""A request deadline that runs out while its images are being fetched answers 504 ``deadline_exceeded`` in
each protocol's error shape, as a deadline anywhere else does (it was 422 ``fetch_timeout`` for the image),
and the same worker answers afterwards. An image host slower than GREENSERVE_FETCH_TIMEOUT_S, within the
request's deadline, is still that image's 422."""

from __future__ import annotations

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
