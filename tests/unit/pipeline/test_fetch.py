"""The fetcher against a real local image host with fault knobs (no server: HttpFetcher called directly).

The fetcher's sockets are gevent's even in this unpatched process, so concurrency and the total
deadline behave here as they do in a gunicorn worker.
"""

from __future__ import annotations

import gzip
import logging
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import gevent
import pytest

from harness import images
from harness.fakes import FakeDNS
from harness.imagehost import Canary, ImageHost
from service.engine.scheduling.urgency import Urgency
from service.errors import ImageError
from service.pipeline import fetch_body
from service.pipeline.fetch import Fetched, HttpFetcher, chain_id
from service.pipeline.ssrf import AddressPolicy
from service.settings import Settings

JPEG = images.jpeg(320, 240)
OTHER = images.jpeg(200, 100, seed=8)
BLOBS = {"a.jpg": JPEG, "b.jpg": OTHER, "page.html": images.HTML * 40, "empty.jpg": b"",
         "zeros.jpg": b"\xff\xd8\xff\xe0" + bytes(4 * 1024 * 1024)}


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    with ImageHost(BLOBS) as h:
        yield h


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    with Canary() as c:
        yield c


@pytest.fixture()
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backoff from 10 ms: the tests that use this count the attempts, not the waits between them."""
    monkeypatch.setattr("service.pipeline.fetch.BACKOFF_BASE_S", 0.01)


def make(host: ImageHost, **overrides: object) -> HttpFetcher:
    values: dict[str, object] = {"image_base_url": host.base_url, "fetch_timeout_s": 3.0, "fetch_retries": 2}
    values.update(overrides)
    return HttpFetcher(Settings(**values))  # type: ignore[arg-type]


def hits(host: ImageHost, url: str) -> int:
    return host.hits_full[url[len(host.base_url) - 1:]]


def error(result: bytes | ImageError) -> ImageError:
    assert isinstance(result, ImageError), f"expected an error, got {len(result)} bytes"  # type: ignore[arg-type]
    return result


def test_fetches_the_image_bytes(host: ImageHost) -> None:
    assert make(host).fetch(host.url("a.jpg", t="plain")) == JPEG


def test_content_type_is_not_trusted(host: ImageHost) -> None:
    fetcher = make(host)
    assert fetcher.fetch(host.url("a.jpg", ctype="text/html")) == JPEG
    assert error(fetcher.fetch(host.url("page.html", ctype="image/jpeg"))).code == "not_an_image"


def test_empty_body_is_left_for_decode_to_name(host: ImageHost) -> None:
    assert make(host).fetch(host.url("empty.jpg")) == b""


@pytest.mark.parametrize("status", [400, 403, 404, 410, 500])
def test_other_statuses_fail_at_once_with_the_upstream_status(host: ImageHost, status: int) -> None:
    url = host.url("a.jpg", status=status, t="once")
    err = error(make(host).fetch(url))
    assert err.code == "fetch_failed" and f"HTTP {status}" in err.message
    assert err.details == [{"upstream_status": status}]
    assert hits(host, url) == 1


@pytest.mark.parametrize("status", [429, 502, 503, 504])
@pytest.mark.usefixtures("quick_backoff")
def test_retryable_statuses_are_retried_a_bounded_number_of_times(host: ImageHost, status: int) -> None:
    url = host.url("a.jpg", status=status, t="bounded")
    err = error(make(host, fetch_retries=2).fetch(url))
    assert err.code == "fetch_failed" and f"HTTP {status}" in err.message
    assert hits(host, url) == 3


def test_a_transient_503_recovers(host: ImageHost) -> None:
    url = host.url("a.jpg", fail=2, t="recovers")
    assert make(host, fetch_retries=2).fetch(url) == JPEG
    assert hits(host, url) == 3


def test_retry_after_is_respected(host: ImageHost) -> None:
    url = host.url("a.jpg", fail=1, retry_after=1, t="ra")
    started = time.monotonic()
    assert make(host).fetch(url) == JPEG
    assert time.monotonic() - started >= 0.95


def test_retry_after_past_the_deadline_fails_now(host: ImageHost) -> None:
    url = host.url("a.jpg", status=503, retry_after=60, t="ra-late")
    started = time.monotonic()
    err = error(make(host, fetch_timeout_s=5).fetch(url))
    assert err.code == "fetch_failed" and "deadline" in err.message
    assert time.monotonic() - started < 2 and hits(host, url) == 1


def test_redirects_are_followed(host: ImageHost) -> None:
    assert make(host).fetch(host.url("a.jpg", redirect="/a.jpg", hops=2)) == JPEG


def test_too_many_redirects_fail(host: ImageHost) -> None:
    err = error(make(host, fetch_max_redirects=3).fetch(host.url("a.jpg", redirect="/a.jpg", hops=5)))
    assert err.code == "fetch_failed" and "redirects" in err.message


def test_validators_go_only_to_the_url_that_sent_them_reached_the_same_way(host: ImageHost) -> None:
    """A host may serve another URL with the same ETag: a redirect that now ends there is fetched whole, and
    no 304 can vouch for the old target's bytes."""
    host.redirect("cover.jpg", "/a.jpg?etag=shared")
    fetcher, url = make(host), host.url("cover.jpg")
    first = fetcher.fetch_one(url)
    assert isinstance(first, Fetched) and first.data == JPEG and first.validators.etag == '"shared"'
    assert first.validators.chain == chain_id([host.url("a.jpg", etag="shared")])
    again = fetcher.fetch_one(url, validators=first.validators)
    assert isinstance(again, Fetched) and again.data is None  # the same redirect to the same URL: 304
    assert again.validators == first.validators
    host.redirect("cover.jpg", "/b.jpg?etag=shared")
    seen = len(host.headers_seen)
    moved = fetcher.fetch_one(url, validators=first.validators)
    assert isinstance(moved, Fetched) and moved.data == OTHER
    assert not any("If-None-Match" in h for h in host.headers_seen[seen:])  # neither the redirect nor b.jpg asked


def test_a_url_that_now_redirects_is_asked_itself_and_its_target_fetched_whole(host: ImageHost) -> None:
    host.replace("moved.jpg", JPEG)
    fetcher, url = make(host), host.url("moved.jpg", etag="shared")
    first = fetcher.fetch_one(url)
    assert isinstance(first, Fetched) and first.validators.chain == ""  # no redirect
    host.redirect("moved.jpg", "/b.jpg?etag=shared")
    seen = len(host.headers_seen)
    moved = fetcher.fetch_one(url, validators=first.validators)
    assert isinstance(moved, Fetched) and moved.data == OTHER
    asked = ["If-None-Match" in h for h in host.headers_seen[seen:]]
    assert asked == [True, False]  # the URL itself (it sent them), then not its new target


def test_each_redirects_cache_control_comes_with_the_image(host: ImageHost) -> None:
    host.redirect("latest.jpg", "/a.jpg", cache_control="max-age=60")
    fetched = make(host).fetch_one(host.url("latest.jpg"))
    assert isinstance(fetched, Fetched) and fetched.redirect_cache_control == ("max-age=60",)


@pytest.mark.parametrize("target", ["http://127.0.0.1:{port}/x", "http://localhost:{port}/x",
                                    "http://[::ffff:127.0.0.1]:{port}/x", "http://169.254.169.254/latest/meta-data/",
                                    "file:///etc/passwd", "gopher://127.0.0.1:{port}/_x"])
def test_redirect_to_a_blocked_target_never_connects(host: ImageHost, canary: Canary, target: str) -> None:
    before = canary.connections
    err = error(make(host).fetch(host.url("a.jpg", redirect=target.format(port=canary.port))))
    assert err.code == "url_not_allowed"
    assert canary.connections == before == 0


def test_drip_feed_is_stopped_by_the_total_deadline(host: ImageHost) -> None:
    started = time.monotonic()
    err = error(make(host, fetch_timeout_s=0.5).fetch(host.url("a.jpg", drip=0.01)))
    assert err.code == "fetch_timeout"
    assert time.monotonic() - started < 2.5  # the drip alone would take ~18 minutes


def test_request_deadline_bounds_the_fetch(host: ImageHost) -> None:
    started = time.monotonic()
    err = error(make(host, fetch_timeout_s=10).fetch(host.url("a.jpg", delay=3), deadline=started + 0.5))
    assert err.code == "fetch_timeout" and time.monotonic() - started < 2


def test_endless_body_stops_at_the_byte_cap(host: ImageHost) -> None:
    err = error(make(host, max_image_bytes=1024 * 1024).fetch(host.url("a.jpg", endless=1)))
    assert err.code == "image_too_large" and "GREENSERVE_MAX_IMAGE_BYTES" in err.message


def test_declared_length_over_the_cap_is_refused_before_reading(host: ImageHost) -> None:
    err = error(make(host, max_image_bytes=64 * 1024).fetch(host.url("a.jpg", length=999_999_999)))
    assert err.code == "image_too_large" and "999999999" in err.message


def test_gzip_body_is_decoded(host: ImageHost) -> None:
    assert make(host).fetch(host.url("a.jpg", gzip=1)) == JPEG


def test_gzip_bomb_is_not_inflated_past_the_cap(host: ImageHost) -> None:
    assert len(gzip.compress(BLOBS["zeros.jpg"])) < 64 * 1024  # small on the wire, 4 MiB inflated
    err = error(make(host, max_image_bytes=1024 * 1024).fetch(host.url("zeros.jpg", gzip=1)))
    assert err.code == "image_too_large"


def test_a_large_gzip_body_is_inflated_whole(host: ImageHost) -> None:
    assert make(host).fetch(host.url("zeros.jpg", gzip=1)) == BLOBS["zeros.jpg"]


def test_a_long_read_yields_to_the_hub_after_every_chunk(host: ImageHost, monkeypatch: pytest.MonkeyPatch) -> None:
    # buffered bytes never make the reading greenlet wait: only these yields let /healthz in meanwhile
    sleeps: list[float] = []
    real_sleep = gevent.sleep
    monkeypatch.setattr(gevent, "sleep", lambda s=0, *a, **k: (sleeps.append(s), real_sleep(s, *a, **k))[1])
    assert make(host).fetch(host.url("zeros.jpg")) == BLOBS["zeros.jpg"]
    assert sleeps.count(0) >= len(BLOBS["zeros.jpg"]) // fetch_body.CHUNK_BYTES


def test_a_long_read_waits_between_chunks_while_an_urgent_forward_runs(host: ImageHost) -> None:
    """The worker's fetcher reads with its ``Urgency`` as pace: a 4 MiB body stops at its next chunk while a
    forward someone waits on has the cores, and goes on when it ends."""
    urgency = Urgency()
    fetcher = HttpFetcher(Settings(image_base_url=host.base_url, fetch_timeout_s=3.0), pace=urgency)
    with urgency.forward():
        reading = gevent.spawn(fetcher.fetch, host.url("zeros.jpg", t="urgent"))
        gevent.sleep(0.2)
        assert not reading.dead, "read through an urgent forward"
    assert reading.get(timeout=3) == BLOBS["zeros.jpg"]


def test_a_body_cut_short_fails_and_the_fetcher_carries_on(host: ImageHost) -> None:
    url = host.url("zeros.jpg", cut=100_000, t="cut")  # Content-Length says 4 MiB; 100 KB come, then EOF
    fetcher = make(host, fetch_retries=0)
    err = error(fetcher.fetch(url))
    assert err.code == "fetch_failed" and "connection broke" in err.message
    assert fetcher.fetch(host.url("a.jpg")) == JPEG


def test_unknown_content_encoding_is_refused(host: ImageHost) -> None:
    assert error(make(host).fetch(host.url("a.jpg", encoding="br"))).code == "fetch_failed"


@pytest.mark.usefixtures("quick_backoff")
def test_connection_reset_fails_after_bounded_retries(host: ImageHost) -> None:
    url = host.url("a.jpg", reset=1, t="reset")
    assert error(make(host, fetch_retries=2).fetch(url)).code == "fetch_failed"
    assert hits(host, url) == 3


def test_a_host_that_is_down_fails_its_image(host: ImageHost) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed when the block ends: nothing listens there
    fetcher = make(host, fetch_allow=(f"http://127.0.0.1:{dead}",), fetch_retries=1)
    started = time.monotonic()
    err = error(fetcher.fetch(f"http://127.0.0.1:{dead}/a.jpg"))
    assert err.code == "fetch_failed" and "refused" in err.message.lower()
    assert time.monotonic() - started < 2


def test_non_http_url_is_invalid(host: ImageHost) -> None:
    assert error(make(host).fetch("ftp://127.0.0.1/a.jpg")).code == "invalid_url"


def test_duplicate_urls_are_fetched_once(host: ImageHost) -> None:
    url, other = host.url("a.jpg", t="dup"), host.url("a.jpg", t="dup2")
    results = dict(make(host).fetch_many([url, other, url, url, url, other]))
    assert sorted(results) == [0, 1, 2, 3, 4, 5] and all(r.data == JPEG for r in results.values())
    assert hits(host, url) == 1 and hits(host, other) == 1


def test_thirty_urls_at_200ms_take_about_one_latency(host: ImageHost) -> None:
    urls = [host.url("a.jpg", delay=0.2, n=i) for i in range(30)]
    started = time.monotonic()
    results = list(make(host, fetch_concurrency=16).fetch_many(urls))
    elapsed = time.monotonic() - started
    assert len(results) == 30 and all(r.data == JPEG for _, r in results)
    assert elapsed < 2.0, f"{elapsed:.2f}s: fetched one after another (30 x 0.2 s = 6 s)?"


def test_worker_cap_bounds_fetches_across_requests() -> None:
    with ImageHost(BLOBS) as fresh:
        fetcher = make(fresh, fetch_concurrency=8, fetch_worker_concurrency=3)
        jobs = [gevent.spawn(lambda k=k: list(fetcher.fetch_many([fresh.url("a.jpg", delay=0.1, r=k, n=i)
                                                                  for i in range(5)]))) for k in range(2)]
        gevent.joinall(jobs, raise_error=True)
        assert all(len(job.value) == 5 for job in jobs)
        assert fresh.max_inflight == 3


def test_keep_alive_reuses_one_connection_per_host() -> None:
    with ImageHost(BLOBS) as fresh:
        fetcher = make(fresh)
        for i in range(5):
            assert fetcher.fetch(fresh.url("a.jpg", n=i)) == JPEG
        assert fresh.connections == 1


def test_connects_to_the_checked_address_and_keeps_the_host_name(host: ImageHost) -> None:
    dns = FakeDNS({"images.example": ["127.0.0.1"]})  # the system resolver does not know this name
    policy = AddressPolicy([f"http://images.example:{host.port}"], resolver=dns)
    fetcher = HttpFetcher(Settings(fetch_timeout_s=3), policy=policy)
    assert fetcher.fetch(f"http://images.example:{host.port}/a.jpg?t=pinned") == JPEG
    assert dns.asked == ["images.example"]  # one lookup, by the guard; the connection used its answer
    assert host.headers_seen[-1]["Host"] == f"images.example:{host.port}"


def test_the_next_checked_address_is_tried_when_one_refuses(host: ImageHost) -> None:
    dns = FakeDNS({"two.example": ["127.0.0.3", "127.0.0.1"]})  # nothing listens on 127.0.0.3
    fetcher = HttpFetcher(Settings(fetch_timeout_s=3, fetch_retries=0),
                          policy=AddressPolicy(["127.0.0.0/8"], resolver=dns))
    assert fetcher.fetch(f"http://two.example:{host.port}/a.jpg") == JPEG


def test_failed_fetch_is_logged_with_the_request_id(host: ImageHost, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="service.pipeline.fetch"):
        results = list(make(host).fetch_many([host.url("nope.jpg")], request_id="rid-fetch-42"))
    assert error(results[0][1]).code == "fetch_failed"
    assert any("rid-fetch-42" in r.getMessage() and "fetch_failed" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------- HTTPS to a pinned address


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA and a certificate for images.example signed by it (made with the openssl CLI)."""
    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (d / "ext.cnf").write_text("subjectAltName=DNS:images.example\n")
    for cmd in (["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test CA"],
                ["req", *ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=images.example"],
                ["x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", "leaf.pem", "-days", "2", "-extfile", "ext.cnf"]):
        subprocess.run(["openssl", *cmd], cwd=d, check=True, capture_output=True)
    return d


def test_https_connects_to_the_pinned_address_and_verifies_the_name(tls_files: Path) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls_files / "leaf.pem", tls_files / "leaf.key")
    with ImageHost(BLOBS, tls=ctx) as secure:
        dns = FakeDNS({"images.example": ["127.0.0.1"], "other.example": ["127.0.0.1"]})
        policy = AddressPolicy([f"https://images.example:{secure.port}", f"https://other.example:{secure.port}"],
                               resolver=dns)
        fetcher = HttpFetcher(Settings(fetch_timeout_s=3, fetch_retries=0), policy=policy,
                              verify=str(tls_files / "ca.pem"))
        assert fetcher.fetch(f"https://images.example:{secure.port}/a.jpg") == JPEG
        # same address, other name: the certificate is checked against the name, so this must fail
        err = error(fetcher.fetch(f"https://other.example:{secure.port}/a.jpg"))
        assert err.code == "fetch_failed" and "TLS" in err.message
