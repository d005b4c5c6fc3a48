"""Two models in one server (a small CLIP and resnet18, both from saved random weights) on a real gunicorn
-k gevent worker: every protocol's real client routes by the model's name, an unknown name is a 404 naming what
is served, and each model answers with its own vectors (the embedding cache keeps them apart)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import tritonclient.http as httpclient

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import CLIP_ARCH, e2e_env

pytestmark = pytest.mark.e2e
TIMEOUT = 60
PHOTO = "img001.jpg"


@pytest.fixture(scope="module")
def two(weights_file: Path, clip_checkpoint: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    env = e2e_env(weights_file, image_host,
                  GREENSERVE_MODELS=f"clip=open_clip:{CLIP_ARCH}@{clip_checkpoint},cls=resnet18@{weights_file}")
    with GunicornServer(env, workers=1) as srv:
        yield srv


def embed(srv: GunicornServer, **body: object) -> requests.Response:
    return requests.post(srv.url + "/v1/embeddings", json={"images": [PHOTO], **body}, timeout=TIMEOUT)


def test_every_model_is_listed_with_its_towers_and_state(two: GunicornServer) -> None:
    body = requests.get(two.url + "/v1/models", timeout=TIMEOUT).json()
    cards = {card["id"]: card for card in body["data"]}
    assert body["models"] == ["clip", "clip-embedding", "cls", "cls-embedding"]
    assert cards["clip"]["towers"] == ["image", "text"] and cards["cls"]["towers"] == ["image"]
    assert cards["clip"]["model"] == f"open_clip:{CLIP_ARCH}" and cards["cls"]["model"] == "resnet18"
    assert all(card["state"] == "ready" and card["dtype"] and card["device"] == "cpu" for card in cards.values())
    assert requests.get(two.url + "/readyz", timeout=TIMEOUT).json()["models"] == ["clip", "cls"]


def test_native_requests_go_to_the_model_they_name_and_the_default_is_the_first(two: GunicornServer) -> None:
    default, clip, cls = embed(two), embed(two, model="clip"), embed(two, model="cls")
    assert [r.json()["model"] for r in (default, clip, cls)] == ["clip", "clip", "cls"]
    assert default.json()["data"][0]["embedding"] == clip.json()["data"][0]["embedding"]
    assert len(cls.json()["data"][0]["embedding"]) == 512  # resnet18's features, not CLIP's joint space
    assert cls.json()["data"][0]["embedding"] != clip.json()["data"][0]["embedding"][:512]
    again = embed(two, model="cls")  # from the cache now: its own model's entry
    assert again.json()["data"][0]["embedding"] == cls.json()["data"][0]["embedding"]
    assert "hit=1" in again.headers["Cache-Status"]
    text = requests.post(two.url + "/v1/embeddings", json={"texts": ["a dog"], "model": "cls"}, timeout=TIMEOUT)
    assert text.status_code == 400 and text.json()["error"]["code"] == "text_not_supported"
    ok = requests.post(two.url + "/v1/embeddings", json={"texts": ["a dog"], "model": "clip"}, timeout=TIMEOUT)
    assert ok.status_code == 200
    classify = requests.post(two.url + "/v1/classify", json={"images": [PHOTO], "model": "cls", "top_k": 2},
                             timeout=TIMEOUT)
    assert classify.status_code == 200 and len(classify.json()["data"][0]["labels"]) == 2


def test_an_unknown_name_is_404_and_names_what_is_served(two: GunicornServer) -> None:
    for r in (embed(two, model="nope"), requests.get(two.url + "/v1/models/nope", timeout=TIMEOUT),
              requests.post(two.url + "/v1/models/nope:predict", json={"instances": [PHOTO]}, timeout=TIMEOUT),
              requests.post(two.url + "/predictions/nope", data=b"x", timeout=TIMEOUT),
              requests.post(two.url + "/v2/models/nope/infer", json={"inputs": []}, timeout=TIMEOUT)):
        assert r.status_code == 404, r.text
        text = r.text
        assert "'clip'" in text and "'cls'" in text, text


def test_every_protocols_client_routes_by_name(two: GunicornServer, album: dict[str, bytes]) -> None:
    direct = {name: np.array(embed(two, model=name, normalize=False).json()["data"][0]["embedding"])
              for name in ("clip", "cls")}
    sdk = openai.OpenAI(base_url=f"{two.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    for name in ("clip", "cls"):
        got = sdk.embeddings.create(model=f"{name}-embedding", input=[PHOTO],  # on CLIP a string is a text, else
                                    extra_body={"modality": "image"}).data[0].embedding
        np.testing.assert_allclose(got, direct[name] / np.linalg.norm(direct[name]), rtol=1e-5, atol=1e-6)
    kserve = requests.post(two.url + "/v1/models/cls-embedding:predict", json={"instances": [PHOTO]},
                           timeout=TIMEOUT).json()["predictions"][0]
    torchserve = requests.post(two.url + "/predictions/cls", data=album[PHOTO], timeout=TIMEOUT).json()
    assert len(kserve) == 512 and isinstance(torchserve, dict) and len(torchserve) == 5
    triton = httpclient.InferenceServerClient(url=two.url.removeprefix("http://"))
    for name in ("clip", "cls"):
        assert triton.is_model_ready(name)
        batch = np.array([[album[PHOTO]]], dtype=np.object_)
        inp = httpclient.InferInput("IMAGE", list(batch.shape), "BYTES")
        inp.set_data_from_numpy(batch, binary_data=True)
        out = triton.infer(name, [inp], outputs=[httpclient.InferRequestedOutput("EMBEDDING", binary_data=True)])
        uploaded = requests.post(two.url + "/v1/embeddings", files={"images": (PHOTO, album[PHOTO])},
                                 data={"model": name}, timeout=TIMEOUT).json()
        np.testing.assert_allclose(out.as_numpy("EMBEDDING")[0], uploaded["data"][0]["embedding"], rtol=1e-5)
    assert [m["name"] for m in triton.get_model_repository_index()] == ["clip", "cls"]
