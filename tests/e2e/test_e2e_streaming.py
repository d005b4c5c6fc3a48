"""Streamed answers on a real gunicorn -k gevent server with the real image host: lines arrive while the
request is still running; their content is the non-streamed answer's; a client that leaves mid-stream stops
the remaining work, and one that pipelines streams and never reads is cut off at the request's deadline; the
stream passes the shipped nginx line by line; rank streams on a real CLIP."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness.answers import metric, metric_sum, same_answer
from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import CLIP_ARCH, CLIP_LIMITS, e2e_env
from service.http.connection import SEND_GRACE_S

pytestmark = pytest.mark.e2e
NDJSON = {"Accept": "application/x-ndjson"}
TIMEOUT = 60


def trickle(n: int, step_s: float) -> list[str]:
    """``n`` photos whose image host answers ``step_s`` apart (distinct URLs: nothing is shared)."""
    return [f"img{i % 8:03d}.jpg?delay={step_s * i:.2f}&n={i}" for i in range(n)]


def timed_lines(url: str, body: dict, headers: dict[str, str] = NDJSON) -> tuple[list[dict], list[float], float]:
    """The streamed lines, each one's arrival (seconds after sending) and when the answer ended."""
    t0 = time.monotonic()
    with requests.post(url, json=body, headers=headers, stream=True, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/x-ndjson"), r.text
        lines, at = [], []
        for raw in r.iter_lines(chunk_size=1):  # chunk_size 1: each line as soon as its bytes are here
            if raw:
                lines.append(json.loads(raw))
                at.append(time.monotonic() - t0)
    return lines, at, time.monotonic() - t0


def images_total(server: GunicornServer) -> float:
    return metric_sum(requests.get(server.url + "/metrics", timeout=10).text, "greenserve_images_total")


def test_lines_arrive_while_the_request_runs(server: GunicornServer) -> None:
    lines, at, total = timed_lines(server.url + "/v1/embeddings", {"images": trickle(6, 0.3)})
    assert [line["event"] for line in lines] == ["item"] * 6 + ["done"]
    assert sorted(line["index"] for line in lines[:-1]) == list(range(6))
    # the photos come 0.3 s apart: the first line must not wait for the last photo (1.5 s later)
    assert at[0] < total - 1.0, (at, total)
    assert at[-2] - at[0] > 1.0, at


@pytest.mark.parametrize("route", ["embeddings", "classify"])
def test_the_lines_hold_the_non_streamed_answer(server: GunicornServer, route: str) -> None:
    body = {"images": ["img000.jpg", "img001.jpg", "page.jpg", "img002.jpg"], "partial": True}
    lines, _, _ = timed_lines(f"{server.url}/v1/{route}", body)
    plain = requests.post(f"{server.url}/v1/{route}", json=body, timeout=TIMEOUT).json()
    same_answer(lines, plain)
    assert [line["error"]["code"] for line in lines if "error" in line] == ["not_an_image"]


def leave_at_the_first_line(server: GunicornServer) -> float:
    """Send a 24-photo album for a stream, leave at its first line; the images inferred meanwhile and after."""
    body = json.dumps({"images": trickle(24, 0.06)}).encode()  # the last photo is due 1.4 s in (fetch timeout 2 s)
    before = images_total(server)
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nAccept: application/x-ndjson\r\nCache-Control: no-cache\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while b'"event":"item"' not in got:  # the first line, then leave
            got += s.recv(65536)
    left = time.monotonic()
    deadline = left + 8.0  # past every photo's due time: a server that carried on would have inferred them all
    while time.monotonic() < deadline:
        time.sleep(0.5)
    return images_total(server) - before


def test_a_client_that_leaves_mid_stream_stops_the_rest(server: GunicornServer) -> None:
    inferred = leave_at_the_first_line(server)
    assert inferred <= 6, f"{inferred:.0f} of 24 images went through the model after the client left at the first line"
    assert requests.post(server.url + "/v1/embeddings", json={"images": ["img000.jpg"]},
                         timeout=TIMEOUT).status_code == 200


def test_a_client_that_stays_gets_every_line(server: GunicornServer) -> None:
    """The control for the test above: the same album, read to its end, has all 24 through the model."""
    before = images_total(server)
    lines, _, _ = timed_lines(server.url + "/v1/embeddings", {"images": trickle(24, 0.06)},
                              {**NDJSON, "Cache-Control": "no-cache"})  # the model's own work: no cache hits
    assert len(lines) == 25 and lines[-1]["event"] == "done"
    assert images_total(server) - before >= 24


def test_with_cancelling_off_a_client_that_leaves_lets_the_work_finish(weights_file: Path,
                                                                       image_host: ImageHost) -> None:
    """The control: GREENSERVE_CANCEL_ON_DISCONNECT=false, the same departure, every image inferred."""
    env = e2e_env(weights_file, image_host, GREENSERVE_CANCEL_ON_DISCONNECT="false")
    with GunicornServer(env, workers=1) as srv:
        assert leave_at_the_first_line(srv) >= 24


SHORT_DEADLINE_S = 3.0
ESTABLISHED = 1  # linux/tcp_states.h
EMBEDDINGS = 'route="/v1/embeddings"'


def tcp_state(s: socket.socket) -> int:
    """The socket's TCP state, without reading from it: 1 while established (7 once reset, 8 once closed by
    the peer)."""
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def queued(local_port: int, remote_port: int) -> tuple[int, int]:
    """(tx, rx) queue of the loopback connection from ``local_port`` to ``remote_port`` (/proc/net/tcp): the
    bytes its sender holds unsent or unacknowledged, and those waiting in its receiver."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if (int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)) == (local_port, remote_port):
            tx, rx = fields[4].split(":")
            return int(tx, 16), int(rx, 16)
    return 0, 0


def rss_bytes(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_client_that_pipelines_streams_and_never_reads_is_cut_off_at_the_deadline(weights_file: Path,
                                                                                   image_host: ImageHost) -> None:
    """12 streamed 64-image requests on one connection, never read: the worker holds a bounded part of the
    first answer, closes the connection at that request's deadline (plus the send grace), never starts the
    requests behind it, and serves the next client. The album's photos are embedded first, so the embedding
    cache makes each answer whole (~0.4 MB of lines) well within the short deadline, as a longer deadline would."""
    env = e2e_env(weights_file, image_host, GREENSERVE_REQUEST_TIMEOUT_S=str(SHORT_DEADLINE_S),
                  GREENSERVE_MAX_IMAGES="64")
    album = [f"img{i % 8:03d}.jpg?n={i}" for i in range(64)]
    body = json.dumps({"images": album}).encode()
    one = (b"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nAccept: application/x-ndjson\r\n"
           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    with GunicornServer(env, workers=1) as srv:
        (pid,) = srv.worker_pids()
        photos = {"images": [f"img{i:03d}.jpg" for i in range(8)]}  # the album's 8 photos, into the cache
        assert requests.post(srv.url + "/v1/embeddings", json=photos, timeout=TIMEOUT).status_code == 200
        answer = requests.post(srv.url + "/v1/embeddings", json={"images": album}, headers=NDJSON, timeout=TIMEOUT)
        assert answer.status_code == 200 and answer.text.count("\n") == 65, answer.text[-300:]
        started, rss_before = metric(srv, "greenserve_requests_total", EMBEDDINGS), rss_bytes(pid)
        server_tx = client_rx = rss_most = 0
        with socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT) as s:
            s.sendall(one * 12)
            sent, port = time.monotonic(), s.getsockname()[1]
            while tcp_state(s) == ESTABLISHED and time.monotonic() - sent < SHORT_DEADLINE_S + 30:
                server_tx = max(server_tx, queued(srv.port, port)[0])
                client_rx = max(client_rx, queued(port, srv.port)[1])
                rss_most = max(rss_most, rss_bytes(pid))
                time.sleep(0.05)
            closed_after = time.monotonic() - sent
        started = metric(srv, "greenserve_requests_total", EMBEDDINGS) - started
        ok = requests.post(srv.url + "/v1/embeddings", json={"images": ["img000.jpg"]}, timeout=TIMEOUT)
        assert ok.status_code == 200 and int(ok.headers["X-Worker-PID"]) == pid
    print(f"\nnever read: closed after {closed_after:.2f}s (deadline {SHORT_DEADLINE_S}s); {started:.0f} of 12 "
          f"requests started; each answer {len(answer.content)} bytes; the server held {server_tx} bytes unsent, the "
          f"client's buffer {client_rx}; worker RSS {rss_most - rss_before:+d} bytes")
    assert closed_after < SHORT_DEADLINE_S + SEND_GRACE_S + 2, closed_after
    assert server_tx < 512 << 10, f"the kernel held {server_tx} bytes of answers nobody read"
    assert started <= 2, f"{started:.0f} requests started behind an answer nobody read"


@pytest.fixture(scope="module")
def nginx_in_front(server: GunicornServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from harness.nginx import Nginx, nginx_binary

    if nginx_binary() is None:
        pytest.skip("no nginx binary on PATH or in /usr/sbin: `make test` installs nginx-light as root with apt-get")
    nginx = Nginx(tmp_path_factory.mktemp("nginx-stream"), [server.port]).start()
    try:
        yield nginx.url
    finally:
        nginx.stop()


def test_the_stream_passes_the_shipped_nginx_line_by_line(nginx_in_front: str) -> None:
    lines, at, total = timed_lines(nginx_in_front + "/v1/embeddings", {"images": trickle(6, 0.3)})
    assert [line["event"] for line in lines] == ["item"] * 6 + ["done"]
    assert at[0] < total - 1.0, f"nginx held the lines back: {at}, total {total:.2f}"
    r = requests.post(nginx_in_front + "/v1/embeddings", json={"images": ["img000.jpg"]},
                      headers={"Accept": "text/event-stream"}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.text.startswith("event: item\n") and "event: done\n" in r.text


def test_rank_streams_scores_and_ends_with_the_ranking(clip_checkpoint: Path, image_host: ImageHost) -> None:
    env = e2e_env(clip_checkpoint, image_host, GREENSERVE_MODEL=f"open_clip:{CLIP_ARCH}", **CLIP_LIMITS)
    body = {"images": ["img000.jpg", "img001.jpg", "img002.jpg"], "query": "a photo of a cat", "top_k": 2}
    with GunicornServer(env, workers=1) as srv:
        lines, _, _ = timed_lines(srv.url + "/v1/rank", body)
        plain = requests.post(srv.url + "/v1/rank", json=body, timeout=TIMEOUT).json()
    items, last = lines[:-1], lines[-1]
    assert len(items) == 3 and all("score" in item for item in items)
    assert last["event"] == "done" and last["data"] == plain["data"] and len(plain["data"]) == 2
    scores = {item["index"]: item["score"] for item in items}
    assert [d["index"] for d in last["data"]] == sorted(scores, key=lambda i: -scores[i])[:2]
