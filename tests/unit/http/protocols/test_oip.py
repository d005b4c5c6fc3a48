"""OIP v2 routes with a fake model: health while loading, metadata, a JSON infer through the shared path."""

from __future__ import annotations

import base64
import json

import pytest
from flask.testing import FlaskClient
from PIL import Image

from harness import images
from harness.fakes import FakeFetcher, FakeModel
from service.app import create_app
from service.settings import Settings


@pytest.fixture()
def client() -> FlaskClient:
    s = Settings(max_images=8, max_body_bytes=64 * 1024, max_queue_images=50)
    return create_app(s, model=FakeModel(), fetcher=FakeFetcher({})).test_client()


def loading(client: FlaskClient) -> None:
    client.application.extensions["greenserve"].runner.model = None  # as before the model has loaded


def test_health_is_live_but_not_ready_while_the_model_loads(client: FlaskClient) -> None:
    assert client.get("/v2/health/ready").json == {"ready": True}
    loading(client)
    assert client.get("/v2/health/live").json == {"live": True}
    r = client.get("/v2/health/ready")
    assert r.status_code == 503 and r.json["ready"] is False
    configured = client.application.extensions["greenserve"].model_name  # a served name, loaded or not
    r = client.get(f"/v2/models/{configured}/ready")
    assert r.status_code == 503 and r.json["ready"] is False
    r = client.post(f"/v2/models/{configured}/infer", json={"inputs": []})
    assert r.status_code == 503 and r.json["code"] == "not_ready" and r.headers["Retry-After"]
    assert client.get(f"/v1/models/{configured}").status_code == 503  # KServe v1 readiness
    assert client.get("/ping").status_code == 500  # TorchServe's


def test_json_infer_answers_both_outputs_like_the_native_routes(client: FlaskClient) -> None:
    png = images.encode(Image.new("RGB", (40, 40), (200, 200, 200)), "PNG")
    body = {"id": "x", "model_name": "fake", "inputs": [{"name": "input-0", "shape": [1], "datatype": "BYTES",
                                                         "data": [base64.b64encode(png).decode()]}]}
    r = client.post("/v2/models/fake/versions/1/infer", json=body)
    assert r.status_code == 200, r.json
    out = {o["name"]: o for o in r.json["outputs"]}
    assert r.json["id"] == "x" and r.json["model_name"] == "fake" and r.json["model_version"] == "1"
    assert out["EMBEDDING"]["shape"] == [1, 6] and out["PROBABILITIES"]["shape"] == [1, 10]
    native = client.post("/v1/embeddings", json={"images": ["data:image/png;base64," + body["inputs"][0]["data"][0]]})
    assert out["EMBEDDING"]["data"] == pytest.approx(native.json["data"][0]["embedding"], abs=1e-6)
    assert max(range(10), key=lambda i: out["PROBABILITIES"]["data"][i]) == 7


@pytest.mark.parametrize("path, status", [
    ("/v2/models/other", 404), ("/v2/models/fake/versions/2", 404), ("/v2/models/fake/versions/1/config", 200),
    ("/v2/nothing", 404),
])
def test_routes_answer_in_the_protocols_shape(client: FlaskClient, path: str, status: int) -> None:
    r = client.get(path)
    assert r.status_code == status
    if status != 200:
        assert isinstance(r.json["error"], str) and r.json["code"] in ("model_not_found", "not_found")


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"images": ["data:image/png;base64,B64"]}),
    ("/v1/embeddings", {"model": "fake", "input": ["data:image/png;base64,B64"]}),
    ("/v1/models/fake:predict", {"instances": [{"b64": "B64"}]}),
    ("/v2/models/fake/infer", {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["B64"]}]}),
])
def test_a_large_body_is_parsed_off_the_hub_on_every_protocol(path: str, body: dict) -> None:
    """Base64 of 30 photos is tens of MB of decoding: never on the hub, whichever protocol carries it."""
    app = create_app(Settings(max_body_bytes=4 << 20), model=FakeModel(), fetcher=FakeFetcher({}))
    png = images.encode(Image.new("RGB", (40, 40)), "PNG")
    raw = json.dumps(body).replace("B64", base64.b64encode(png).decode()) + " " * 300_000  # past the threshold
    runner = app.extensions["greenserve"].runner
    offloaded: list[str] = []
    real = runner.offload

    def spy(fn, *args, **kw):  # type: ignore[no-untyped-def]
        offloaded.append(fn.__name__)
        return real(fn, *args, **kw)

    runner.offload = spy
    r = app.test_client().post(path, data=raw, content_type="application/json")
    assert r.status_code == 200, r.json
    assert offloaded[0] in ("_parse_json", "parse_request"), offloaded
