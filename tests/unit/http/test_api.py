"""The HTTP layer with a fake model and fetcher: contract, error shapes, routing of results."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from flask.testing import FlaskClient

from harness import images
from harness.fakes import BASE, FakeFetcher, FakeModel
from harness.images import data_url, solid
from service.app import create_app
from service.errors import FetchDeadline
from service.settings import Settings


@pytest.fixture()
def model() -> FakeModel:
    return FakeModel()


@pytest.fixture()
def fetcher() -> FakeFetcher:
    return FakeFetcher({BASE + f"g{v}.png": solid(v) for v in (10, 100, 200)} | {BASE + "html.jpg": images.HTML})


def make_client(model: FakeModel, fetcher: FakeFetcher, **settings: object) -> FlaskClient:
    s = Settings(image_base_url=BASE, max_images=8, max_body_bytes=64 * 1024, **settings)  # type: ignore[arg-type]
    return create_app(s, model=model, fetcher=fetcher).test_client()


@pytest.fixture()
def client(model: FakeModel, fetcher: FakeFetcher) -> FlaskClient:
    return make_client(model, fetcher)


def test_embeddings_in_request_order_with_unit_norm(client: FlaskClient) -> None:
    r = client.post("/v1/embeddings", json={"images": ["g200.png", "g10.png", data_url(solid(100))]})
    assert r.status_code == 200, r.json
    body = r.json
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["image"] for d in body["data"]][:2] == ["g200.png", "g10.png"]
    for d in body["data"]:
        assert np.linalg.norm(d["embedding"]) == pytest.approx(1.0, abs=1e-5)
    assert set(body["timings_ms"]) == {"fetch", "decode", "queue", "inference", "total"}
    assert body["model"] == "fake" and body["errors"] == []


def test_classify_returns_top_k_labels(client: FlaskClient) -> None:
    r = client.post("/v1/classify", json={"images": ["g200.png"], "top_k": 3})
    labels = r.json["data"][0]["labels"]
    assert len(labels) == 3 and labels[0]["label"] == "label7" and labels[0]["class_id"] == 7
    assert labels[0]["score"] >= labels[1]["score"] >= labels[2]["score"]


def test_a_form_within_the_limits_is_not_refused_for_its_part_count(model: FakeModel, fetcher: FakeFetcher) -> None:
    s = Settings(image_base_url=BASE, max_images=8, max_labels=1200, max_body_bytes=4 << 20)
    client = create_app(s, model=model, fetcher=fetcher).test_client()
    labels = [f"l{i}" for i in range(1100)]  # more parts than werkzeug's default 1,000
    r = client.post("/v1/classify", data={"images": [(io.BytesIO(solid(10)), "a.png")], "labels": labels},
                    content_type="multipart/form-data")
    assert r.status_code == 400 and r.json["error"]["code"] == "labels_not_supported"  # parsed, then judged
    r = client.post("/v1/classify", data={"images": [(io.BytesIO(solid(10)), "a.png")], "labels": labels * 2},
                    content_type="multipart/form-data")
    assert r.status_code == 413 and "parts" in r.json["error"]["message"]


def test_multipart_upload(client: FlaskClient) -> None:
    r = client.post("/v1/classify", data={"images": [(io.BytesIO(solid(10)), "a.png"), (io.BytesIO(solid(200)), "b.png")],
                                          "top_k": "1"}, content_type="multipart/form-data")
    assert r.status_code == 200, r.json
    assert [d["labels"][0]["label"] for d in r.json["data"]] == ["label0", "label7"]


def test_bad_image_fails_request_with_details(client: FlaskClient) -> None:
    r = client.post("/v1/embeddings", json={"images": ["g10.png", "html.jpg"]})
    assert r.status_code == 422
    err = r.json["error"]
    assert err["code"] == "not_an_image"
    assert err["details"] == [{"index": 1, "image": "html.jpg", "code": "not_an_image", "message": err["details"][0]["message"]}]
    assert r.json["request_id"] == r.headers["X-Request-ID"]


def test_partial_returns_good_images_and_errors(client: FlaskClient) -> None:
    r = client.post("/v1/embeddings", json={"images": ["g10.png", "html.jpg", "missing.png"], "partial": True})
    assert r.status_code == 200
    assert [d["index"] for d in r.json["data"]] == [0]
    assert [(e["index"], e["code"]) for e in r.json["errors"]] == [(1, "not_an_image"), (2, "fetch_failed")]


def test_request_id_is_echoed(client: FlaskClient) -> None:
    r = client.get("/healthz", headers={"X-Request-ID": "abc-123"})
    assert r.headers["X-Request-ID"] == "abc-123"


def test_hostile_request_id_is_replaced(client: FlaskClient) -> None:
    r = client.get("/healthz", headers={"X-Request-ID": "x" * 500})
    assert len(r.headers["X-Request-ID"]) == 32


@pytest.mark.parametrize("kwargs, status, code", [
    ({"data": b"{", "content_type": "application/json"}, 400, "invalid_json"),
    ({"data": b"hello", "content_type": "text/plain"}, 415, "unsupported_content_type"),
    ({"json": {"images": ["a.png"] * 9}}, 413, "too_many_images"),
    ({"data": b"x" * (65 * 1024), "content_type": "application/json"}, 413, "body_too_large"),
])
def test_malformed_requests_get_stable_codes(client: FlaskClient, kwargs: dict, status: int, code: str) -> None:
    r = client.post("/v1/embeddings", **kwargs)
    assert r.status_code == status and r.json["error"]["code"] == code
    assert r.json["error"]["message"]


def test_unknown_route_is_json_404(client: FlaskClient) -> None:
    r = client.get("/v3/nothing")
    assert r.status_code == 404 and r.json["error"]["code"] == "not_found"
    assert r.json["error"]["type"] == "invalid_request_error"  # what the openai SDK reads


def test_unknown_route_under_a_protocol_gets_that_protocols_error_shape(client: FlaskClient) -> None:
    r = client.get("/v2/nothing")  # OIP v2: "error" is the message string
    assert r.status_code == 404 and isinstance(r.json["error"], str) and r.json["code"] == "not_found"
    r = client.delete("/predictions/x")  # TorchServe: {"code": status, "type", "message"}
    assert r.status_code in (404, 405) and r.json["code"] == r.status_code and r.json["message"]


def test_failing_batch_is_500_and_worker_keeps_serving(fetcher: FakeFetcher) -> None:
    client = make_client(FakeModel(fail_when_batch_has=100), fetcher)
    r = client.post("/v1/embeddings", json={"images": ["g100.png"]})
    assert r.status_code == 500 and r.json["error"]["code"] == "inference_failed"
    assert "Traceback" not in r.get_data(as_text=True)
    assert client.post("/v1/embeddings", json={"images": ["g10.png"]}).status_code == 200


def test_inference_runs_off_the_main_thread(client: FlaskClient, model: FakeModel) -> None:
    client.post("/v1/embeddings", json={"images": ["g10.png"]})
    assert model.threads and "MainThread" not in model.threads


def test_models_readyz_healthz(client: FlaskClient) -> None:
    m = client.get("/v1/models").json["data"][0]
    assert m["name"] == "fake" and m["embedding_dim"] == 6 and m["labels_count"] == 10
    assert client.get("/readyz").status_code == 200
    assert client.get("/healthz").json["status"] == "ok"


def test_auth_token_required_when_set(model: FakeModel, fetcher: FakeFetcher) -> None:
    client = make_client(model, fetcher, api_token="s3cret")
    assert client.post("/v1/embeddings", json={"images": ["g10.png"]}).status_code == 401
    ok = client.post("/v1/embeddings", json={"images": ["g10.png"]}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert client.get("/healthz").status_code == 200  # probes stay open


def test_deadline_header_gives_504(fetcher: FakeFetcher) -> None:
    client = make_client(FakeModel(delay_s=0.5), fetcher)
    r = client.post("/v1/embeddings", json={"images": ["g10.png"]}, headers={"X-Request-Timeout": "0.1"})
    assert r.status_code == 504 and r.json["error"]["code"] == "deadline_exceeded"


def _oip(**parameters: object) -> dict[str, object]:
    inputs = [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["g10.png"],
               "parameters": {"content_type": "url"}}]  # a relative name, not base64
    return {"inputs": inputs, **({"parameters": parameters} if parameters else {})}


PASSED = {"X-Request-Timeout": "1e-9"}
PROTOCOLS = {  # (path, the request, what makes its deadline pass before its work)
    "native": ("/v1/embeddings", {"json": {"images": ["g10.png"]}}, {"headers": PASSED}),
    "native streamed": ("/v1/classify", {"json": {"images": ["g10.png"]}},
                        {"headers": {**PASSED, "Accept": "application/x-ndjson"}}),
    "OpenAI": ("/v1/embeddings", {"json": {"model": "fake", "input": ["g10.png"]}}, {"headers": PASSED}),
    "OIP timeout of 1 µs": ("/v2/models/fake/infer", {"json": _oip()}, {"json": _oip(timeout=1)}),
    "KServe v1": ("/v1/models/fake:predict", {"json": {"instances": ["g10.png"]}}, {"headers": PASSED}),
    "TorchServe": ("/predictions/fake", {"data": solid(10)}, {"headers": PASSED}),
}


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_deadline_passed_before_the_work_is_504_at_once_even_from_the_cache(model: FakeModel, fetcher: FakeFetcher,
                                                                              protocol: str) -> None:
    """Each request is first answered 200, so the embedding cache holds its image; again with its deadline
    passed, it is 504 with no work done (answered from the cache, it waited for nothing, so the deadline's timer
    never fired: it was 200)."""
    path, request, passed = PROTOCOLS[protocol]
    client = make_client(model, fetcher, cache="memory")
    assert client.post(path, **request).status_code == 200  # type: ignore[arg-type]
    forwards = len(model.batches)
    r = client.post(path, **{**request, **passed})  # type: ignore[arg-type]
    assert r.status_code == 504 and "deadline" in r.text, (protocol, r.text)
    assert len(model.batches) == forwards


@pytest.mark.parametrize("partial", [False, True])
def test_a_fetch_the_deadline_cut_short_is_504_not_the_images_422(fetcher: FakeFetcher, partial: bool) -> None:
    """The fetcher's timer for the request's deadline can fire before the request's own (gevent's loop time
    lags): its image error must still end the request 504, as the deadline anywhere else does."""
    fetcher.blobs[BASE + "late.png"] = FetchDeadline("the request deadline passed before this image could be fetched")
    client = make_client(FakeModel(), fetcher)
    r = client.post("/v1/embeddings", json={"images": ["g10.png", "late.png"], "partial": partial})
    assert r.status_code == 504 and r.json["error"]["code"] == "deadline_exceeded", r.json
    assert client.post("/v1/embeddings", json={"images": ["g10.png"]}).status_code == 200


def test_images_that_fail_on_the_way_are_not_waited_for(model: FakeModel, fetcher: FakeFetcher) -> None:
    """Images refused at parsing, fetching or decoding are settled at once: the good image's batch, told to
    wait up to 1 s for more images while any are on their way, goes as soon as none is."""
    client = make_client(model, fetcher, max_batch_wait_ms=1000)
    body = {"images": ["g10.png", "html.jpg", "missing.png", "data:image/png;base64,!!"], "partial": True}
    t0 = time.monotonic()
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 200 and len(r.json["data"]) == 1
    assert time.monotonic() - t0 < 0.8, "the batch waited for images that had already failed"
    runner = client.application.extensions["greenserve"].runner
    view = runner.scheduling.view()
    assert (view.upstream, view.admitted) == (0, 0)


def test_server_timing_header_on_every_response(client: FlaskClient) -> None:
    for r in (client.get("/healthz"), client.post("/v1/embeddings", json={"images": ["g10.png"]}),
              client.get("/nope")):
        name, _, dur = r.headers["Server-Timing"].partition(";dur=")
        assert name == "app" and float(dur) >= 0
