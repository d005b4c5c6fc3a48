"""The per-caller share on a real gunicorn -k gevent worker: while one caller has its share in flight, its
next request is 429 over_share with Retry-After (JSON, its code), another caller is served, and the same
worker serves the first caller again once its images are done."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from tests.conftest import e2e_env

pytestmark = pytest.mark.e2e
TIMEOUT = 60


def test_a_caller_over_its_share_is_429_and_others_and_later_it_are_served(weights_file: Path,
                                                                          image_host: ImageHost) -> None:
    env = e2e_env(weights_file, image_host, GREENSERVE_MAX_CALLER_IMAGES="4")
    backfill, search = {"X-Client-ID": "backfill"}, {"X-Client-ID": "search"}
    with GunicornServer(env, workers=1) as srv:
        pid = srv.worker_pids()
        slow = [f"img00{i}.jpg?delay=1.5&n={i}" for i in range(4)]  # its share, in flight for 1.5 s
        first: list[requests.Response] = []
        held = threading.Thread(target=lambda: first.append(requests.post(
            srv.url + "/v1/embeddings", json={"images": slow}, headers=backfill, timeout=TIMEOUT)))
        held.start()
        time.sleep(0.5)
        over = requests.post(srv.url + "/v1/embeddings", json={"images": ["img000.jpg"]}, headers=backfill,
                             timeout=TIMEOUT)
        other = requests.post(srv.url + "/v1/embeddings", json={"images": ["img001.jpg"]}, headers=search,
                              timeout=TIMEOUT)
        held.join(TIMEOUT)
        again = requests.post(srv.url + "/v1/embeddings", json={"images": ["img000.jpg"]}, headers=backfill,
                              timeout=TIMEOUT)
        metrics = requests.get(srv.url + "/metrics", timeout=TIMEOUT).text
    assert over.status_code == 429 and over.json()["error"]["code"] == "over_share", over.text
    assert int(over.headers["Retry-After"]) >= 1 and "share" in over.json()["error"]["message"]
    assert other.status_code == 200 and first[0].status_code == 200 and again.status_code == 200
    assert {int(r.headers["X-Worker-PID"]) for r in (over, other, first[0], again)} == pid
    assert "greenserve_over_share_total 1.0" in metrics and "backfill" not in metrics
