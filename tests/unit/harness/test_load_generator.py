"""harness.load, the tests' and benchmarks' one load generator, against a small local HTTP server: every
request recorded with its status, error code, worker pid and Retry-After; keep-alive or a fresh
connection each; no answer is status 0; the loop stops at its duration by itself."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.imagehost import STOP_POLL_S
from harness.load import Load, load_summary


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    calls: list[tuple[int, dict[str, object]]] = []  # (client port, body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.calls.append((self.client_address[1], body))
        status = 200 if len(_Handler.calls) % 3 else 429
        data = b"{}" if status == 200 else json.dumps({"error": {"code": "over_share"}}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Worker-PID", "4242")
        if status == 429:
            self.send_header("Retry-After", "2")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Handler.calls = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, args=(STOP_POLL_S,), daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_every_request_is_recorded_with_status_code_pid_and_retry_after(server: str) -> None:
    t0 = time.monotonic()
    load = Load(server, 2, {"images": ["a.jpg", "b.jpg"]}, duration_s=0.5).start().join()
    assert time.monotonic() - t0 < 5, "the loop did not stop at its duration"
    assert len(load.done) == len(_Handler.calls) > 3
    assert all(body == {"images": ["a.jpg", "b.jpg"]} for _, body in _Handler.calls)
    refused = [d for d in load.done if d.status == 429]
    assert refused and all(d.code == "over_share" and d.retry_after == "2" for d in refused)
    assert all(d.pid == 4242 and d.images == 2 and d.ended >= d.started for d in load.done)
    s = load_summary(load.done)
    assert s["failed"] == len(refused) and s["failures"] == ["429 over_share"] and s["by_pid"] == {4242: s["ok"]}
    assert len({port for port, _ in _Handler.calls}) == 2, "two keep-alive clients use two connections"


def test_fresh_opens_a_connection_per_request_and_since_filters_by_start(server: str) -> None:
    with Load(server, 1, {"images": ["a.jpg"]}, duration_s=0.3, fresh=True) as load:
        time.sleep(0.1)
        half = time.monotonic()
    assert len({port for port, _ in _Handler.calls}) == len(_Handler.calls) > 1
    assert all(d.started >= half for d in load.since(half)) and len(load.since(half)) < len(load.done)


def test_no_answer_is_status_0_with_the_exception_named() -> None:
    load = Load("http://127.0.0.1:9", 1, {"images": []}, duration_s=0.2, timeout_s=1).start().join()
    assert load.done and all(d.status == 0 and d.error for d in load.done)
    assert load_summary(load.done)["ok"] == 0


def test_with_retry_after_a_refused_client_waits_as_told(server: str) -> None:
    load = Load(server, 1, {"images": ["a.jpg"]}, duration_s=0.5, retry_after=True).start().join()
    # every third answer is a 429 with Retry-After: 2, so the client stops after the first one
    assert [d.status for d in load.done] == [200, 200, 429], [d.status for d in load.done]


class _Closer(_Handler):
    """Answers, then drops the connection without saying so (an idle keep-alive timing out server-side)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
        self.close_connection = True


def test_a_keep_alive_connection_the_server_dropped_is_tried_once_more() -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Closer)
    threading.Thread(target=srv.serve_forever, args=(STOP_POLL_S,), daemon=True).start()
    try:
        load = Load(f"http://127.0.0.1:{srv.server_address[1]}", 1, {"images": []}, duration_s=0.3).start().join()
    finally:
        srv.shutdown()
        srv.server_close()
    assert len(load.done) > 2 and all(d.status == 200 for d in load.done), {d.error for d in load.done}
