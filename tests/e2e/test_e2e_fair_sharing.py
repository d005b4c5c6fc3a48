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
from harness.servers import e2e_env

pytestmark = pytest.mark.e2e
TIMEOUT = 60
IDS = "header,address"  # every client here comes from 127.0.0.1: their X-Client-IDs tell them apart


def test_a_caller_over_its_share_is_429_and_others_and_later_it_are_served(weights_file: Path,
                                                                          image_host: ImageHost) -> None:
    env = e2e_env(weights_file, image_host, GREENSERVE_MAX_CALLER_IMAGES="4", GREENSERVE_CALLER_FROM=IDS)
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


def test_a_one_photo_caller_runs_inside_an_albums_forward_and_the_album_is_unharmed(weights_file: Path,
                                                                                    image_host: ImageHost) -> None:
    """One worker, an album of 32 photos in one request and a one-photo caller sending back to back
    meanwhile: some of its images run between the blocks of the album's forwards
    (``greenserve_interjected_images_total``), it is answered while the album is still in flight, and the
    album's rows equal those of the same album sent alone."""
    # one torch thread: the album runs as forwards of a few images while it decodes (no gathering), one
    # after another, and the one-photo calls land in them many times (a gathered forward is one chance)
    env = e2e_env(weights_file, image_host, GREENSERVE_MAX_IMAGES="32", GREENSERVE_LOG_LEVEL="debug",
                  GREENSERVE_TORCH_THREADS="1", GREENSERVE_CALLER_FROM=IDS)
    album = {"images": [f"img{i % 8:03d}.jpg?n={i}" for i in range(32)]}
    with GunicornServer(env, workers=1, cache="off") as srv:  # every image to the model, each time
        alone = requests.post(srv.url + "/v1/embeddings", json=album, timeout=TIMEOUT)
        shared: list[requests.Response] = []
        sending = threading.Thread(target=lambda: shared.append(requests.post(
            srv.url + "/v1/embeddings", json=album, headers={"X-Client-ID": "album"}, timeout=TIMEOUT)))
        sending.start()
        answered_meanwhile = 0
        while sending.is_alive():
            one = requests.post(srv.url + "/v1/embeddings", json={"images": ["img001.jpg"]},
                                headers={"X-Client-ID": "search"}, timeout=TIMEOUT)
            assert one.status_code == 200, one.text
            answered_meanwhile += sending.is_alive()
        sending.join(TIMEOUT)
        metrics = requests.get(srv.url + "/metrics", timeout=TIMEOUT).text
        batches = [line[-60:] for line in srv.log().splitlines() if "batch of" in line or "points" in line]
    interjected = next(float(x.split()[-1]) for x in metrics.splitlines()
                       if x.startswith("greenserve_interjected_images_total "))
    assert interjected >= 1 and answered_meanwhile >= 1, (interjected, answered_meanwhile, batches)
    assert shared[0].status_code == 200 and alone.status_code == 200
    for a, b in zip(alone.json()["data"], shared[0].json()["data"], strict=True):
        assert a["index"] == b["index"] and max(abs(x - y) for x, y in zip(a["embedding"], b["embedding"],
                                                                            strict=True)) < 1e-4
