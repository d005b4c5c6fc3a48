"""End to end, the openai SDK against a real gunicorn -k gevent greenserve (resnet18, D=512): embeddings of
image URLs (the SDK's default base64 and float), parity with the native route, model listing, errors the
SDK maps to its own classes, and overload. CLIP texts through the SDK are in test_e2e_clip.py."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import E2E_MODEL, GUARD_TOKEN

pytestmark = pytest.mark.e2e
TIMEOUT = 60
NAMES = ["img004.jpg", "img005.jpg"]


def sdk(server: GunicornServer, api_key: str = "unused", max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=max_retries, timeout=TIMEOUT)


def native_vectors(server: GunicornServer, images: list[str]) -> np.ndarray:
    r = requests.post(server.url + "/v1/embeddings", json={"images": images}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def test_embeddings_of_image_urls_match_native(server: GunicornServer, image_host: ImageHost) -> None:
    urls = [image_host.url(n) for n in NAMES]
    want = native_vectors(server, NAMES)
    with sdk(server) as client:
        by_default = client.embeddings.create(model=E2E_MODEL, input=urls)  # the SDK asks for base64
        as_float = client.embeddings.create(model=f"{E2E_MODEL}-embedding", input=urls, encoding_format="float")
        single = client.embeddings.create(model=E2E_MODEL, input=urls[0])
    assert [e.index for e in by_default.data] == [0, 1] and by_default.object == "list"
    # atol: a forward's batch (the images batched with others) moves the last float32 bit
    np.testing.assert_allclose([e.embedding for e in by_default.data], want, atol=1e-6)
    np.testing.assert_allclose([e.embedding for e in as_float.data], want, atol=1e-6)
    assert len(single.data) == 1
    np.testing.assert_allclose(single.data[0].embedding, want[0], atol=1e-6)
    assert by_default.usage.prompt_tokens == 0  # images are not tokens


def test_object_inputs_and_the_native_shape_still_answer(server: GunicornServer, album: dict[str, bytes]) -> None:
    b64 = base64.b64encode(album["img004.jpg"]).decode()
    data_url = "data:image/jpeg;base64," + b64
    inputs = [{"image": b64}, {"type": "image_url", "image_url": {"url": data_url}}, {"b64": b64},
              {"type": "image_base64", "image_base64": data_url}, "img004.jpg"]
    r = requests.post(server.url + "/v1/embeddings", json={"model": E2E_MODEL, "input": inputs}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, np.repeat(native_vectors(server, ["img004.jpg"]), 5, axis=0), atol=1e-6)
    native = requests.post(server.url + "/v1/embeddings", json={"images": ["img004.jpg"]}, timeout=TIMEOUT).json()
    assert native["data"][0]["image"] == "img004.jpg" and native["errors"] == [] and "timings_ms" in native
    assert native["object"] == "list" and native["data"][0]["object"] == "embedding"


def test_refusals_raise_the_sdks_errors_with_greenserve_codes(server: GunicornServer, album: dict[str, bytes]) -> None:
    pids = server.worker_pids()
    bad = "data:image/jpeg;base64," + base64.b64encode(b"not an image").decode()
    with sdk(server) as client:
        with pytest.raises(openai.UnprocessableEntityError) as unprocessable:
            client.embeddings.create(model=E2E_MODEL, input=["img004.jpg", bad])
        assert unprocessable.value.code == "not_an_image" and unprocessable.value.status_code == 422
        assert [d["index"] for d in unprocessable.value.body["details"]] == [1]  # type: ignore[index]
        cases = [({"input": ["a cat"], "extra_body": {"modality": "text"}}, "text_not_supported"),
                 ({"input": ["img004.jpg"], "dimensions": 123}, "dimensions_not_supported"),
                 ({"input": [[1, 2, 3]]}, "token_input_not_supported")]
        for kwargs, code in cases:
            with pytest.raises(openai.BadRequestError) as err:
                client.embeddings.create(model=E2E_MODEL, **kwargs)  # type: ignore[arg-type]
            assert err.value.code == code, err.value.body
            if code == "token_input_not_supported":  # LangChain's default: the message names its setting
                assert "check_embedding_ctx_length=False" in err.value.message
        with pytest.raises(openai.NotFoundError) as missing:
            client.embeddings.create(model="text-embedding-3-small", input=["img004.jpg"])
        assert missing.value.code == "model_not_found"
        not_a_name = requests.post(server.url + "/v1/embeddings", json={"model": {}, "input": ["img004.jpg"]},
                                   timeout=60)  # the SDK sends strings only; schemathesis found this 500
        assert not_a_name.status_code == 400 and not_a_name.json()["error"]["code"] == "invalid_request"
        ids = {m.id for m in client.models.list()}
        assert {E2E_MODEL, f"{E2E_MODEL}-embedding"} <= ids
        assert client.models.retrieve(E2E_MODEL).id == E2E_MODEL
        assert len(client.embeddings.create(model=E2E_MODEL, input=["img004.jpg"]).data) == 1  # still answering
    assert server.worker_pids() == pids


def test_the_token_and_overload(guarded: GunicornServer) -> None:
    with sdk(guarded, api_key="wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            client.embeddings.create(model=E2E_MODEL, input=["img004.jpg"])

    def one(_: int) -> str:
        with sdk(guarded, api_key=GUARD_TOKEN) as client:
            try:
                client.embeddings.create(model=E2E_MODEL, input=["big.jpg"] * 3)  # relative: the image host
                return "ok"
            except openai.InternalServerError as err:  # the SDK's class for every 5xx
                assert err.status_code == 503 and err.code == "overloaded"
                assert int(err.response.headers["Retry-After"]) >= 1
                return "503"

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(one, range(6)))
    assert "503" in outcomes and "ok" in outcomes, outcomes
