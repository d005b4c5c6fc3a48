"""A body that breaks its limits by framing or by time, sent over raw sockets to a real gunicorn -k gevent
(1 worker of resnet18, a 1 MiB body cap, a 2 s body deadline): a chunked body over the cap is 413 (at once
when a chunk's size line says so), a stalled or trickled one is 408, the connection closes after either, and
the same worker answers at once meanwhile and afterwards."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness.faults import probe
from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import e2e_env

pytestmark = pytest.mark.e2e
CAP = 1024 * 1024
BODY_TIMEOUT_S = 2.0
HEAD = (b"POST /v1/embeddings HTTP/1.1\r\nHost: greenserve\r\nContent-Type: application/json\r\n")


@pytest.fixture(scope="module")
def limited(weights_file: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    env = e2e_env(weights_file, image_host, GREENSERVE_MAX_BODY_BYTES=str(CAP),
                  GREENSERVE_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S))
    with GunicornServer(env, workers=1) as srv:
        yield srv


def answer_of(s: socket.socket) -> tuple[bytes, dict[str, object], float]:
    """Read until the server closes: (status line and headers, JSON error body, seconds it took to close)."""
    t0 = time.monotonic()
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        payload = payload.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return head, json.loads(payload), time.monotonic() - t0


def chunked(total: int, piece: int = 64 * 1024) -> Iterator[bytes]:
    yield b'{"images": ["' + b"a" * (piece - 16) + b'"]'
    sent = piece
    while sent < total:
        yield b" " * piece
        sent += piece
    yield b"}"


def test_a_chunked_body_over_the_cap_is_413_and_the_connection_closes(limited: GunicornServer) -> None:
    pids = limited.worker_pids()
    with socket.create_connection(("127.0.0.1", limited.port), timeout=30) as s:
        s.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        try:  # the server may answer (and close) before the client has sent it all
            for piece in chunked(2 * CAP):
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        head, body, _ = answer_of(s)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert body["error"]["code"] == "body_too_large" and "GREENSERVE_MAX_BODY_BYTES" in body["error"]["message"]
    assert b"connection: close" in head.lower()
    assert limited.worker_pids() == pids


def test_a_chunked_body_under_the_cap_is_read_whole(limited: GunicornServer) -> None:
    with socket.create_connection(("127.0.0.1", limited.port), timeout=30) as s:
        s.sendall(HEAD + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for piece in chunked(CAP - 128 * 1024):  # JSON with a long (unfetchable) name: read whole, then 4xx
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        s.sendall(b"0\r\n\r\n")
        head, body, _ = answer_of(s)
    assert not head.startswith(b"HTTP/1.1 413"), head  # the cap holds for bodies over it only
    assert body["error"]["code"] != "invalid_json", body


OVER_THE_CAP = {
    "a chunk size of 16 hex digits (2**64-1), then 3 bytes": b"ffffffffffffffff\r\nabc",
    "a size line whose digits pass the cap before it ends": b"1000000000",  # 2**36 so far, no CRLF yet
}


@pytest.mark.parametrize("what", list(OVER_THE_CAP))
def test_a_chunk_size_past_the_cap_is_413_at_once(limited: GunicornServer, what: str) -> None:
    pids = limited.worker_pids()
    with socket.create_connection(("127.0.0.1", limited.port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + OVER_THE_CAP[what])
        head, body, _ = answer_of(s)
        took = time.monotonic() - t0
    status = head.split(b"\r\n")[0].decode()
    print(f"\n{what}: {status} after {took * 1000:.0f} ms")
    assert head.startswith(b"HTTP/1.1 413"), (what, head)
    assert body["error"]["code"] == "body_too_large" and b"connection: close" in head.lower()
    assert took < BODY_TIMEOUT_S / 4, f"{took:.2f}s: the body's deadline is {BODY_TIMEOUT_S}s"
    ok = requests.post(limited.url + "/v1/embeddings", json={"images": ["img000.jpg"]}, timeout=60)
    assert ok.status_code == 200 and int(ok.headers["X-Worker-PID"]) in pids


STALLS = {
    "a chunk of 1 KiB announced, 3 bytes sent": b"Transfer-Encoding: chunked\r\n\r\n400\r\nabc",
    "a Content-Length 1,000 bytes longer than sent": b"Content-Length: 1010\r\n\r\n{\"images\":",
}


@pytest.mark.parametrize("what", list(STALLS))
def test_a_stalled_body_is_408_and_the_hub_answers_meanwhile(limited: GunicornServer, what: str) -> None:
    pids = limited.worker_pids()
    with socket.create_connection(("127.0.0.1", limited.port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(HEAD + STALLS[what])
        latencies, failed = probe(limited.url + "/healthz", 5, timeout_s=1)  # while the body is awaited
        head, body, _ = answer_of(s)
        closed_after = time.monotonic() - t0
    assert head.startswith(b"HTTP/1.1 408"), (what, head)
    assert body["error"]["code"] == "body_timeout" and "GREENSERVE_BODY_TIMEOUT_S" in body["error"]["message"]
    assert BODY_TIMEOUT_S - 0.1 < closed_after < BODY_TIMEOUT_S + 3, closed_after  # answered, then closed
    assert failed == 0 and max(latencies) < 0.5, latencies
    assert limited.worker_pids() == pids


def test_a_trickled_body_meets_the_same_deadline(limited: GunicornServer) -> None:
    """One byte every 0.3 s never idles long, and still has the whole body's deadline."""
    stop = threading.Event()
    with socket.create_connection(("127.0.0.1", limited.port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(HEAD + b"Content-Length: 100\r\n\r\n")

        def trickle() -> None:
            for _ in range(90):
                if stop.wait(0.3):
                    return
                try:
                    s.sendall(b" ")
                except OSError:
                    return

        feeder = threading.Thread(target=trickle)
        feeder.start()
        try:
            head, body, _ = answer_of(s)
        finally:
            stop.set()
            feeder.join()
        took = time.monotonic() - t0
    assert head.startswith(b"HTTP/1.1 408") and body["error"]["code"] == "body_timeout", head
    assert took < BODY_TIMEOUT_S + 3, took
    ok = requests.post(limited.url + "/v1/embeddings", json={"images": ["img000.jpg"]}, timeout=60)
    assert ok.status_code == 200 and int(ok.headers["X-Worker-PID"]) in limited.worker_pids()
