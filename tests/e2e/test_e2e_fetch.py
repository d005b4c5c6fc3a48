"""Fetching through a real ``gunicorn -k gevent`` greenserve: SSRF refusals, hostile hosts, concurrency.

The server allows only its image host (the GREENSERVE_IMAGE_BASE_URL origin). A canary listener on
another loopback port counts connections: it must see none, however the blocked URL is spelled.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from harness.imagehost import Canary, ImageHost
from harness.launch import GunicornServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    with Canary() as c:
        yield c


def post(server: GunicornServer, images: list[str], *, partial: bool = True, rid: str = "",
         timeout: float = 60) -> requests.Response:
    headers = {"X-Request-ID": rid} if rid else {}
    return requests.post(server.url + "/v1/embeddings", json={"images": images, "partial": partial},
                         headers=headers, timeout=timeout)


def codes(body: dict[str, Any]) -> dict[int, str]:
    return {e["index"]: e["code"] for e in body["errors"]}


def blocked_urls(image_host: ImageHost, port: int) -> dict[str, str]:
    """Every spelling of a forbidden destination we know, with the code it must get."""
    loop = [f"http://{h}:{port}/x.jpg" for h in (
        "127.0.0.1", "localhost", "LocalHost.", "2130706433", "0x7f.1", "0x7f000001", "127.1", "0177.0.0.1",
        "127.0.0.2", "0.0.0.0", "0", "[::1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[0:0:0:0:0:ffff:7f00:1]",
        "[::127.0.0.1]", "[::]", "[64:ff9b::7f00:1]", "[2002:7f00:1::]")]
    private = [f"http://{h}/x.jpg" for h in (
        "10.0.0.1", "172.16.0.1", "192.168.1.1", "100.64.0.1", "169.254.169.254", "[fe80::1]", "[fd00::1]",
        "[::ffff:169.254.169.254]", "224.0.0.1")]
    redirects = [image_host.url("img000.jpg", redirect=target) for target in (
        f"http://127.0.0.1:{port}/x.jpg", f"http://localhost:{port}/x.jpg", f"http://[::1]:{port}/x.jpg",
        "http://169.254.169.254/latest/meta-data/", "file:///etc/passwd", f"gopher://127.0.0.1:{port}/_x")]
    urls = {u: "url_not_allowed" for u in [*loop, *private, *redirects, f"https://127.0.0.1:{port}/x.jpg"]}
    for other in (f"ftp://127.0.0.1:{port}/x.jpg", "file:///etc/passwd", f"gopher://127.0.0.1:{port}/_x",
                  f"dict://127.0.0.1:{port}/"):
        urls[other] = "invalid_url"
    return urls


def test_blocked_urls_are_refused_and_the_canary_sees_nothing(server: GunicornServer, image_host: ImageHost,
                                                              canary: Canary) -> None:
    pids = server.worker_pids()
    expected = blocked_urls(image_host, canary.port)
    assert len(expected) < 40  # GREENSERVE_MAX_IMAGES in the e2e env
    resp = post(server, ["img000.jpg", *expected])
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [d["index"] for d in body["data"]] == [0]  # the allowed image host still works
    got = codes(body)
    wrong = {url: got.get(i) for i, (url, code) in enumerate(expected.items(), start=1) if got.get(i) != code}
    assert not wrong, wrong
    assert canary.connections == 0, canary.peers
    assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
    assert server.worker_pids() == pids


def test_a_blocked_url_fails_the_request_without_partial(server: GunicornServer, image_host: ImageHost,
                                                          canary: Canary) -> None:
    resp = post(server, ["img001.jpg", f"http://0x7f.1:{canary.port}/x.jpg"], partial=False)
    assert resp.status_code == 422
    error = resp.json()["error"]
    assert error["code"] == "url_not_allowed"
    assert [(d["index"], d["code"]) for d in error["details"]] == [(1, "url_not_allowed")]
    assert canary.connections == 0


def test_hostile_hosts_fail_their_images_not_the_worker(server: GunicornServer, image_host: ImageHost) -> None:
    pids = server.worker_pids()
    cases = {
        image_host.url("img002.jpg", ctype="text/plain"): None,  # Content-Type is not trusted either way
        image_host.url("img003.jpg", redirect="/img003.jpg", hops=2): None,
        image_host.url("img004.jpg", fail=1): None,  # one 503, then served: retried
        image_host.url("img005.jpg", drip=0.01): "fetch_timeout",  # GREENSERVE_FETCH_TIMEOUT_S=2
        image_host.url("img006.jpg", endless=1): "image_too_large",
        image_host.url("img007.jpg", status=404): "fetch_failed",
        image_host.url("img000.jpg", status=503, e2e=1): "fetch_failed",
        image_host.url("img001.jpg", reset=1): "fetch_failed",
        image_host.url("page.jpg", ctype="image/jpeg"): "not_an_image",
        image_host.url("img000.jpg", redirect="/img000.jpg", hops=9): "fetch_failed",
    }
    started = time.monotonic()
    resp = post(server, list(cases), rid="e2e-hostile-1")
    elapsed = time.monotonic() - started
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert {d["index"] for d in body["data"]} == {i for i, c in enumerate(cases.values()) if c is None}
    assert codes(body) == {i: c for i, c in enumerate(cases.values()) if c is not None}
    assert elapsed < 10, f"{elapsed:.1f}s: a hostile host held the request past its fetch deadline"
    assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
    assert server.worker_pids() == pids
    log = server.log()
    assert "request_id=e2e-hostile-1" in log and "fetch_timeout" in log


def test_thirty_urls_at_200ms_fetch_in_about_one_latency(server: GunicornServer, image_host: ImageHost) -> None:
    urls = [image_host.url(f"img{i % 8:03d}.jpg", delay=0.2, n=i) for i in range(30)]
    resp = post(server, urls, partial=False)
    assert resp.status_code == 200, resp.text
    fetch_ms = resp.json()["timings_ms"]["fetch"]
    assert 200 <= fetch_ms < 2000, f"fetch stage {fetch_ms} ms; one after another would be 6000 ms"
