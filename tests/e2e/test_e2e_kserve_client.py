"""End to end with kserve's own REST client (``InferenceRESTClient``, v1 and v2) against a real gunicorn -k
gevent greenserve (resnet18, D=512): health as that client reads it (it parses the bodies), v2 binary BYTES
infer and v1 ``:predict`` with parity to the native routes, and its errors."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import httpx
import numpy as np
import pytest
import requests

from harness.launch import GunicornServer
from harness.servers import E2E_MODEL

pytestmark = pytest.mark.e2e
kserve = pytest.importorskip("kserve")
from kserve.protocol.infer_type import RequestedOutput  # noqa: E402

NAMES = ["img001.jpg", "img002.jpg"]


def native(server: GunicornServer, route: str, images: list[str], **extra: object) -> list[dict[str, Any]]:
    r = requests.post(f"{server.url}/v1/{route}", json={"images": images, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def client(protocol: str) -> Any:
    return kserve.InferenceRESTClient(kserve.RESTConfig(protocol=protocol, timeout=60))


def test_v2_health_and_binary_infer(server: GunicornServer, album: dict[str, bytes]) -> None:
    async def check() -> np.ndarray:
        v2 = client("v2")
        try:
            assert await v2.is_server_live(server.url) and await v2.is_server_ready(server.url)
            assert await v2.is_model_ready(server.url, E2E_MODEL)
            arr = np.array([[album[n]] for n in NAMES], dtype=np.object_)
            image = kserve.InferInput(name="IMAGE", shape=list(arr.shape), datatype="BYTES")
            image.set_data_from_numpy(arr, binary_data=True)  # else it sends JSON, which a JPEG cannot be
            request = kserve.InferRequest(model_name=E2E_MODEL, infer_inputs=[image],
                                          request_outputs=[RequestedOutput("EMBEDDING", {"binary_data": True})])
            response = await v2.infer(server.url, request, model_name=E2E_MODEL)
            return response.get_output_by_name("EMBEDDING").as_numpy()
        finally:
            await v2.close()

    emb = asyncio.run(check())
    assert emb.shape == (2, 512)
    np.testing.assert_allclose(emb, [d["embedding"] for d in native(server, "embeddings", NAMES)], atol=1e-6)


def test_v1_health_predict_and_errors(server: GunicornServer, album: dict[str, bytes]) -> None:
    b64 = {n: base64.b64encode(album[n]).decode() for n in NAMES}
    instances = [{"image": {"b64": b64[NAMES[0]]}}, {"data": b64[NAMES[1]]}, {"b64": b64[NAMES[0]]}, NAMES[1]]
    order = [NAMES[0], NAMES[1], NAMES[0], NAMES[1]]

    async def check() -> tuple[dict, dict, list[httpx.HTTPStatusError]]:
        v1 = client("v1")
        try:
            assert await v1.is_server_live(server.url) and await v1.is_model_ready(server.url, E2E_MODEL)
            classes = await v1.infer(server.url, {"instances": instances}, model_name=E2E_MODEL)
            vectors = await v1.infer(server.url, {"instances": instances}, model_name=f"{E2E_MODEL}-embedding")
            errors = []
            for name, body in (("nope", {"instances": instances}),
                               (E2E_MODEL, {"instances": [{"b64": base64.b64encode(b"not an image").decode()}]})):
                with pytest.raises(httpx.HTTPStatusError) as err:
                    await v1.infer(server.url, body, model_name=name)
                errors.append(err.value)
            return classes, vectors, errors
        finally:
            await v1.close()

    classes, vectors, (missing, bad) = asyncio.run(check())
    want = native(server, "classify", order)
    assert [list(p) for p in classes["predictions"]] == [[c["label"] for c in d["labels"]] for d in want]
    np.testing.assert_allclose(vectors["predictions"], [d["embedding"] for d in native(server, "embeddings", order)],
                               atol=1e-6)
    assert missing.response.status_code == 404 and "no model named 'nope'" in str(missing)  # the "error" string
    assert bad.response.status_code == 422 and bad.response.json()["code"] == "not_an_image"
