"""CLIP under real gunicorn -k gevent: a small real open_clip model (ViT-S-32-alt) from a saved checkpoint.

Parity is checked against open_clip itself, in this process: its own preprocess + ``encode_image`` and its
own tokenizer + ``encode_text`` on the same weights. Tolerances:
- texts: cosine >= 0.99999. The same float32 computation; the server runs a batch at its longest text's
  length instead of 77 tokens (exact for CLIP's causal text tower), which only reorders float sums.
- images: cosine >= 0.999 and centred cosine >= 0.99. greenserve decodes JPEGs in draft mode (libjpeg's
  DCT scaling) and resizes the crop box in one step, where open_clip decodes at full size and resizes
  then crops; that moves pixels by a grey level or so (measured: cosine >= 0.9997, centred >= 0.997 on
  these photos, the 6 MP one lowest). With random weights different photos are alike (cosines ~0.7),
  so the check that matters is the centred one, and that each image's nearest reference is itself.
"""

from __future__ import annotations

import base64
import io
import os
import random
import string
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import CLIP_ARCH, CLIP_LIMITS, e2e_env
from service.settings import Settings

pytestmark = pytest.mark.e2e
PHOTOS = [f"img{i:03d}.jpg" for i in range(8)] + ["big.jpg"]
TEXTS = ["a photo of a cat", "a dog running on a beach at sunset", "holiday pictures from the mountains in winter"]


@pytest.fixture(scope="module")
def reference(clip_checkpoint: Path):
    """open_clip's own model, preprocess and tokenizer on the same weights."""
    import open_clip
    import torch

    model, _, preprocess = open_clip.create_model_and_transforms(CLIP_ARCH, pretrained=None)
    state = torch.load(clip_checkpoint, weights_only=True)["state_dict"]
    model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    return model.eval(), preprocess, open_clip.get_tokenizer(CLIP_ARCH)


@pytest.fixture(scope="module")
def clip_server(clip_checkpoint: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    env = e2e_env(clip_checkpoint, image_host, GREENSERVE_MODEL=f"open_clip:{CLIP_ARCH}", **CLIP_LIMITS)
    with GunicornServer(env, workers=2) as srv:
        yield srv


def post(server: GunicornServer, route: str, body: dict, **kw: object) -> requests.Response:
    return requests.post(f"{server.url}/v1/{route}", json=body, timeout=120, **kw)


def vectors(response: requests.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float64)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_models_says_family_towers_dimension_and_preprocessing(clip_server: GunicornServer) -> None:
    info = requests.get(clip_server.url + "/v1/models", timeout=10).json()["data"][0]
    assert (info["name"], info["family"], info["towers"]) == (f"open_clip:{CLIP_ARCH}", "open_clip", ["image", "text"])
    assert info["embedding_dim"] == 256 and set(info["tasks"]) == {"embeddings", "classify", "rank"}
    pre = info["preprocessing"]
    assert (pre["resize"], pre["crop"], pre["interpolation"], pre["resize_mode"]) == (224, 224, "bicubic", "shortest")
    assert pre["mean"] == pytest.approx([0.48145466, 0.4578275, 0.40821073])
    assert info["text"]["context_length"] == 77 and info["text"]["over_context_length"] == "truncate"


def test_image_embeddings_match_open_clip_itself(clip_server: GunicornServer, reference, album: dict[str, bytes]) -> None:
    import torch
    from PIL import Image

    ours = vectors(post(clip_server, "embeddings", {"images": PHOTOS}))
    assert ours.shape == (len(PHOTOS), 256)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)
    model, preprocess, _ = reference
    with torch.inference_mode():
        pixels = torch.stack([preprocess(Image.open(io.BytesIO(album[name]))) for name in PHOTOS])
        theirs = unit(model.encode_image(pixels).double().numpy())
    assert (ours * theirs).sum(axis=1).min() >= 0.999
    centre = theirs.mean(axis=0)
    ours_c, theirs_c = unit(ours - centre), unit(theirs - centre)
    assert (ours_c * theirs_c).sum(axis=1).min() >= 0.99
    assert list((ours_c @ theirs_c.T).argmax(axis=1)) == list(range(len(PHOTOS)))


def test_text_embeddings_match_open_clip_itself(clip_server: GunicornServer, reference) -> None:
    import torch

    response = post(clip_server, "embeddings", {"texts": TEXTS})
    ours = vectors(response)
    assert ours.shape == (3, 256) and np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)
    model, _, tokenizer = reference
    with torch.inference_mode():
        theirs = unit(model.encode_text(tokenizer(TEXTS)).double().numpy())
    assert (ours * theirs).sum(axis=1).min() >= 0.99999
    assert [(d["tokens"], d["truncated"]) for d in response.json()["data"]] == [(7, False), (10, False), (9, False)]
    raw = vectors(post(clip_server, "embeddings", {"texts": TEXTS, "normalize": False}))
    assert np.allclose(unit(raw), ours, atol=1e-5) and not np.allclose(np.linalg.norm(raw, axis=1), 1, atol=1e-3)


def test_every_input_mode_gives_the_same_embedding(clip_server: GunicornServer, album: dict[str, bytes]) -> None:
    data_url = "data:image/jpeg;base64," + base64.b64encode(album["img003.jpg"]).decode()
    by_url = vectors(post(clip_server, "embeddings", {"images": ["img003.jpg"]}))
    by_data = vectors(post(clip_server, "embeddings", {"images": [data_url]}))
    upload = requests.post(clip_server.url + "/v1/embeddings", files={"images": ("a.jpg", album["img003.jpg"])},
                           timeout=60)
    assert np.array_equal(by_url, by_data) and np.array_equal(by_url, vectors(upload))


def test_long_texts_are_truncated_and_say_so_or_refused_when_asked(clip_server: GunicornServer) -> None:
    long = "a very long caption " * 25  # 500 characters, ~100 tokens > 77
    item = post(clip_server, "embeddings", {"texts": [long, "short"]}).json()["data"]
    assert (item[0]["tokens"], item[0]["truncated"], item[1]["truncated"]) == (77, True, False)
    refused = post(clip_server, "embeddings", {"texts": [long], "truncate": False})
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "over_context_length")


def unseen_words(rng: random.Random, chars: int) -> str:
    """``chars`` characters of words no tokenizer has seen, each as long as a word may be: BPE's worst case."""
    from service.engine.open_clip_family import MAX_WORD_CHARS  # here: open_clip's import costs every collection

    text = ""
    while len(text) < chars:
        text += "".join(rng.choices(string.ascii_lowercase, k=MAX_WORD_CHARS)) + " "
    return text[:chars].strip()


def test_the_largest_zero_shot_request_the_limits_allow_answers_well_inside_the_deadline(
        clip_checkpoint: Path, image_host: ImageHost) -> None:
    """At the default limits and deadline. GREENSERVE_MAX_LABELS labels of GREENSERVE_MAX_TEXT_CHARS characters
    in a template as long (about 4 MB of prompts; open_clip's tokenizer, reading them whole, took past the 60 s
    deadline) come to 1,000 full contexts: refused at once as over GREENSERVE_MAX_TEXT_TOKENS. The largest set
    the budget allows, every label a full context, answers well inside the deadline. Its time depends on what
    else loads the host; its work, in CPU seconds, not."""
    limits = Settings()
    rng = random.Random(8)
    template = "{} " + unseen_words(rng, limits.max_text_chars - 3)
    labels = [unseen_words(rng, limits.max_text_chars) for _ in range(limits.max_labels)]
    env = e2e_env(clip_checkpoint, image_host, GREENSERVE_MODEL=f"open_clip:{CLIP_ARCH}")  # the default text limits
    with GunicornServer(env, workers=1) as srv:
        (pid,) = srv.worker_pids()
        t0 = time.monotonic()
        over = post(srv, "classify", {"images": ["img000.jpg"], "labels": labels, "template": template, "top_k": 3})
        refused_s = time.monotonic() - t0
        largest = labels[:limits.max_text_tokens // 77]  # 77: the test CLIP's context, every label filling it
        t0, cpu0 = time.monotonic(), cpu_seconds(pid)
        response = post(srv, "classify", {"images": ["img000.jpg"], "labels": largest, "template": template,
                                          "top_k": 3})
        took, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
        ok = post(srv, "embeddings", {"texts": ["still here"]})
    print(f"\n{len(labels)} labels of {len(labels[0])} characters: {over.status_code} in {refused_s:.1f}s; "
          f"{len(largest)}: {response.status_code} in {took:.1f}s, {cpu:.1f} CPU seconds of the worker (deadline "
          f"{limits.request_timeout_s:.0f}s; host load {os.getloadavg()[0]:.1f})")
    assert (over.status_code, over.json()["error"]["code"]) == (413, "too_many_tokens"), over.text[:300]
    assert "GREENSERVE_MAX_TEXT_TOKENS" in over.json()["error"]["message"]
    assert response.status_code == 200, response.text[:300]
    assert len(response.json()["data"][0]["labels"]) == 3
    # the work, whatever else shares the host's 2 cores: a third of the deadline, on one core
    assert cpu < limits.request_timeout_s / 3, f"{cpu:.1f} CPU seconds"
    assert ok.status_code == 200 and int(ok.headers["X-Worker-PID"]) == pid


def cpu_seconds(pid: int) -> float:
    """The process's user and system CPU time so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_zero_shot_scores_sum_to_one_follow_the_cosines_and_hit_the_label_cache(clip_server: GunicornServer) -> None:
    labels = ["cat", "dog", "mountain", "beach", "car"]
    body = {"images": PHOTOS[:3], "labels": labels, "template": "a photo of a {}.", "top_k": 5}
    before = _cache_counts(clip_server)
    answers = [post(clip_server, "classify", body) for _ in range(3)]  # 3 requests, 2 workers: one repeats
    after = _cache_counts(clip_server)
    assert all(a.status_code == 200 for a in answers), answers[0].text
    assert after["hit"] - before["hit"] >= len(labels)
    assert after["miss"] - before["miss"] <= 2 * len(labels)
    images_v = vectors(post(clip_server, "embeddings", {"images": PHOTOS[:3]}))
    labels_v = vectors(post(clip_server, "embeddings", {"texts": [f"a photo of a {x}." for x in labels]}))
    for item, image in zip(answers[0].json()["data"], images_v, strict=True):
        scored = item["labels"]
        assert sum(s["score"] for s in scored) == pytest.approx(1, abs=1e-4)
        expected = [labels[i] for i in np.argsort(-(labels_v @ image), kind="stable")]
        assert [s["label"] for s in scored] == expected
        assert [s["cosine"] for s in scored] == pytest.approx(sorted(labels_v @ image, reverse=True), abs=1e-4)


def test_rank_orders_the_images_by_cosine_to_the_query(clip_server: GunicornServer) -> None:
    query = "a photo of the sea"
    ranked = post(clip_server, "rank", {"images": PHOTOS, "query": query})
    assert ranked.status_code == 200, ranked.text
    data = ranked.json()["data"]
    images_v = vectors(post(clip_server, "embeddings", {"images": PHOTOS}))
    query_v = vectors(post(clip_server, "embeddings", {"texts": [query]}))[0]
    cosines = images_v @ query_v
    assert [d["index"] for d in data] == list(np.argsort(-cosines, kind="stable"))
    assert [d["score"] for d in data] == pytest.approx(sorted(cosines, reverse=True), abs=1e-4)
    assert [d["image"] for d in data][:1] == [PHOTOS[int(np.argmax(cosines))]]
    top = post(clip_server, "rank", {"images": PHOTOS, "query": query, "top_k": 2}).json()["data"]
    assert [d["index"] for d in top] == [d["index"] for d in data[:2]]


@pytest.mark.parametrize(("route", "body", "status", "code"), [
    ("embeddings", {"texts": []}, 400, "empty_text"),
    ("embeddings", {"texts": ["ok", "  "]}, 400, "empty_text"),
    ("embeddings", {"texts": ["ok", 3]}, 400, "empty_text"),
    ("embeddings", {"texts": ["x"] * 17}, 413, "too_many_texts"),
    ("embeddings", {"texts": ["x" * 601]}, 413, "text_too_long"),
    ("embeddings", {"texts": ["a"], "images": ["img000.jpg"]}, 400, "invalid_request"),
    ("embeddings", {"texts": ["a very long caption " * 25], "truncate": False}, 400, "over_context_length"),
    ("embeddings", {"texts": ["a"], "truncate": "no"}, 400, "invalid_request"),
    ("classify", {"images": ["img000.jpg"]}, 400, "labels_required"),
    ("classify", {"images": ["img000.jpg"], "labels": ["a"] * 2}, 400, "invalid_request"),
    ("classify", {"images": ["img000.jpg"], "labels": [f"l{i}" for i in range(21)]}, 413, "too_many_labels"),
    ("classify", {"images": ["img000.jpg"], "labels": ["cat"], "template": "no slot"}, 400, "invalid_request"),
    ("rank", {"images": ["img000.jpg"]}, 400, "empty_text"),
    ("rank", {"images": ["img000.jpg"], "query": "x" * 601}, 413, "text_too_long"),
])
def test_bad_text_input_gets_its_code_and_the_same_workers_answer(clip_server: GunicornServer, route: str,
                                                                   body: dict, status: int, code: str) -> None:
    pids = clip_server.worker_pids()
    response = post(clip_server, route, body)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code), response.text
    assert response.json()["error"]["message"]
    assert post(clip_server, "embeddings", {"texts": ["still here"]}).status_code == 200
    assert clip_server.worker_pids() == pids


def test_multipart_zero_shot_takes_repeated_label_fields(clip_server: GunicornServer, album: dict[str, bytes]) -> None:
    response = requests.post(clip_server.url + "/v1/classify", files={"images": ("a.jpg", album["img001.jpg"])},
                             data={"labels": ["cat", "dog"], "template": "a picture of a {}"}, timeout=60)
    assert response.status_code == 200, response.text
    assert {s["label"] for s in response.json()["data"][0]["labels"]} == {"cat", "dog"}


@pytest.mark.parametrize(("route", "body", "code"), [
    ("embeddings", {"texts": ["a photo of a cat"]}, "text_not_supported"),
    ("classify", {"images": ["img000.jpg"], "labels": ["cat"]}, "labels_not_supported"),
    ("rank", {"images": ["img000.jpg"], "query": "a cat"}, "task_not_supported"),
])
def test_text_to_a_classifier_without_a_text_tower_is_a_clear_400(server: GunicornServer, route: str, body: dict,
                                                                   code: str) -> None:
    pids = server.worker_pids()
    response = post(server, route, body)
    assert (response.status_code, response.json()["error"]["code"]) == (400, code), response.text
    assert post(server, "classify", {"images": ["img000.jpg"]}).status_code == 200
    assert server.worker_pids() == pids


def _cache_counts(server: GunicornServer) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=10).text
    counts = {"hit": 0.0, "miss": 0.0}
    for line in text.splitlines():
        if line.startswith("greenserve_text_cache_total{"):
            result = line.split('result="')[1].split('"')[0]
            counts[result] += float(line.rsplit(" ", 1)[1])
    return counts


def test_openai_strings_are_texts_on_clip_and_are_never_fetched(clip_server: GunicornServer,
                                                                image_host: ImageHost) -> None:
    import openai

    native = vectors(post(clip_server, "embeddings", {"texts": TEXTS}))
    image = vectors(post(clip_server, "embeddings", {"images": ["img000.jpg"]}))
    with openai.OpenAI(base_url=f"{clip_server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        hits = sum(image_host.hits.values())
        texts = client.embeddings.create(model=f"open_clip:{CLIP_ARCH}", input=TEXTS)  # as OpenAI's own API
        query = client.embeddings.create(model=f"open_clip:{CLIP_ARCH}", input=TEXTS[1])
        assert sum(image_host.hits.values()) == hits, image_host.hits  # no text went to the image host
        photo = client.embeddings.create(model=f"open_clip:{CLIP_ARCH}", input=["img000.jpg"],
                                         extra_body={"modality": "image"})
    np.testing.assert_allclose([e.embedding for e in texts.data], native, atol=1e-6)
    np.testing.assert_allclose(query.data[0].embedding, native[1], atol=1e-6)
    assert texts.usage.prompt_tokens == 7 + 10 + 9
    np.testing.assert_allclose(photo.data[0].embedding, image[0], atol=1e-6)
    url = image_host.url("img000.jpg")
    for inputs in ([{"image": url}], [{"type": "image_url", "image_url": {"url": url}}], [{"url": "img000.jpg"}]):
        r = post(clip_server, "embeddings", {"model": f"open_clip:{CLIP_ARCH}", "input": inputs})
        np.testing.assert_allclose(vectors(r), image, atol=1e-6)
    objects = post(clip_server, "embeddings", {"model": f"open_clip:{CLIP_ARCH}", "input": [{"text": t} for t in TEXTS]})
    np.testing.assert_allclose(vectors(objects), native, atol=1e-6)
    for mixed in ([{"text": TEXTS[0]}, {"image": url}], [TEXTS[0], {"image": url}]):
        r = post(clip_server, "embeddings", {"model": f"open_clip:{CLIP_ARCH}", "input": mixed})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        assert "modality" in r.json()["error"]["message"]


def test_langchain_and_llamaindex_embed_texts_as_their_users_write_it(clip_server: GunicornServer) -> None:
    import openai
    from langchain_openai import OpenAIEmbeddings
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    native = vectors(post(clip_server, "embeddings", {"texts": TEXTS}))
    model = f"open_clip:{CLIP_ARCH}"
    chain = OpenAIEmbeddings(model=model, base_url=f"{clip_server.url}/v1", api_key="unused",
                             check_embedding_ctx_length=False)  # its setting for servers that take strings
    np.testing.assert_allclose(chain.embed_documents(TEXTS), native, atol=1e-6)
    np.testing.assert_allclose(chain.embed_query(TEXTS[1]), native[1], atol=1e-6)
    with pytest.raises(openai.APIStatusError, match="chunk_size") as over:  # one call of more than the limit
        chain.embed_documents([f"text {i}" for i in range(17)])  # (CLIP_LIMITS: 16 texts)
    assert over.value.status_code == 413
    llama = OpenAILikeEmbedding(model_name=model, api_base=f"{clip_server.url}/v1", api_key="unused")
    np.testing.assert_allclose(llama.get_text_embedding_batch(TEXTS), native, atol=1e-6)
    np.testing.assert_allclose(llama.get_query_embedding(TEXTS[1]), native[1], atol=1e-6)
