"""The engine under real gunicorn -k gevent: backpressure, deadlines, balance across workers, metrics."""

from __future__ import annotations

import base64
import collections
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness import images
from harness.answers import metric_sum
from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import MODEL_WORK, e2e_env

pytestmark = pytest.mark.e2e
IMAGE = "data:image/jpeg;base64," + base64.b64encode(images.jpeg(256, 256, seed=11)).decode()
BIG_IMAGE = "data:image/jpeg;base64," + base64.b64encode(images.jpeg(640, 480, seed=12)).decode()  # x40 < the 8 MB body cap




def embed(server: GunicornServer, n: int, image: str = IMAGE, **kw: object) -> requests.Response:
    return requests.post(server.url + "/v1/embeddings", json={"images": [image] * n}, timeout=120, **kw)  # type: ignore[arg-type]


def in_background(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["response"] = fn(*args, **kwargs)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.fixture(scope="module")
def small_queue(weights_file: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    env = e2e_env(weights_file, image_host, GREENSERVE_MAX_QUEUE_IMAGES="40", GREENSERVE_MAX_BATCH="8")
    with GunicornServer(env, workers=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def two_workers(weights_file: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    with GunicornServer(e2e_env(weights_file, image_host, GREENSERVE_MAX_BATCH="8"), workers=2) as srv:
        yield srv


def test_past_the_queue_bound_503_with_retry_after_fast_and_admitted_work_completes(small_queue: GunicornServer) -> None:
    thread, out = in_background(embed, small_queue, 40)
    wait_admitted(small_queue, 40)
    t0 = time.perf_counter()
    refused = embed(small_queue, 8)
    elapsed = time.perf_counter() - t0
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "overloaded"
    assert int(refused.headers["Retry-After"]) >= 1
    assert elapsed < 1.0, f"refusal took {elapsed:.2f}s: it must come before any work"
    thread.join(120)
    assert out["response"].status_code == 200 and len(out["response"].json()["data"]) == 40


def test_deadline_gives_504_and_the_worker_carries_on(small_queue: GunicornServer) -> None:
    pids = small_queue.worker_pids()
    r = embed(small_queue, 40, headers={"X-Request-Timeout": "0.3", **MODEL_WORK})
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert embed(small_queue, 1).status_code == 200
    assert small_queue.worker_pids() == pids


def wait_admitted(server: GunicornServer, n: int) -> None:
    """Until ``n`` images are admitted somewhere (the machine may be slow: don't guess with a sleep)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metric_sum(requests.get(server.url + "/metrics", timeout=10).text, "greenserve_queue_images") >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} images never admitted")


def test_busy_worker_lets_its_idle_sibling_take_new_connections(two_workers: GunicornServer) -> None:
    thread, out = in_background(embed, two_workers, 40, image=BIG_IMAGE)
    wait_admitted(two_workers, 40)
    probes = []  # (pid, the long request still running when the probe came back)
    while thread.is_alive() and len(probes) < 5:
        pid = requests.get(two_workers.url + "/healthz", timeout=5).json()["pid"]
        probes.append((pid, thread.is_alive()))
    thread.join(120)
    busy_pid = int(out["response"].headers["X-Worker-PID"])
    during = [pid for pid, running in probes if running]
    assert during, f"the long request ended before any probe: {probes}"
    assert busy_pid not in during, f"new connections went to the busy worker {busy_pid}: {probes}"


def test_a_burst_of_connections_spreads_over_the_workers(two_workers: GunicornServer) -> None:
    # a connection counts as load from its accept, before its request arrives: otherwise the first worker
    # to wake takes the burst (16 k6 users went 16/0; with the default queue bound, 5-6 of them got 503)
    conns = [socket.create_connection(("127.0.0.1", two_workers.port), timeout=10) for _ in range(8)]
    try:
        time.sleep(0.3)  # every connection accepted, none has sent a byte
        for conn in conns:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: greenserve\r\nConnection: close\r\n\r\n")
        pids = []
        for conn in conns:
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
            pids.append(json.loads(answer.partition(b"\r\n\r\n")[2])["pid"])
    finally:
        for conn in conns:
            conn.close()
    per_worker = collections.Counter(pids)
    assert len(per_worker) == 2 and max(per_worker.values()) <= 5, f"8 connections went {dict(per_worker)}"


def test_metrics_count_what_happened_across_workers(two_workers: GunicornServer) -> None:
    def scrape() -> str:
        r = requests.get(two_workers.url + "/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
        return r.text

    before = scrape()
    pids = set()
    for _ in range(6):
        pids.add(embed(two_workers, 2, headers=MODEL_WORK).headers["X-Worker-PID"])
    bad = requests.post(two_workers.url + "/v1/embeddings", json={"images": ["page.jpg"]}, timeout=30)
    assert bad.status_code == 422
    after = scrape()
    ok_route = 'route="/v1/embeddings",status="200"'
    assert (metric_sum(after, "greenserve_requests_total", ok_route)
            - metric_sum(before, "greenserve_requests_total", ok_route)) == 6
    assert metric_sum(after, "greenserve_images_total") - metric_sum(before, "greenserve_images_total") == 12
    assert metric_sum(after, "greenserve_image_errors_total", 'code="not_an_image"') >= 1
    assert metric_sum(after, "greenserve_errors_total", 'code="not_an_image"') >= 1
    assert metric_sum(after, "greenserve_stage_seconds_count", 'stage="inference"') >= 6
    assert metric_sum(after, "greenserve_batch_size_count") >= 1
    assert len(re.findall(r"^greenserve_model_load_seconds\{", after, re.M)) == 2  # one per live worker
    assert metric_sum(after, "greenserve_queue_images") == 0


def _thread_nices(pid: int) -> dict[int, int]:
    """Each native thread of ``pid`` → its nice value (field 19 of /proc/PID/task/TID/stat)."""
    nices = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        nices[int(task.name)] = int(stat[stat.rindex(")") + 2:].split()[16])
    return nices


def test_inference_then_decode_threads_run_below_the_hub(two_workers: GunicornServer) -> None:
    # photos no worker has seen: with IMAGE, a worker that had decoded nothing yet could answer from the embedding
    # cache its sibling filled, and start no decode thread
    seeds = time.time_ns() % 1_000_000
    fresh = ["data:image/jpeg;base64," + base64.b64encode(images.jpeg(256, 256, seed=seeds + i)).decode()
             for i in range(4)]
    answer = requests.post(two_workers.url + "/v1/embeddings", json={"images": fresh}, timeout=120)
    assert answer.status_code == 200, answer.text
    pid = int(answer.headers["X-Worker-PID"])
    nices = _thread_nices(pid)
    assert nices[pid] == 0, "the hub (the worker's main thread) must keep its priority"
    assert 10 in nices.values(), f"decode threads should run at nice 10: {nices}"
    assert 5 in nices.values(), f"the inference thread should run at nice 5: {nices}"
