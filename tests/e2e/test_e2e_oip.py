"""End to end, Open Inference Protocol v2 with the real tritonclient (HTTP) against a real gunicorn -k gevent
greenserve (2 workers, resnet18: D=512, C=1000): health, metadata, config, binary BYTES infer with parity to
the native routes, the classification extension, compression, async concurrency, and hostile input."""

from __future__ import annotations

import base64
import gzip
import json
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import E2E_MODEL, MODEL_WORK
from harness.servers import GUARD_TOKEN as TOKEN

pytestmark = pytest.mark.e2e
TIMEOUT = 60
NAMES = ["img000.jpg", "img001.jpg", "img002.jpg"]


def client(server: GunicornServer, concurrency: int = 1) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(url=server.url.removeprefix("http://"), concurrency=concurrency,
                                            connection_timeout=TIMEOUT, network_timeout=TIMEOUT)


def image_input(blobs: list[bytes]) -> httpclient.InferInput:
    batch = np.array([[b] for b in blobs], dtype=np.object_)  # (N, 1): one encoded image per element
    inp = httpclient.InferInput("IMAGE", list(batch.shape), "BYTES")
    inp.set_data_from_numpy(batch, binary_data=True)
    return inp


def binary_body(blobs: list[bytes], shape: list[int] | None = None) -> tuple[bytes, int]:
    """What tritonclient sends: the JSON, then each element as a 4-byte little-endian length and its bytes."""
    tensor = b"".join(struct.pack("<I", len(b)) + b for b in blobs)
    head = json.dumps({"inputs": [{"name": "IMAGE", "shape": shape or [len(blobs), 1], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": len(tensor)}}]}).encode()
    return head + tensor, len(head)


def native(server: GunicornServer, path: str, names: list[str], album: dict[str, bytes], **extra: object) -> dict:
    images = ["data:image/jpeg;base64," + base64.b64encode(album[n]).decode() for n in names]
    r = requests.post(server.url + path, json={"images": images, **extra}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def test_health_metadata_and_config(server: GunicornServer) -> None:
    with client(server) as c:
        assert c.is_server_live() and c.is_server_ready()
        assert c.is_model_ready(E2E_MODEL) and c.is_model_ready(E2E_MODEL, "1")
        assert not c.is_model_ready("nope") and not c.is_model_ready(E2E_MODEL, "2")
        meta = c.get_server_metadata()
        assert meta["name"] == "greenserve"
        assert {"binary_tensor_data", "classification", "model_configuration", "parameters"} <= set(meta["extensions"])
        assert c.get_model_metadata(E2E_MODEL) == {
            "name": E2E_MODEL, "versions": ["1"], "platform": "pytorch_torchvision",
            "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [-1, 1]}],
            "outputs": [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 512]},
                        {"name": "PROBABILITIES", "datatype": "FP32", "shape": [-1, 1000]}]}
        config = c.get_model_config(E2E_MODEL, "1")
        assert config["max_batch_size"] == 40  # GREENSERVE_MAX_IMAGES in the e2e env
        assert config["input"] == [{"name": "IMAGE", "data_type": "TYPE_STRING", "format": "FORMAT_NONE", "dims": [1]}]
        with pytest.raises(InferenceServerException) as err:
            c.get_model_metadata("nope")
        assert err.value.status() == "404" and "unknown model" in err.value.message()
    assert requests.get(server.url + "/v2/", timeout=TIMEOUT).json()["name"] == "greenserve"
    assert requests.get(server.url + "/v2/models", timeout=TIMEOUT).json() == {"models": [E2E_MODEL]}
    index = requests.post(server.url + "/v2/repository/index", timeout=TIMEOUT).json()
    assert index == [{"name": E2E_MODEL, "version": "1", "state": "READY"}]
    r = requests.get(server.url + "/v2/models/nope/ready", timeout=TIMEOUT)
    assert r.status_code == 404 and isinstance(r.json()["error"], str) and r.json()["code"] == "model_not_found"


def test_binary_infer_matches_the_native_routes(server: GunicornServer, album: dict[str, bytes]) -> None:
    blobs = [album[n] for n in NAMES]
    outputs = [httpclient.InferRequestedOutput("EMBEDDING", binary_data=True),
               httpclient.InferRequestedOutput("PROBABILITIES", binary_data=True, class_count=3)]
    with client(server) as c:
        res = c.infer(E2E_MODEL, [image_input(blobs)], outputs=outputs, request_id="r-1")
        raw = c.infer(E2E_MODEL, [image_input(blobs)], outputs=outputs[:1], parameters={"normalize": False})
    emb = res.as_numpy("EMBEDDING")
    assert emb.shape == (3, 512) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    want = native(server, "/v1/embeddings", NAMES, album)["data"]
    np.testing.assert_allclose(emb, [d["embedding"] for d in want], atol=1e-6)
    unnormalised = native(server, "/v1/embeddings", NAMES, album, normalize=False)["data"]
    np.testing.assert_allclose(raw.as_numpy("EMBEDDING"), [d["embedding"] for d in unnormalised], rtol=1e-5)
    top3 = [[s.decode().split(":", 2) for s in row] for row in res.as_numpy("PROBABILITIES")]
    classify = native(server, "/v1/classify", NAMES, album, top_k=3)["data"]
    for row, item in zip(top3, classify, strict=True):
        assert [(int(i), label) for _, i, label in row] == [(c["class_id"], c["label"]) for c in item["labels"]]
        assert [score for score, _, _ in row] == [f"{c['score']:.6f}" for c in item["labels"]]
    assert res.get_response()["id"] == "r-1"


def test_all_outputs_by_default_and_json_outputs_agree(server: GunicornServer, album: dict[str, bytes]) -> None:
    """Bit for bit: each request is the model's own forward of the same batch of two (no-cache). A cache
    entry from an earlier batch of three, or a store that timed out into a fresh forward, differs in the
    last bits, and this test is about the encodings, not about which forward answered. Each call gets its own
    headers dict: tritonclient adds Content-Encoding to the one it is given."""
    blobs = [album[n] for n in NAMES[:2]]
    with client(server) as c:
        both = c.infer(E2E_MODEL, [image_input(blobs)], headers=dict(MODEL_WORK))  # outputs=None: binary_data_output
        as_json = c.infer(E2E_MODEL, [image_input(blobs)], headers=dict(MODEL_WORK), outputs=[
            httpclient.InferRequestedOutput("EMBEDDING", binary_data=False),
            httpclient.InferRequestedOutput("PROBABILITIES", binary_data=False)])
        gz = c.infer(E2E_MODEL, [image_input(blobs)], headers=dict(MODEL_WORK), request_compression_algorithm="gzip",
                     response_compression_algorithm="gzip")
    probs = both.as_numpy("PROBABILITIES")
    assert probs.shape == (2, 1000)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-4)
    for name in ("EMBEDDING", "PROBABILITIES"):
        np.testing.assert_array_equal(both.as_numpy(name), as_json.as_numpy(name))
        np.testing.assert_array_equal(both.as_numpy(name), gz.as_numpy(name))


def test_async_infers_spread_over_both_workers(server: GunicornServer, album: dict[str, bytes]) -> None:
    blobs = [album[f"img00{i}.jpg"] for i in range(8)]
    with client(server) as c:
        want = [c.infer(E2E_MODEL, [image_input([b])]).as_numpy("EMBEDDING") for b in blobs]
    with client(server, concurrency=4) as c:
        pending = [c.async_infer(E2E_MODEL, [image_input([b])]) for b in blobs * 2]
        results = [p.get_result(timeout=TIMEOUT) for p in pending]
    for i, res in enumerate(results):
        np.testing.assert_allclose(res.as_numpy("EMBEDDING"), want[i % 8], atol=1e-6)
    pids = {res.get_response()["parameters"]["worker_pid"] for res in results}
    assert len(pids) == 2, f"4 connections were all answered by {pids}"


def _status(call: object) -> str:
    with pytest.raises(InferenceServerException) as err:
        call()  # type: ignore[operator]
    return str(err.value.status())


def test_hostile_tensors_are_refused_and_the_workers_survive(server: GunicornServer, album: dict[str, bytes]) -> None:
    pids = server.worker_pids()
    with client(server) as c:
        with pytest.raises(InferenceServerException) as err:
            c.infer(E2E_MODEL, [image_input([album["img000.jpg"], b"not an image"])])
        assert err.value.status() == "422" and "IMAGE[1]" in err.value.message()
        assert _status(lambda: c.infer(E2E_MODEL, [image_input([b"\xff" * (9 << 20)])])) == "413"  # > the 8 MB body cap
        assert _status(lambda: c.infer(E2E_MODEL, [image_input([album["img000.jpg"]] * 41)])) == "413"
        assert _status(lambda: c.infer("nope", [image_input([album["img000.jpg"]])])) == "404"
        assert _status(lambda: c.infer(E2E_MODEL, [image_input([album["img000.jpg"]])], outputs=[
            httpclient.InferRequestedOutput("LOGITS")])) == "400"
        assert c.infer(E2E_MODEL, [image_input([album["img001.jpg"]])]).as_numpy("EMBEDDING").shape == (1, 512)
    url = f"{server.url}/v2/models/{E2E_MODEL}/infer"
    wrong_shape, length = binary_body([album["img000.jpg"]], shape=[3, 1])
    body, _ = binary_body([album["img000.jpg"]])
    for data, headers in ((wrong_shape, {"Inference-Header-Content-Length": str(length)}),  # 3 declared, 1 sent
                          (body, {}),  # binary data without the header
                          (body + b"xx", {"Inference-Header-Content-Length": str(length)})):  # leftover bytes
        r = requests.post(url, data=data, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text
    assert server.worker_pids() == pids


def test_raw_binary_json_base64_and_url_inputs(server: GunicornServer, album: dict[str, bytes],
                                              image_host: ImageHost) -> None:
    url = f"{server.url}/v2/models/{E2E_MODEL}/infer"
    r = requests.post(url, data=album["img002.jpg"], headers={"Inference-Header-Content-Length": "0"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    res = httpclient.InferenceServerClient.parse_response_body(
        r.content, header_length=int(r.headers["Inference-Header-Content-Length"]))
    want = native(server, "/v1/embeddings", ["img002.jpg"], album)["data"][0]["embedding"]
    np.testing.assert_allclose(res.as_numpy("EMBEDDING")[0], want, atol=1e-6)
    b64 = base64.b64encode(album["img002.jpg"]).decode()  # TorchServe's mnist_v2_bytes.json shape
    r = requests.post(url, json={"inputs": [{"name": "5e0e3f2a", "shape": [-1], "datatype": "BYTES", "data": [b64]}]},
                      timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    np.testing.assert_allclose(out["EMBEDDING"]["data"], want, atol=1e-6)
    inputs = [{"name": "IMAGE", "shape": [2], "datatype": "BYTES", "parameters": {"content_type": "url"},
               "data": ["img002.jpg", image_host.url("img003.jpg")]}]
    r = requests.post(url, data=json.dumps({"inputs": inputs}),  # what curl -d sends: a form Content-Type
                      headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["outputs"][0]["data"][:512], want, atol=1e-6)
    inputs[0]["data"] = ["img002.jpg", "http://169.254.169.254/latest/meta-data/"]
    r = requests.post(url, json={"inputs": inputs}, timeout=TIMEOUT)
    assert r.status_code == 422 and r.json()["code"] == "url_not_allowed", r.text
    r = requests.post(url, data=gzip.compress(json.dumps({"inputs": inputs}).encode()),
                      headers={"Content-Encoding": "br"}, timeout=TIMEOUT)
    assert r.status_code == 415 and r.json()["code"] == "unsupported_content_encoding"


def test_token_guards_infer_not_health(guarded: GunicornServer, album: dict[str, bytes]) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with client(guarded) as c:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(E2E_MODEL)
        assert _status(lambda: c.infer(E2E_MODEL, [image_input([album["img000.jpg"]])])) == "401"
        assert _status(lambda: c.get_model_metadata(E2E_MODEL)) == "401"
        res = c.infer(E2E_MODEL, [image_input([album["img000.jpg"]])], headers=auth)
        assert res.as_numpy("EMBEDDING").shape == (1, 512)


def test_a_flood_gets_503_with_retry_after(guarded: GunicornServer, album: dict[str, bytes]) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    blobs = [album["big.jpg"]] * 3
    with client(guarded, concurrency=8) as c:
        # a fresh dict each call: tritonclient writes Inference-Header-Content-Length into the one it is given
        pending = [c.async_infer(E2E_MODEL, [image_input(blobs)], headers=dict(auth)) for _ in range(8)]
        statuses = []
        for p in pending:
            try:
                p.get_result(timeout=TIMEOUT)
                statuses.append("200")
            except InferenceServerException as err:
                statuses.append(str(err.status()))
    assert "503" in statuses and "200" in statuses, statuses
    body, length = binary_body(blobs)  # the same flood over raw HTTP, to see the headers
    headers = {**auth, "Inference-Header-Content-Length": str(length)}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: requests.post(f"{guarded.url}/v2/models/{E2E_MODEL}/infer", data=body,
                                                        headers=headers, timeout=TIMEOUT), range(8)))
    refused = [r for r in answers if r.status_code == 503]
    assert refused and all(int(r.headers["Retry-After"]) >= 1 and r.json()["code"] == "overloaded" for r in refused)
    with client(guarded, concurrency=1) as c:  # and the worker answers afterwards
        assert c.infer(E2E_MODEL, [image_input([album["img000.jpg"]])], headers=auth).as_numpy("EMBEDDING").shape == (1, 512)


def test_statistics_in_tritons_shape_count_this_infer(server: GunicornServer, album: dict[str, bytes]) -> None:
    with client(server) as c:
        before = c.get_inference_statistics(E2E_MODEL)["model_stats"][0]
        c.infer(E2E_MODEL, [image_input([album[n] for n in NAMES])], headers=MODEL_WORK)
        after = c.get_inference_statistics(E2E_MODEL, "1")["model_stats"][0]
        every = c.get_inference_statistics()["model_stats"]
        with pytest.raises(InferenceServerException, match="unknown model"):
            c.get_inference_statistics("nope")
    assert (after["name"], after["version"]) == (E2E_MODEL, "1") and [m["name"] for m in every] == [E2E_MODEL]
    assert after["inference_count"] >= before["inference_count"] + len(NAMES)
    assert after["execution_count"] >= before["execution_count"] + 1
    stats, was = after["inference_stats"], before["inference_stats"]
    for key in ("success", "queue", "compute_input", "compute_infer"):
        assert stats[key]["count"] >= was[key]["count"] + 1 and stats[key]["ns"] > was[key]["ns"], key
    assert stats["success"]["ns"] >= stats["compute_infer"]["ns"]
    assert after["last_inference"] >= before["last_inference"] and after["last_inference"] > 1.7e12  # ms, Unix


def test_extensions_it_does_not_serve_and_unknown_models_answer_in_oip_shape(server: GunicornServer) -> None:
    pids = server.worker_pids()
    calls = [("GET", "/v2/systemsharedmemory/status"), ("POST", "/v2/systemsharedmemory/region/r/register"),
             ("GET", "/v2/cudasharedmemory/status"), ("POST", "/v2/cudasharedmemory/region/r/unregister"),
             ("GET", "/v2/trace/setting"), ("POST", "/v2/logging"), ("POST", "/v2/repository/models/no-such-model/load"),
             ("DELETE", f"/v2/models/{E2E_MODEL}/infer"), ("GET", f"/v2/models/{E2E_MODEL}/infer")]
    for method, path in calls:
        r = requests.request(method, server.url + path, json={}, timeout=TIMEOUT)
        assert r.status_code in (400, 404, 405) and r.headers["Content-Type"] == "application/json", (path, r.text)
        assert isinstance(r.json()["error"], str) and r.json()["code"], (path, r.text)
    with client(server) as c, pytest.raises(InferenceServerException) as err:
        c.get_system_shared_memory_status()
    assert "not" in str(err.value).lower() and "<html" not in str(err.value).lower()
    assert server.worker_pids() == pids
