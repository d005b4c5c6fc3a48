"""The dtype choice and device JPEG decoding under real gunicorn -k gevent, against the float32 + Pillow server.

The other e2e servers pin float32 (``harness.servers.e2e_env``). This CPU has no native bfloat16, so the default
(``auto``) serves float32 here and says why; with ``GREENSERVE_CPU_BF16=yes`` the same worker tries bfloat16
(cast once and autocast), finds it agrees but runs slower (emulated), and serves float32 saying so; with
``GREENSERVE_JPEG_DECODE=device`` its JPEGs take the device path (the CPU's decoder here, nvJPEG on CUDA)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import e2e_env
from service.engine import openvino_runtime, precision

pytestmark = pytest.mark.e2e
PHOTOS = [f"img{i:03d}.jpg" for i in range(8)] + ["big.jpg"]
HOSTILE = {"truncated.jpg": "truncated_image", "page.jpg": "not_an_image", "bomb.png": "image_too_large",
           "scan.tif": "unsupported_image_format", "empty.jpg": "empty_image"}


@pytest.fixture(scope="module")
def default(weights_file: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    with GunicornServer(e2e_env(weights_file, image_host, GREENSERVE_DTYPE="auto"), workers=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def low(weights_file: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    env = e2e_env(weights_file, image_host, GREENSERVE_DTYPE="auto", GREENSERVE_CPU_BF16="yes",
                  GREENSERVE_JPEG_DECODE="device")
    with GunicornServer(env, workers=1) as srv:
        yield srv


def card(srv: GunicornServer) -> dict:
    return requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]


def embeddings(srv: GunicornServer, names: list[str]) -> np.ndarray:
    r = requests.post(srv.url + "/v1/embeddings", json={"images": names}, timeout=300)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]])


def test_the_default_says_which_dtype_it_chose_and_why(default: GunicornServer, server: GunicornServer) -> None:
    assert card(server)["precision"]["reason"] == "pinned by GREENSERVE_DTYPE"  # the other e2e servers
    info = card(default)
    assert info["precision"]["requested"] == "auto" and info["jpeg_decode"] == "pillow"
    image = info["precision"]["towers"]["image"]
    if not precision.cpu_flags() & set(precision.CPU_BF16_FLAGS):  # an avx2-only CPU: float32, in torch or OpenVINO
        assert info["dtype"] == info["precision"]["chosen"] == "float32"
        tried = [t["numerics"] for t in image["trials"]]
        assert tried == (["openvino float32"] if openvino_runtime.version() else [])
        assert tried or "no native bfloat16" in info["precision"]["reason"]
    log = default.log()
    assert f"serving in image {image['numerics']}" in log and "(GREENSERVE_DTYPE=auto): " in log
    assert "JPEG decoding: pillow (the model is on cpu" in log


NATIVE_BF16 = bool(precision.cpu_flags() & set(precision.CPU_BF16_FLAGS))


def test_with_bf16_taken_as_native_the_trial_measures_speed_and_the_card_shows_it(low: GunicornServer) -> None:
    info = card(low)
    p = info["precision"]
    assert p["hardware"].endswith("(GREENSERVE_CPU_BF16=yes)")
    trials = p["towers"]["image"]["trials"]
    converted = ["openvino bfloat16", "openvino float32"] if openvino_runtime.version() else []
    assert [t["numerics"] for t in trials] == ["bfloat16 cast once", "bfloat16 autocast", *converted]
    assert all(t["agrees"] and t["ms"] and t["ms_float32"] for t in trials), trials
    assert info["jpeg_decode"] == "device"
    assert p["towers"]["image"]["numerics"] in [t["numerics"] for t in trials] + ["float32"]
    if not NATIVE_BF16 and not converted:  # emulated: it agrees, it is slower, and float32 serves, saying both
        assert all(t["speedup"] < 1 for t in trials), trials
        assert info["dtype"] == p["chosen"] == "float32"
        assert "agreed but slower" in p["reason"] and "vs float32" in p["reason"]
        assert "serving in image float32 (GREENSERVE_DTYPE=auto): cpu" in low.log()


def test_the_chosen_dtype_and_device_decoding_give_the_float32_pillow_answers(server: GunicornServer,
                                                                              low: GunicornServer) -> None:
    ours, reference = embeddings(low, PHOTOS), embeddings(server, PHOTOS)
    cosine = (ours * reference).sum(axis=1)  # both unit-normalised
    assert cosine.min() > 0.995, cosine
    # each photo is still nearest its own float32 embedding: the answers a search would give are the same
    assert np.array_equal((ours @ reference.T).argmax(axis=1), np.arange(len(PHOTOS)))
    top = requests.post(low.url + "/v1/classify", json={"images": PHOTOS[:4], "top_k": 1}, timeout=300).json()
    assert len(top["data"]) == 4


def test_hostile_files_keep_their_codes_on_the_device_path_and_the_worker_answers_after(low: GunicornServer) -> None:
    pids = low.worker_pids()
    r = requests.post(low.url + "/v1/embeddings", json={"images": ["img000.jpg", *HOSTILE], "partial": True},
                      timeout=300)
    assert r.status_code == 200
    assert {e["image"]: e["code"] for e in r.json()["errors"]} == HOSTILE
    assert len(r.json()["data"]) == 1
    assert embeddings(low, ["img001.jpg"]).shape == (1, 512)
    assert low.worker_pids() == pids
