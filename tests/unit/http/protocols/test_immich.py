"""immich's /predict with a fake model served under an immich name: entries as immich's ML service reads them,
its error statuses, the vector as a string, and faces/OCR forwarded to an upstream (a fake one, then real HTTP)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image

from harness import images
from harness.fakes import FakeFetcher, FakeModel
from service.app import create_app
from service.errors import DeadlineExceeded, Unprocessable, UpstreamFailed
from service.http.protocols import immich
from service.http.protocols.immich import Entries, parse_entries
from service.http.upstream import Forwarded, HttpUpstream
from service.settings import Settings, SettingsError

NAME = "ViT-B-32__openai"
VISUAL = json.dumps({"clip": {"visual": {"modelName": NAME}}})
TEXTUAL = json.dumps({"clip": {"textual": {"modelName": NAME, "options": {"language": "de"}}}})
FACES = json.dumps({"facial-recognition": {"detection": {"modelName": "buffalo_l", "options": {"minScore": 0.7}},
                                           "recognition": {"modelName": "buffalo_l"}}})


class FakeUpstream:
    def __init__(self, answer: Forwarded) -> None:
        self.answer = answer
        self.calls: list[tuple[str, bytes, str]] = []

    def forward(self, path: str, body: bytes, content_type: str, *, deadline: float, request_id: str) -> Forwarded:
        assert deadline > time.monotonic() and request_id
        self.calls.append((path, body, content_type))
        return self.answer


def make_client(upstream: FakeUpstream | None = None, **settings: Any) -> FlaskClient:
    s = Settings(**{"models": f"{NAME}=open_clip:ViT-B-32@openai", "max_body_bytes": 256 * 1024, **settings})
    return create_app(s, model=FakeModel(), fetcher=FakeFetcher({}), upstream=upstream).test_client()


@pytest.fixture()
def client() -> FlaskClient:
    return make_client()


def photo(width: int = 48, height: int = 32) -> bytes:
    return images.encode(Image.new("RGB", (width, height), (120, 60, 30)), "JPEG")


def form(entries: str | None, image: bytes | None = None, text: str | None = None) -> dict[str, Any]:
    """immich's parts: 'entries', then the image as a nameless Blob (filename "blob") or the text."""
    parts: dict[str, Any] = {} if entries is None else {"entries": entries}
    if image is not None:
        parts["image"] = (io.BytesIO(image), "blob", "application/octet-stream")
    if text is not None:
        parts["text"] = text
    return parts


def predict(client: FlaskClient, parts: dict[str, Any], **kw: Any) -> Any:
    return client.post("/predict", data=parts, content_type="multipart/form-data", **kw)


# ---------------------------------------------------------------------- entries


@pytest.mark.parametrize(("raw", "expected"), [
    (VISUAL, Entries(("clip",), "visual", NAME, {})),
    (TEXTUAL, Entries(("clip",), "textual", NAME, {"language": "de"})),
    (json.dumps({"clip": {"textual": {"modelName": NAME, "options": None}}}), Entries(("clip",), "textual", NAME, {})),
    (FACES, Entries(("facial-recognition",))),
    (json.dumps({"ocr": {"detection": {"modelName": "PP-OCRv5_mobile"}, "recognition": {"modelName": "x"}}}),
     Entries(("ocr",))),
])
def test_entries_are_read_as_immich_reads_them(raw: str, expected: Entries) -> None:
    assert parse_entries(raw) == expected


@pytest.mark.parametrize("raw", [None, "", "{not json", "[]", "{}", '{"clip": []}', '{"clip": {}}',
                                 '{"clip": {"visual": {}}}', '{"clip": {"visual": {"modelName": 3}}}',
                                 '{"clip": {"visual": "ViT-B-32__openai"}}',
                                 '{"clip": {"visual": {"modelName": "m", "options": [1]}}}',
                                 '{"clip": {"detection": {"modelName": "m"}}}',
                                 '{"clip": {"visual": {"modelName": "m"}, "textual": {"modelName": "m"}}}'])
def test_entries_immich_cannot_read_are_422(raw: str | None) -> None:
    with pytest.raises(Unprocessable) as raised:
        parse_entries(raw)
    assert raised.value.status_code == 422 and raised.value.code == "invalid_entries"


@pytest.mark.parametrize(("raw", "label"), [(VISUAL, "clip-visual"), (TEXTUAL, "clip-textual"),
                                            (FACES, "facial-recognition"), ('{"nsfw": {"x": {"modelName": "m"}}}', "other")])
def test_the_metrics_label_is_bounded(raw: str, label: str) -> None:
    assert parse_entries(raw).label == label


# ---------------------------------------------------------------------- /predict


def test_an_image_answers_the_vector_as_a_string_and_the_image_size(client: FlaskClient) -> None:
    r = predict(client, form(VISUAL, photo(48, 32)))
    assert r.status_code == 200, r.json
    assert set(r.json) == {"clip", "imageHeight", "imageWidth"} and (r.json["imageWidth"], r.json["imageHeight"]) == (48, 32)
    vector = np.array(json.loads(r.json["clip"]), dtype=np.float32)
    native = client.post("/v1/embeddings", data={"images": (io.BytesIO(photo(48, 32)), "a.jpg")},
                         content_type="multipart/form-data").json["data"][0]["embedding"]
    assert vector.shape == (6,) and np.allclose(vector, native, atol=1e-7)
    assert r.json["clip"] == immich.vector_text(np.array(native, dtype=np.float32))  # orjson's float32 text


def test_the_image_size_is_the_stored_one_as_immich_reads_it(client: FlaskClient) -> None:
    """immich's service opens the image with Pillow and reports its size before any EXIF rotation."""
    r = predict(client, form(VISUAL, images.jpeg_with_orientation(6, width=64, height=32)))
    assert r.status_code == 200 and (r.json["imageWidth"], r.json["imageHeight"]) == (64, 32)


def test_a_text_reaches_the_model_as_a_text(client: FlaskClient) -> None:
    r = predict(client, form(TEXTUAL, text="ein  Hund"))
    assert r.status_code == 400 and r.json["code"] == "text_not_supported"  # the fake has no text tower


@pytest.mark.parametrize(("parts", "status", "code"), [
    (form(None, photo()), 422, "invalid_entries"),
    (form("{oops", photo()), 422, "invalid_entries"),
    (form(VISUAL), 400, "invalid_request"),
    (form(VISUAL, text=""), 400, "invalid_request"),  # FastAPI reads an empty form field as absent
    (form(VISUAL, text="a dog"), 400, "invalid_request"),
    (form(TEXTUAL, photo()), 400, "invalid_request"),
    (form(json.dumps({"clip": {"visual": {"modelName": "ViT-L-14__openai"}}}), photo()), 404, "model_not_found"),
    (form(VISUAL, b"not an image"), 422, "not_an_image"),
    (form(TEXTUAL, text="x" * 2001), 413, "text_too_long"),  # GREENSERVE_MAX_TEXT_CHARS, as the native texts
])
def test_errors_have_immichs_statuses_and_fastapis_shape(client: FlaskClient, parts: dict[str, Any], status: int,
                                                          code: str) -> None:
    r = predict(client, parts)
    assert r.status_code == status, r.json
    assert set(r.json) == {"detail", "code", "details", "request_id"} and r.json["code"] == code
    assert isinstance(r.json["detail"], str)


def test_neither_image_nor_text_says_so_in_immichs_words(client: FlaskClient) -> None:
    assert predict(client, form(VISUAL)).json["detail"] == "Either image or text must be provided"


def test_an_unserved_model_names_the_served_one(client: FlaskClient) -> None:
    r = predict(client, form(json.dumps({"clip": {"visual": {"modelName": "ViT-L-14__openai"}}}), photo()))
    assert NAME in r.json["detail"] and "GREENSERVE_MODELS=ViT-L-14__openai=open_clip:ViT-L-14__openai" in r.json["detail"]


def test_a_json_body_is_415(client: FlaskClient) -> None:
    r = client.post("/predict", json={"entries": VISUAL})
    assert r.status_code == 415 and "multipart/form-data" in r.json["detail"]


def test_predict_needs_the_token_and_ping_never_does() -> None:
    client = make_client(api_token="s3cret")
    assert client.get("/ping").status_code == 200
    r = predict(client, form(VISUAL, photo()))
    assert r.status_code == 401 and r.json["code"] == "unauthorized" and "detail" in r.json
    assert predict(client, form(VISUAL, photo()), headers={"Authorization": "Bearer s3cret"}).status_code == 200


# ---------------------------------------------------------------------- faces and OCR


def test_faces_without_an_upstream_are_501_saying_what_to_set(client: FlaskClient) -> None:
    r = predict(client, form(FACES, photo()))
    assert r.status_code == 501 and r.json["code"] == "task_not_served"
    assert "GREENSERVE_IMMICH_UPSTREAM" in r.json["detail"]


def test_faces_go_to_the_upstream_as_they_came_and_its_answer_comes_back() -> None:
    upstream = FakeUpstream(Forwarded(418, b'{"facial-recognition": []}', "application/x-test"))
    client = make_client(upstream)
    body = (b'--b0\r\nContent-Disposition: form-data; name="entries"\r\n\r\n' + FACES.encode() +
            b'\r\n--b0\r\nContent-Disposition: form-data; name="image"; filename="blob"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n" + photo() + b"\r\n--b0--\r\n")
    r = client.post("/predict", data=body, content_type="multipart/form-data; boundary=b0")
    assert upstream.calls == [("/predict", body, "multipart/form-data; boundary=b0")]
    assert (r.status_code, r.data, r.content_type) == (418, b'{"facial-recognition": []}', "application/x-test")


def test_the_upstream_setting_is_an_http_url() -> None:
    assert Settings(immich_upstream="http://immich-machine-learning:3003").immich_upstream
    with pytest.raises(SettingsError, match="GREENSERVE_IMMICH_UPSTREAM"):
        Settings(immich_upstream="immich-machine-learning:3003")


# ---------------------------------------------------------------------- the upstream over real HTTP


class _JoinedServer(ThreadingHTTPServer):
    # Handler threads are joined at close: one left writing to a client that hung up printed its traceback
    # during a later test, and on CPython 3.11 two threads building ASTs at once (3.11's traceback parses the
    # failing line for its carets; werkzeug parses while it adds a route) can raise "AST constructor recursion
    # depth mismatch" in the other thread.
    daemon_threads = False
    block_on_close = True

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # the slow route's client hangs up: expected
            super().handle_error(request, client_address)


@pytest.fixture()
def service() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """A local HTTP server: /slow waits until the test ends (2 s at most), /big sends 2 KB, anything else
    echoes the body back with 207."""
    seen: list[tuple[str, bytes]] = []
    ended = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.headers["Content-Type"], body))
            if self.path.endswith("/slow"):
                ended.wait(2)
            answer = b"x" * 2048 if self.path.endswith("/big") else body
            self.send_response(207)
            self.send_header("Content-Type", "application/x-echo")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = _JoinedServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/ml/", seen
    ended.set()
    server.shutdown()
    server.server_close()  # joins the handler threads


@contextlib.contextmanager
def upstream_at(url: str) -> Iterator[HttpUpstream]:
    upstream = HttpUpstream(url, connect_timeout_s=1.0, max_answer_bytes=1024)
    try:
        yield upstream
    finally:
        upstream.close()


def test_a_forward_sends_the_bytes_and_returns_the_answer(service: tuple[str, list[tuple[str, bytes]]]) -> None:
    url, seen = service
    with upstream_at(url) as upstream:
        answer = upstream.forward("/predict", b"\x00body\xff", "multipart/form-data; boundary=x",
                                  deadline=time.monotonic() + 5, request_id="r1")
    assert answer == Forwarded(207, b"\x00body\xff", "application/x-echo")
    assert seen == [("multipart/form-data; boundary=x", b"\x00body\xff")]


def test_an_upstream_that_is_down_is_502(service: tuple[str, list[tuple[str, bytes]]]) -> None:
    with upstream_at("http://127.0.0.1:9/") as upstream, pytest.raises(UpstreamFailed) as raised:
        upstream.forward("/predict", b"", "x", deadline=time.monotonic() + 5, request_id="r")
    assert raised.value.status_code == 502 and raised.value.code == "upstream_unreachable"


def test_a_slow_upstream_is_504_within_the_deadline(service: tuple[str, list[tuple[str, bytes]]]) -> None:
    started = time.monotonic()
    with upstream_at(service[0]) as upstream, pytest.raises(DeadlineExceeded) as raised:
        upstream.forward("/slow", b"", "x", deadline=started + 0.3, request_id="r")
    assert raised.value.code == "upstream_timeout" and time.monotonic() - started < 1.5


def test_an_answer_past_the_cap_is_502(service: tuple[str, list[tuple[str, bytes]]]) -> None:
    with upstream_at(service[0]) as upstream, pytest.raises(UpstreamFailed) as raised:
        upstream.forward("/big", b"", "x", deadline=time.monotonic() + 5, request_id="r")
    assert raised.value.code == "upstream_failed"
