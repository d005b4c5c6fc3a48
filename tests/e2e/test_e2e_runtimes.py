"""OpenVINO as the trial's candidate on real gunicorn -k gevent (2 workers, GREENSERVE_DTYPE=auto): the tower is
converted once per host (the second worker reads the IR back, a restart on the same cache directory converts
nothing), the served vectors agree with float32's, and ``GREENSERVE_RUNTIMES=torch`` tries no conversion."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import e2e_env
from service.engine import openvino_runtime

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(openvino_runtime.version() is None, reason="openvino not installed")]
CONVERTED, READ_BACK = "tower converted in", "IR read from the disk cache"
PHOTOS = [f"img{i:03d}.jpg" for i in range(6)]


def embeddings(srv: GunicornServer) -> np.ndarray:
    r = requests.post(srv.url + "/v1/embeddings", json={"images": PHOTOS}, timeout=120)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]])


def numerics(srv: GunicornServer) -> tuple[str, list[str], str]:
    """The image tower's numerics, the ways its trial timed, and why it serves them. A worker that read its
    sibling's choice from the memo timed nothing and lists no trials; its reason is the sibling's."""
    p = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["precision"]
    image = p["towers"]["image"]
    return image["numerics"], [t["numerics"] for t in image["trials"]], image["reason"]


def test_the_tower_converts_once_per_host_and_a_restart_converts_nothing(weights_file: Path,
                                                                         image_host: ImageHost) -> None:
    with tempfile.TemporaryDirectory() as cache, \
            GunicornServer(e2e_env(weights_file, image_host, GREENSERVE_DTYPE="float32"), workers=1) as reference:
        want = embeddings(reference)
        env = e2e_env(weights_file, image_host, GREENSERVE_DTYPE="auto", GREENSERVE_CPU_BF16="yes",
                      GREENSERVE_CACHE_DIR=cache)
        with GunicornServer(env, workers=2) as first:
            served, tried, reason = numerics(first)
            got = embeddings(first)
            first_log = first.log()
        with GunicornServer(env, workers=2) as again:
            again_served, _, _ = numerics(again)
            again_log = again.log()
    assert tried[-2:] == ["openvino bfloat16", "openvino float32"] or not tried, tried  # [] from the memo's reader
    assert "openvino bfloat16" in reason and "openvino float32" in reason, reason
    # the first worker converts; the second reads its IR back (the memo hands it the choice)
    assert first_log.count(CONVERTED) == 1 and READ_BACK in first_log, first_log[-3000:]
    assert again_log.count(CONVERTED) == 0 and READ_BACK in again_log, again_log[-3000:]
    assert again_served == served
    cosines = (want * got).sum(1) / np.linalg.norm(want, axis=1) / np.linalg.norm(got, axis=1)
    assert cosines.min() >= 0.999, (served, cosines)


def test_runtimes_torch_converts_nothing(weights_file: Path, image_host: ImageHost) -> None:
    env = e2e_env(weights_file, image_host, GREENSERVE_DTYPE="auto", GREENSERVE_CPU_BF16="yes",
                  GREENSERVE_RUNTIMES="torch")
    with GunicornServer(env, workers=1) as srv:
        served, tried, _ = numerics(srv)
        assert tried == ["bfloat16 cast once", "bfloat16 autocast"] and not served.startswith("openvino")
        assert CONVERTED not in srv.log() and READ_BACK not in srv.log()
