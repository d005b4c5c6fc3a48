"""immich's machine-learning protocol on real gunicorn, called by a client written from immich's server
(``immich_client.mjs``: Node's fetch and FormData, as ``machine-learning.repository.ts`` builds its requests).

The test CLIP (CLIP_ARCH, seeded weights) is served under an immich-style name; faces and OCR go to a stub of
immich's ML service that records each request byte for byte. Skips without Node 20 or later (``make test``
installs Debian's nodejs when it can).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from harness import images
from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import CLIP_ARCH, CLIP_LIMITS, e2e_env

pytestmark = pytest.mark.e2e
CLIENT = Path(__file__).with_name("immich_client.mjs")
NAME = f"{CLIP_ARCH}__e2e"  # immich's <architecture>__<pretrained tag>, the tag being this test's checkpoint
PHOTO = (800, 600)
FACES = {"facial-recognition": [], "imageHeight": 600, "imageWidth": 800}
OCR = {"ocr": {"text": [], "box": [], "boxScore": [], "textScore": []}, "imageHeight": 600, "imageWidth": 800}


def node_or_skip() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (make test installs Debian's nodejs as root; apt-get install nodejs)")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    major = int(re.match(r"v(\d+)", version).group(1)) if re.match(r"v(\d+)", version) else 0
    if major < 20:
        pytest.skip(f"node {version} is older than 20: immich's client needs the platform's fetch and FormData")
    return node


class StubUpstream:
    """immich's ML service as far as a forward goes: records each request (path, Content-Type, body) and answers
    as the real one would for faces and OCR; a modelName of "broken" gets a 500 in plain text."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, bytes]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                stub.requests.append((self.path, self.headers.get("Content-Type", ""), body))
                if b'"broken"' in body:
                    status, kind, answer = 500, "text/plain; charset=utf-8", b"boom"
                else:
                    status, kind = 200, "application/json"
                    answer = json.dumps(OCR if b'"ocr"' in body else FACES).encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StubUpstream:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[StubUpstream]:
    with StubUpstream() as stub:
        yield stub


@pytest.fixture(scope="module")
def immich_server(clip_checkpoint: Path, image_host: ImageHost, upstream: StubUpstream) -> Iterator[GunicornServer]:
    env = e2e_env(clip_checkpoint, image_host, GREENSERVE_MODELS=f"{NAME}=open_clip:{CLIP_ARCH}@{clip_checkpoint}",
                  GREENSERVE_IMMICH_UPSTREAM=upstream.url, **CLIP_LIMITS)
    with GunicornServer(env, workers=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def photo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("immich") / "preview.jpeg"
    path.write_bytes(images.jpeg(*PHOTO, seed=3))
    return path


def immich(server: GunicornServer, calls: list[dict[str, Any]], tmp_path: Path, encoder: str = "formdata") -> list[Any]:
    """The calls, made by the Node client in one run; its results in order."""
    node = node_or_skip()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"url": server.url, "encoder": encoder, "calls": calls}))
    done = subprocess.run([node, str(CLIENT), str(plan)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results: list[Any] = json.loads(done.stdout)
    return results


def vector(result: dict[str, Any]) -> np.ndarray:
    assert result["ok"], result
    text = result["body"]["clip"]
    assert isinstance(text, str) and text.startswith("[") and " " not in text  # pgvector's text form, unparsed
    return np.array(json.loads(text), dtype=np.float32)


def native(server: GunicornServer, **form: Any) -> np.ndarray:
    """The native API's answer for the same input: the reference the immich answer must equal."""
    if "photo" in form:
        r = requests.post(f"{server.url}/v1/embeddings", files={"images": form["photo"].read_bytes()},
                          data={"model": NAME}, timeout=60)
    else:
        r = requests.post(f"{server.url}/v1/embeddings", json={"texts": [form["text"]], "model": NAME}, timeout=60)
    assert r.status_code == 200, r.text
    return np.array(r.json()["data"][0]["embedding"], dtype=np.float32)


def test_ping_answers_2xx_as_immich_checks_it(immich_server: GunicornServer, tmp_path: Path) -> None:
    [result] = immich(immich_server, [{"op": "ping"}], tmp_path)
    assert result["ok"] and result["status"] == 200, result


@pytest.mark.parametrize("encoder", ["formdata", "manual"])
def test_image_and_text_vectors_parse_and_equal_the_native_api(immich_server: GunicornServer, photo: Path,
                                                                tmp_path: Path, encoder: str) -> None:
    image, text = immich(immich_server, [
        {"op": "encodeImage", "imagePath": str(photo), "modelName": NAME},
        {"op": "encodeText", "text": "  a photo\n of a   cat ", "modelName": NAME, "language": "de"},
    ], tmp_path, encoder)
    assert set(image["body"]) == {"clip", "imageHeight", "imageWidth"}
    assert (image["body"]["imageWidth"], image["body"]["imageHeight"]) == PHOTO
    assert set(text["body"]) == {"clip"}
    for got, expected in ((vector(image), native(immich_server, photo=photo)),
                          (vector(text), native(immich_server, text="a photo of a cat"))):  # immich's whitespace rule
        assert got.shape == (256,) and abs(float(np.linalg.norm(got)) - 1) < 1e-5
        np.testing.assert_allclose(got, expected, atol=1e-6)


def test_bad_entries_are_422_and_no_input_is_400(immich_server: GunicornServer, photo: Path, tmp_path: Path) -> None:
    not_json, no_name, nothing = immich(immich_server, [
        {"op": "raw", "entries": "{not json", "imagePath": str(photo)},
        {"op": "raw", "entries": json.dumps({"clip": {"visual": {}}}), "imagePath": str(photo)},
        {"op": "raw", "entries": json.dumps({"clip": {"visual": {"modelName": NAME}}})},
    ], tmp_path)
    assert (not_json["status"], no_name["status"], nothing["status"]) == (422, 422, 400)
    assert not_json["body"]["code"] == no_name["body"]["code"] == "invalid_entries"
    assert nothing["body"]["detail"] == "Either image or text must be provided"


def test_a_text_past_the_limit_is_413_and_the_workers_answer_after(immich_server: GunicornServer) -> None:
    pids = immich_server.worker_pids()
    entries = json.dumps({"clip": {"textual": {"modelName": NAME}}})

    def query(text: str) -> requests.Response:
        return requests.post(f"{immich_server.url}/predict", files={"entries": (None, entries), "text": (None, text)},
                             timeout=60)

    too_long = query("x" * (int(CLIP_LIMITS["GREENSERVE_MAX_TEXT_CHARS"]) + 1))
    assert too_long.status_code == 413 and too_long.json()["code"] == "text_too_long", too_long.text
    assert "GREENSERVE_MAX_TEXT_CHARS" in too_long.json()["detail"]
    assert query("a dog on a beach").status_code == 200
    assert immich_server.worker_pids() == pids and immich_server.healthz_pids() == pids


def test_a_model_not_served_is_404_naming_the_one_served(immich_server: GunicornServer, photo: Path,
                                                         tmp_path: Path) -> None:
    image, text = immich(immich_server, [
        {"op": "encodeImage", "imagePath": str(photo), "modelName": "ViT-B-32__openai"},
        {"op": "encodeText", "text": "a cat", "modelName": "ViT-B-16-SigLIP__webli"},
    ], tmp_path)
    for result in (image, text):
        assert not result["ok"] and result["status"] == 404, result
        assert result["body"]["code"] == "model_not_found" and NAME in result["body"]["detail"]


@pytest.mark.parametrize("encoder", ["formdata", "manual"])
def test_faces_and_ocr_are_forwarded_byte_for_byte(immich_server: GunicornServer, upstream: StubUpstream,
                                                   photo: Path, tmp_path: Path, encoder: str) -> None:
    before = len(upstream.requests)
    faces, ocr = immich(immich_server, [
        {"op": "detectFaces", "imagePath": str(photo), "modelName": "buffalo_l", "minScore": 0.7},
        {"op": "ocr", "imagePath": str(photo), "modelName": "PP-OCRv5_mobile", "minDetectionScore": 0.5,
         "minRecognitionScore": 0.8, "maxResolution": 736},
    ], tmp_path, encoder)
    assert (faces["status"], faces["body"]) == (200, FACES) and (ocr["status"], ocr["body"]) == (200, OCR)
    assert faces["contentType"] == ocr["contentType"] == "application/json"
    forwarded = upstream.requests[before:]
    assert [(path, kind, body) for path, kind, body in forwarded] == [
        ("/predict", result["sentType"], base64.b64decode(result["sent"])) for result in (faces, ocr)]


def test_an_upstream_error_comes_back_as_it_is(immich_server: GunicornServer, photo: Path, tmp_path: Path) -> None:
    [broken] = immich(immich_server, [{"op": "detectFaces", "imagePath": str(photo), "modelName": "broken",
                                       "minScore": 0.7}], tmp_path)
    assert (broken["ok"], broken["status"], broken["body"]) == (False, 500, "boom")
    assert broken["contentType"] == "text/plain; charset=utf-8"


def test_metrics_count_predict_per_task(immich_server: GunicornServer, photo: Path, tmp_path: Path) -> None:
    immich(immich_server, [{"op": "encodeImage", "imagePath": str(photo), "modelName": NAME},
                           {"op": "detectFaces", "imagePath": str(photo), "modelName": "buffalo_l", "minScore": 0.7}],
           tmp_path)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(
        requests.get(f"{immich_server.url}/metrics", timeout=10).text) for s in family.samples}
    for task in ("clip-visual", "facial-recognition"):
        assert samples[("greenserve_immich_requests_total", (("status", "2xx"), ("task", task)))] >= 1, task
        assert samples[("greenserve_immich_request_seconds_count", (("task", task),))] >= 1, task
    assert samples[("greenserve_model_requests_total", (("model", NAME),))] >= 1
