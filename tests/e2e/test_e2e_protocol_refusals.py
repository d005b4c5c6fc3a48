"""End to end, the refusals added with the protocols that the client-library tests do not reach, each sent to
a real gunicorn -k gevent (2 workers, resnet18): the JSON error code in the protocol's shape, and the same
workers answering afterwards."""

from __future__ import annotations

import base64
import gzip
import json

import pytest
import requests

from harness.answers import code_of
from harness.launch import GunicornServer
from harness.servers import E2E_MODEL

pytestmark = pytest.mark.e2e
TIMEOUT = 60
OIP_NOT_BASE64 = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["not base64!"]}]}


def refusals(url: str) -> list[tuple[requests.Response, int, str]]:
    """(response, status, code) for each refusal; ``code`` read from where that protocol puts it."""
    oip = f"{url}/v2/models/{E2E_MODEL}/infer"
    return [
        (requests.post(oip, json=OIP_NOT_BASE64, timeout=TIMEOUT), 422, "invalid_base64"),
        (requests.post(oip, data=gzip.compress(json.dumps(OIP_NOT_BASE64).encode()),
                       headers={"Content-Encoding": "br"}, timeout=TIMEOUT), 415, "unsupported_content_encoding"),
        (requests.post(oip, data=b"x" * 10, headers={"Inference-Header-Content-Length": "999"}, timeout=TIMEOUT),
         400, "invalid_tensor"),
        (requests.post(f"{url}/v1/models/{E2E_MODEL}:predict", timeout=TIMEOUT,
                       json={"instances": [{"b64": base64.b64encode(b"x").decode() + "!"}]}), 422, "invalid_base64"),
        (requests.put(f"{url}/predictions/{E2E_MODEL}", json={"instances": ["img000.jpg"]}, timeout=TIMEOUT),
         415, "unsupported_content_type"),
        (requests.post(f"{url}/predictions/nope", data=b"x", timeout=TIMEOUT), 404, "model_not_found"),
        (requests.post(f"{url}/v1/classify", timeout=TIMEOUT,  # more form parts than images + labels allow
                       files=[("images", ("a.jpg", b"x"))] + [("labels", (None, f"l{i}")) for i in range(1100)]),
         413, "body_too_large"),
    ]


def test_protocol_refusals_keep_their_codes_and_the_workers(server: GunicornServer) -> None:
    pids = server.worker_pids()
    for response, status, code in refusals(server.url):
        assert (response.status_code, code_of(response)) == (status, code), response.text
        assert int(response.headers["X-Worker-PID"]) in pids
        if code == "body_too_large":  # the form's part count, said as such (its bytes are under the cap)
            assert "parts" in response.json()["error"]["message"]
    assert server.worker_pids() == pids and server.healthz_pids() == pids
    ok = requests.post(f"{server.url}/v2/models/{E2E_MODEL}/infer", timeout=TIMEOUT, json={"inputs": [
        {"name": "IMAGE", "datatype": "BYTES", "shape": [1], "parameters": {"content_type": "url"},
         "data": ["img000.jpg"]}]})
    assert ok.status_code == 200 and int(ok.headers["X-Worker-PID"]) in pids
