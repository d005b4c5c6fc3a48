"""Models managed at run time on a real gunicorn -k gevent server of two workers: tritonclient's load_model and
unload_model reach every worker, and a model switch (the new model backfills while the old one answers
searches, then the old one is unloaded and the new one becomes the default) fails no request."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests
import tritonclient.http as httpclient

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import CLIP_ARCH, e2e_env

pytestmark = pytest.mark.e2e
TIMEOUT = 60


@pytest.fixture(scope="module")
def other_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CLIP of the same architecture: the "new" model of a switch."""
    import open_clip
    import torch

    torch.manual_seed(8)
    path = tmp_path_factory.mktemp("clip-new") / "new.pt"
    torch.save(open_clip.create_model(CLIP_ARCH, pretrained=None).state_dict(), path)
    return path


def test_load_and_unload_reach_every_worker(weights_file: Path, clip_checkpoint: Path, image_host: ImageHost) -> None:
    env = e2e_env(weights_file, image_host,
                  GREENSERVE_MODELS=f"clip=open_clip:{CLIP_ARCH}@{clip_checkpoint},cls=resnet18@{weights_file}")
    with GunicornServer(env, workers=2) as srv:
        triton = httpclient.InferenceServerClient(url=srv.url.removeprefix("http://"))
        body = {"images": ["img001.jpg"], "model": "cls"}
        triton.unload_model("cls")
        index = {m["name"]: m["state"] for m in triton.get_model_repository_index()}
        refused = [requests.post(srv.url + "/v1/embeddings", json=body, timeout=TIMEOUT) for _ in range(6)]
        ready = triton.is_model_ready("cls")
        pids = {int(r.headers["X-Worker-PID"]) for r in refused}
        triton.load_model("cls")
        served = [requests.post(srv.url + "/v1/embeddings", json=body, timeout=TIMEOUT) for _ in range(6)]
        assert triton.is_model_ready("cls") and triton.is_model_ready("clip")
    assert index == {"clip": "READY", "cls": "UNAVAILABLE"} and not ready
    assert {r.status_code for r in refused} == {503} and pids
    assert all(r.json()["error"]["code"] == "model_unavailable" for r in refused)
    assert {r.status_code for r in served} == {200}


def test_a_model_switch_fails_no_request(weights_file: Path, clip_checkpoint: Path, other_clip: Path,
                                         image_host: ImageHost) -> None:
    """docs/MODELS.md's switch: serve old (the default) and new; backfill with new while old answers searches;
    unload old: new is the default from then on, and no request fails along the way."""
    env = e2e_env(weights_file, image_host,
                  GREENSERVE_MODELS=f"old=open_clip:{CLIP_ARCH}@{clip_checkpoint},new=open_clip:{CLIP_ARCH}@{other_clip}")
    statuses: Counter[int] = Counter()
    answered: list[tuple[float, str]] = []  # (when, which model answered a search without a model name)
    stop = threading.Event()

    def searches() -> None:
        session = requests.Session()
        while not stop.is_set():
            r = session.post(srv.url + "/v1/embeddings", json={"texts": ["a dog on a beach"]}, timeout=TIMEOUT)
            statuses[r.status_code] += 1
            answered.append((time.monotonic(), r.json().get("model", "")))

    def backfill() -> None:
        session = requests.Session()
        while not stop.is_set():
            r = session.post(srv.url + "/v1/embeddings", json={"images": ["img002.jpg", "img003.jpg"],
                                                                "model": "new"}, timeout=TIMEOUT)
            statuses[r.status_code] += 1

    with GunicornServer(env, workers=2) as srv:
        clients = [threading.Thread(target=searches), threading.Thread(target=backfill)]
        for c in clients:
            c.start()
        time.sleep(2)
        triton = httpclient.InferenceServerClient(url=srv.url.removeprefix("http://"))
        unloading = time.monotonic()
        triton.unload_model("old")
        unloaded = time.monotonic()
        time.sleep(2)
        stop.set()
        for c in clients:
            c.join(TIMEOUT)
    before = {model for when, model in answered if when < unloading}
    after = {model for when, model in answered if when > unloaded}
    assert statuses and set(statuses) == {200}, statuses
    assert before == {"old"} and after == {"new"}, (before, after)
