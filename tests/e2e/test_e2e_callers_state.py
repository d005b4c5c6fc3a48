"""What a worker keeps of its callers stays bounded, on a real gunicorn -k gevent worker: 100,000 one-image
callers (each its own X-Client-ID) leave the worker's memory and its tracked callers where 2,000 left them."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import pytest

from harness.answers import metric
from harness.imagehost import ImageHost
from harness.images import data_url, solid
from harness.launch import GunicornServer
from harness.servers import e2e_env

pytestmark = pytest.mark.e2e
CALLERS = 100_000
WARM = 2_000  # callers before the first reading: the allocator's and the cache's own growth settle first
CLIENTS = 4


def rss_bytes(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def callers(port: int, first: int, n: int) -> list[int]:
    """``n`` requests, each from a caller of its own, on CLIENTS keep-alive connections; their statuses."""
    body = json.dumps({"images": [data_url(solid(90))]}).encode()  # the same photo: a cache hit after the first
    statuses: list[int] = []

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for i in range(first + k, first + n, CLIENTS):
            conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json",
                                                          "X-Client-ID": f"caller-{i}"})
            response = conn.getresponse()
            response.read()
            statuses.append(response.status)
        conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def test_a_hundred_thousand_callers_leave_the_workers_state_bounded(weights_file: Path, image_host: ImageHost) -> None:
    env = e2e_env(weights_file, image_host, GREENSERVE_CALLER_FROM="header,address",
                  GREENSERVE_CACHE="memory")  # the photo's row from the worker's memory: no forward, no disk
    with GunicornServer(env, workers=1) as srv:
        (pid,) = srv.worker_pids()
        assert set(callers(srv.port, 0, WARM)) == {200}
        before = rss_bytes(pid)
        statuses = callers(srv.port, WARM, CALLERS)
        grown = rss_bytes(pid) - before
        tracked = metric(srv, "greenserve_callers_tracked")
        assert srv.worker_pids() == {pid}
    assert len(statuses) == CALLERS and set(statuses) == {200}
    print(f"{CALLERS} callers: worker RSS {grown:+d} bytes ({grown / CALLERS:+.1f} a caller), {tracked:.0f} tracked")
    assert tracked <= 64
    assert grown < 4 * 1024 * 1024, f"{grown} bytes for {CALLERS} callers: {grown / CALLERS:.0f} bytes a caller"
