"""Streamed answers (``Accept: application/x-ndjson`` / ``text/event-stream``) through the app with a fake
model: one line per image with its index, then a last line with the rest of the non-streamed answer; errors
per image and per request; what is refused before the start stays an ordinary error answer."""

from __future__ import annotations

import json
from typing import Any

import gevent.socket
import pytest
from flask.testing import FlaskClient

from harness.answers import same_answer
from harness.fakes import BASE, FakeFetcher, FakeModel
from harness.images import data_url, solid
from service.app import create_app
from service.http.connection import SEND_GRACE_S
from service.settings import Settings

NDJSON = {"Accept": "application/x-ndjson"}
SSE = {"Accept": "text/event-stream"}
ALBUM = ["g10.png", "g100.png", "g200.png", data_url(solid(50))]


def make(model: FakeModel | None = None, **settings: Any) -> FlaskClient:
    s = Settings(image_base_url=BASE, max_images=8, **settings)
    fetcher = FakeFetcher({BASE + f"g{v}.png": solid(v) for v in (10, 100, 200)})
    return create_app(s, model=model or FakeModel(), fetcher=fetcher).test_client()


@pytest.fixture()
def client() -> FlaskClient:
    return make()


def ndjson(client: FlaskClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = client.post(path, json=body, headers=NDJSON)
    assert r.status_code == 200 and r.mimetype == "application/x-ndjson", r.data[:300]
    assert r.headers["X-Accel-Buffering"] == "no" and r.headers["Cache-Control"] == "no-cache"
    assert "Content-Length" not in r.headers
    return [json.loads(line) for line in r.data.splitlines()]





@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/classify"])
def test_ndjson_lines_carry_the_non_streamed_answer(client: FlaskClient, path: str) -> None:
    lines = ndjson(client, path, {"images": ALBUM})
    assert len(lines) == len(ALBUM) + 1
    same_answer(lines, client.post(path, json={"images": ALBUM}).json)


def test_an_unusable_image_is_its_own_line_when_partial(client: FlaskClient) -> None:
    body = {"images": ["g10.png", "missing.png", "data:image/png;base64,@@", "g100.png"], "partial": True}
    lines = ndjson(client, "/v1/embeddings", body)
    errors = {line["index"]: line["error"]["code"] for line in lines if "error" in line}
    assert errors == {1: "fetch_failed", 2: "invalid_data_url"}
    same_answer(lines, client.post("/v1/embeddings", json=body).json)


def test_a_failure_after_the_start_is_the_last_line(client: FlaskClient) -> None:
    lines = ndjson(client, "/v1/embeddings", {"images": ["g10.png", "missing.png"]})  # partial false
    last = lines[-1]
    assert last["event"] == "failed" and last["status"] == 422 and last["error"]["code"] == "fetch_failed"
    assert any(line.get("error", {}).get("code") == "fetch_failed" for line in lines[:-1])
    assert client.post("/v1/embeddings", json={"images": ["g10.png"]}, headers=NDJSON).status_code == 200


def test_sse_events_have_names_and_the_same_json(client: FlaskClient) -> None:
    r = client.post("/v1/embeddings", json={"images": ALBUM}, headers=SSE)
    assert r.status_code == 200 and r.mimetype == "text/event-stream"
    events = [block.split("\n") for block in r.data.decode().strip().split("\n\n")]
    kinds = [e[0].removeprefix("event: ") for e in events]
    assert kinds == ["item"] * len(ALBUM) + ["done"]
    docs = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert sorted(d["index"] for d in docs[:-1]) == [0, 1, 2, 3] and docs[-1]["event"] == "done"


def test_sse_sends_a_heartbeat_while_nothing_is_ready() -> None:
    client = make(FakeModel(delay_s=0.3), stream_heartbeat_s=0.1, max_batch=1)
    r = client.post("/v1/embeddings", json={"images": ["g10.png", "g100.png"]}, headers=SSE)
    text = r.data.decode()
    assert text.count(": waiting\n\n") >= 3 and text.count("event: item") == 2 and "event: done" in text


def test_refusals_before_the_start_stay_ordinary_error_answers(client: FlaskClient,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    too_many = client.post("/v1/embeddings", json={"images": ["g10.png"] * 9}, headers=NDJSON)
    assert too_many.status_code == 413 and too_many.json["error"]["code"] == "too_many_images"

    def never_loads(*args: object) -> None:
        raise RuntimeError("not in this test")

    monkeypatch.setattr("service.app.load_for_worker", never_loads)
    loading = create_app(Settings(model="resnet18", weights="random")).test_client()
    busy = loading.post("/v1/embeddings", json={"images": [data_url(solid(10))]}, headers=NDJSON)
    assert busy.status_code == 503 and busy.mimetype == "application/json" and "Retry-After" in busy.headers
    bad = client.post("/v1/embeddings", json={"images": ["g10.png", "missing.png"], "partial": False,
                                              "top_k": 0}, headers=NDJSON)
    assert bad.status_code == 400 and bad.mimetype == "application/json"


@pytest.mark.parametrize("accept", ["*/*", "application/json", "application/json, text/event-stream;q=0.5", ""])
def test_clients_that_do_not_ask_get_json(client: FlaskClient, accept: str) -> None:
    r = client.post("/v1/embeddings", json={"images": ["g10.png"]}, headers={"Accept": accept} if accept else {})
    assert r.status_code == 200 and r.mimetype == "application/json" and len(r.json["data"]) == 1


def test_an_openai_body_gets_openais_json_whatever_it_accepts(client: FlaskClient) -> None:
    r = client.post("/v1/embeddings", json={"model": "fake", "input": ["g10.png"]}, headers=NDJSON)
    assert r.status_code == 200 and r.mimetype == "application/json" and r.json["object"] == "list"


def test_a_bug_during_the_stream_ends_it_with_a_failed_line(client: FlaskClient,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from service.pipeline import answers

    def broken(*args: object) -> dict[str, Any]:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(answers, "images", broken)
    lines = ndjson(client, "/v1/embeddings", {"images": ["g10.png"]})
    assert lines[-1]["event"] == "failed" and lines[-1]["status"] == 500
    assert lines[-1]["error"]["code"] == "internal_error"
    monkeypatch.undo()
    assert client.post("/v1/embeddings", json={"images": ["g10.png"]}, headers=NDJSON).status_code == 200


def test_a_streamed_answers_access_line_waits_for_the_streams_end(monkeypatch: pytest.MonkeyPatch) -> None:
    from service import logs

    lines: list[dict[str, Any]] = []
    monkeypatch.setattr(logs, "access", lines.append)
    client = make(FakeModel(delay_s=0.2), log_format="json", max_batch=1)
    r = client.post("/v1/embeddings", json={"images": ["g10.png", "g100.png"]}, headers=NDJSON)
    assert r.status_code == 200 and len(r.data.splitlines()) == 3
    r.close()  # the WSGI iterable's close: where a server ends the response
    assert len(lines) == 1, lines
    line = lines[0]
    assert line["streamed"] is True and line["images"] == 2 and line["status"] == 200
    assert line["duration_ms"] >= 400 and set(line["timings_ms"]) >= {"decode", "inference", "total"}


class RecordingSocket:
    """The client's socket as gunicorn hands it to the app (one end of a pair nobody writes to), recording
    each timeout the answer sets on it."""

    def __init__(self) -> None:
        self.sock, self.peer = gevent.socket.socketpair()
        self.timeouts: list[float | None] = []

    def settimeout(self, timeout: float | None) -> None:
        self.timeouts.append(timeout)
        self.sock.settimeout(timeout)

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv(self, *args: Any) -> bytes:
        return self.sock.recv(*args)


def test_each_line_is_written_within_the_requests_deadline() -> None:
    client = make(FakeModel(delay_s=0.05), max_batch=1)
    sock = RecordingSocket()
    with sock.sock, sock.peer:
        r = client.post("/v1/embeddings", json={"images": ALBUM}, headers={**NDJSON, "X-Request-Timeout": "30"},
                        environ_overrides={"gunicorn.socket": sock})
        lines = r.data.splitlines()
        r.close()
    armed, last = sock.timeouts[:-1], sock.timeouts[-1]
    assert last is None  # released with the answer: the connection's next request reads as before
    assert len(lines) == len(ALBUM) + 1 and len(armed) >= len(lines) + 1  # every line, and the closing chunk
    assert all(t is not None and 0 < t <= 30 + SEND_GRACE_S for t in armed), armed
    assert armed == sorted(armed, reverse=True), "each write gets what is left of one bound, not a fresh one"
