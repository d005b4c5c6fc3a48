"""The client snippet for each protocol in docs/PROTOCOLS.md (the README links there), run as a user would
paste it, against a real server; each answer must equal the native route's."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import ROOT, GunicornServer
from harness.servers import E2E_MODEL

pytestmark = pytest.mark.e2e
NAMES = ["img006.jpg", "img007.jpg"]
PROTOCOLS_DOC = ROOT / "docs" / "PROTOCOLS.md"


def snippet(heading: str) -> dict[str, Any]:
    """The first ```python block under ``### heading`` in docs/PROTOCOLS.md, executed."""
    doc = PROTOCOLS_DOC.read_text()
    match = re.search(rf"### {re.escape(heading)}.*?```python\n(.*?)```", doc, re.S)
    assert match, f"no python snippet under '### {heading}' in docs/PROTOCOLS.md"
    namespace: dict[str, Any] = {}
    exec(match.group(1), namespace)
    return namespace


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory, album: dict[str, bytes]) -> list[str]:
    folder = tmp_path_factory.mktemp("photos")
    for name in NAMES:
        (folder / name).write_bytes(album[name])
    return [str(folder / name) for name in NAMES]


def native(server: GunicornServer, route: str, **body: object) -> list[dict[str, Any]]:
    r = requests.post(f"{server.url}/v1/{route}", json={"images": NAMES, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_the_tritonclient_snippet(server: GunicornServer, photos: list[str]) -> None:
    fn = snippet("Open Inference Protocol v2 (tritonclient)")["triton_embed_and_top3"]
    embeddings, top3 = fn(photos, url=server.url.removeprefix("http://"), model=E2E_MODEL)
    np.testing.assert_allclose(embeddings, [d["embedding"] for d in native(server, "embeddings")], atol=1e-6)
    labels = [[(c["class_id"], c["label"]) for c in d["labels"]] for d in native(server, "classify", top_k=3)]
    assert [[(int(i), label) for _, i, label in row] for row in top3] == labels


def test_the_openai_snippet(server: GunicornServer, image_host: ImageHost) -> None:
    fn = snippet("OpenAI embeddings")["openai_embed"]
    got = fn([image_host.url(n) for n in NAMES], base_url=server.url + "/v1", model=E2E_MODEL)
    np.testing.assert_allclose(got, [d["embedding"] for d in native(server, "embeddings")], atol=1e-6)


def test_the_kserve_v1_snippet(server: GunicornServer, photos: list[str]) -> None:
    fn = snippet("KServe v1")["kserve_v1_predict"]
    got = fn(photos, base=server.url, model=E2E_MODEL)
    want = native(server, "classify", top_k=3)
    assert [list(p) for p in got] == [[c["label"] for c in d["labels"]] for d in want]


def test_the_torchserve_snippet(server: GunicornServer, photos: list[str]) -> None:
    fn = snippet("TorchServe")["torchserve_predict"]
    got = fn(photos[0], base=server.url, model=E2E_MODEL)
    assert list(got) == [c["label"] for c in native(server, "classify", top_k=5)[0]["labels"]]
    with pytest.raises(requests.HTTPError) as raised:
        fn(__file__, base=server.url, model=E2E_MODEL)  # this test file: not an image
    assert raised.value.response.json()["error_code"] == "not_an_image"
