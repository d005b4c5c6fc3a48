"""The embedding cache on real gunicorn -k gevent with the real image host (ETags, 304s): a re-synced album
is answered without a decode, a forward or a downloaded byte; a changed photo alone is embedded again; a hit
is exactly the miss's vector; a redirect moved to another URL with the same ETag answers the new photo; the
host's Cache-Control is obeyed; the disk store survives a restart and holds its cap; ``greenserve cache
stats|clear`` see and empty it."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness import images
from harness.answers import cache_counts, metric
from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import e2e_env

pytestmark = pytest.mark.e2e
ALBUM = [f"p{i:02d}.jpg" for i in range(30)]
TIMEOUT = 120


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    with ImageHost({name: images.jpeg(1600, 1200, seed=100 + i) for i, name in enumerate(ALBUM)}) as h:
        yield h


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disk-cache")


@pytest.fixture(scope="module")
def server(weights_file: Path, host: ImageHost, cache_dir: Path) -> Iterator[GunicornServer]:
    """Two workers sharing one disk store: a re-sync answered by the other worker still hits."""
    env = e2e_env(weights_file, host, GREENSERVE_CACHE_DIR=str(cache_dir))
    with GunicornServer(env, workers=2) as srv:
        assert "no disk store" not in srv.log(), srv.log()  # both workers booted together onto one new file
        yield srv


def embed(srv: GunicornServer, names: list[str], **body: object) -> tuple[requests.Response, float]:
    t0 = time.perf_counter()
    r = requests.post(srv.url + "/v1/embeddings", json={"images": names, **body}, timeout=TIMEOUT)
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    return r, took


def vectors(r: requests.Response) -> dict[int, list[float]]:
    return {item["index"]: item["embedding"] for item in r.json()["data"]}


def test_a_resynced_album_is_answered_without_decode_forward_or_download(server: GunicornServer,
                                                                          host: ImageHost) -> None:
    cold, cold_s = embed(server, ALBUM)
    assert "fwd=miss; stored" in cold.headers["Cache-Status"] and cache_counts(cold)["miss"] == "30"
    inferred, downloaded, not_modified = metric(server, "greenserve_images_total"), host.body_bytes, host.not_modified
    warm, warm_s = embed(server, ALBUM)
    assert warm.headers["Cache-Status"].startswith("greenserve; fwd=stale; fwd-status=304"), warm.headers
    assert cache_counts(warm) == {"hit": "30", "revalidated": "30", "fresh": "0", "miss": "0"}
    assert metric(server, "greenserve_images_total") == inferred  # 0 forwards
    assert warm.json()["timings_ms"]["decode"] == 0.0 and warm.json()["timings_ms"]["inference"] == 0.0  # 0 decodes
    assert host.body_bytes == downloaded and host.not_modified == not_modified + 30  # 0 bytes: 30 x 304
    assert vectors(warm) == vectors(cold)  # exactly: the float32 values the forward gave
    print(f"cold {cold_s * 1000:.0f} ms, re-sync {warm_s * 1000:.0f} ms: {cold_s / warm_s:.1f}x")


def test_one_changed_photo_is_embedded_again_and_the_others_are_not(server: GunicornServer, host: ImageHost) -> None:
    names = ALBUM[:10]
    before, _ = embed(server, names)
    inferred = metric(server, "greenserve_images_total")
    host.replace(names[3], images.jpeg(1600, 1200, seed=999))
    after, _ = embed(server, names)
    assert cache_counts(after)["miss"] == "1" and cache_counts(after)["revalidated"] == "9", after.headers
    assert metric(server, "greenserve_images_total") == inferred + 1
    old, new = vectors(before), vectors(after)
    assert new[3] != old[3] and all(new[i] == old[i] for i in old if i != 3)


def test_a_redirect_moved_to_another_photo_with_the_same_etag_answers_that_photo(server: GunicornServer,
                                                                                 host: ImageHost) -> None:
    """A validator speaks for one URL's bytes: once the redirect ends at another URL, whose host reuses the old
    target's ETag, no 304 answers for it; the new photo is fetched whole and answered with its own vector."""
    host.replace("etag-a.jpg", images.jpeg(1600, 1200, seed=7001))
    host.replace("etag-b.jpg", images.jpeg(1600, 1200, seed=7002))
    direct, _ = embed(server, ["etag-b.jpg"])  # B's vector, from its own URL
    host.redirect("cover.jpg", "/etag-a.jpg?etag=shared")
    first, _ = embed(server, ["cover.jpg"])
    assert cache_counts(first)["miss"] == "1" and vectors(first) != vectors(direct)
    again, _ = embed(server, ["cover.jpg"])  # the same redirect to the same URL: its 304 does vouch for A
    assert again.headers["Cache-Status"].startswith("greenserve; fwd=stale; fwd-status=304") and vectors(again) == vectors(first)
    host.redirect("cover.jpg", "/etag-b.jpg?etag=shared")
    not_modified = host.not_modified
    moved, _ = embed(server, ["cover.jpg"])
    assert vectors(moved) == vectors(direct)  # exactly B's
    assert "304" not in moved.headers["Cache-Status"] and cache_counts(moved)["revalidated"] == "0", moved.headers
    assert host.not_modified == not_modified  # nothing asked B conditionally
    settled, _ = embed(server, ["cover.jpg"])
    assert vectors(settled) == vectors(direct)
    print(f"moved: {moved.headers['Cache-Status']}; then: {settled.headers['Cache-Status']}")


def test_options_are_applied_after_the_cache(server: GunicornServer) -> None:
    raw, _ = embed(server, ALBUM[20:22], normalize=False)
    unit, _ = embed(server, ALBUM[20:22])
    assert cache_counts(unit)["hit"] == "2"
    assert abs(sum(v * v for v in unit.json()["data"][0]["embedding"]) - 1) < 1e-4
    assert abs(sum(v * v for v in raw.json()["data"][0]["embedding"]) - 1) > 1e-3


def test_the_hosts_cache_control_is_obeyed(server: GunicornServer, host: ImageHost) -> None:
    fresh = [f"{n}?cache_control=max-age%3D300" for n in ALBUM[24:26]]
    embed(server, fresh)
    hits = host.hits["/" + ALBUM[24]]
    again, _ = embed(server, fresh)
    assert cache_counts(again)["fresh"] == "2" and host.hits["/" + ALBUM[24]] == hits  # inside max-age: not asked
    kept_out = [f"{ALBUM[27]}?cache_control=no-store"]
    embed(server, kept_out)
    inferred = metric(server, "greenserve_images_total")
    twice, _ = embed(server, kept_out)
    assert "fwd=bypass" in twice.headers["Cache-Status"] and metric(server, "greenserve_images_total") == inferred + 1


def test_without_validators_the_content_still_finds_the_entry(server: GunicornServer, host: ImageHost) -> None:
    bare = [f"{n}?validators=0" for n in ALBUM[28:30]]
    embed(server, bare)
    downloaded = host.body_bytes
    again, _ = embed(server, bare)
    assert cache_counts(again)["hit"] == "2" and cache_counts(again)["revalidated"] == "0"
    assert host.body_bytes > downloaded  # downloaded again (nothing to ask with), but not decoded or inferred
    assert again.json()["timings_ms"]["inference"] == 0.0


def test_uploads_hit_by_content(server: GunicornServer) -> None:
    data = "data:image/jpeg;base64," + base64.b64encode(images.jpeg(900, 700, seed=4242)).decode()
    first, _ = embed(server, [data])
    second, _ = embed(server, [data])
    assert cache_counts(first)["miss"] == "1" and second.headers["Cache-Status"].startswith("greenserve; hit")
    assert vectors(first) == vectors(second)


def test_a_restart_keeps_the_disk_store(weights_file: Path, host: ImageHost, cache_dir: Path,
                                        server: GunicornServer) -> None:
    embed(server, ALBUM[:5])
    env = e2e_env(weights_file, host, GREENSERVE_CACHE_DIR=str(cache_dir))
    with GunicornServer(env, workers=1) as again:
        r, _ = embed(again, ALBUM[:5])
        assert cache_counts(r)["hit"] == "5" and metric(again, "greenserve_images_total") == 0


def test_the_caps_hold_under_distinct_photos(weights_file: Path, tmp_path: Path) -> None:
    photos = {f"d{i:03d}.jpg": images.jpeg(96, 96, seed=5000 + i) for i in range(240)}
    with ImageHost(photos) as many:
        env = e2e_env(weights_file, many, GREENSERVE_CACHE_DIR=str(tmp_path), GREENSERVE_CACHE_DISK_MB="1",
                      GREENSERVE_CACHE_MEMORY_MB="1")
        with GunicornServer(env, workers=2) as srv:
            names = list(photos)
            for i in range(0, len(names), 30):
                embed(srv, names[i:i + 30])
            memory = metric(srv, "greenserve_cache_memory_bytes")
            disk_evictions = metric(srv, "greenserve_cache_evictions_total", 'store="disk"')
            skipped = metric(srv, "greenserve_cache_store_errors_total", 'store="disk"')
    stats = cli("stats", GREENSERVE_CACHE_DIR=str(tmp_path))
    # resnet18: 512 features + 1,000 logits a photo, 6.2 KB packed: 240 photos are 1.5 MB
    assert stats["bytes"] <= 1024 * 1024, stats
    # the cap was reached and evicted from, unless writes were skipped (a lock held past the timeout): seen
    # once in a clean-clone run, with half the albums unwritten and the store under its cap
    assert disk_evictions > 0 or skipped > 0, (stats, disk_evictions, skipped)
    assert 0 < memory <= 2 * 1024 * 1024  # two workers, 1 MB each


def test_the_cli_shows_and_clears_the_store(server: GunicornServer, cache_dir: Path) -> None:
    embed(server, ALBUM[:3])
    assert cli("stats", GREENSERVE_CACHE_DIR=str(cache_dir))["entries"] >= 3
    assert cli("clear", GREENSERVE_CACHE_DIR=str(cache_dir))["removed"] >= 3
    assert cli("stats", GREENSERVE_CACHE_DIR=str(cache_dir))["entries"] == 0
    r, _ = embed(server, ALBUM[:3])
    # the workers' memory may still hold them; a miss anywhere is embedded again and stored on disk
    assert int(cache_counts(r)["hit"]) + int(cache_counts(r)["miss"]) == 3
    assert cli("stats", GREENSERVE_CACHE_DIR=str(cache_dir))["entries"] >= int(cache_counts(r)["miss"])


def cli(action: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GREENSERVE_")}
    out = subprocess.run([sys.executable, "-m", "service.cli", "cache", action], env={**clean, **env},
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)
