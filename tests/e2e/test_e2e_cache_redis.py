"""The embedding cache of a fleet: two greenserve instances behind the shipped nginx share entries through one
real ``redis-server`` (Debian's; skipped without it); Redis killed under load fails no request, and hits
resume once it is back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness import images
from harness.answers import cache_counts, metric
from harness.imagehost import ImageHost
from harness.load import Load, load_summary
from harness.nginx import Fleet, nginx_binary
from harness.redis_server import RedisServer, redis_binary
from harness.servers import e2e_env

pytestmark = pytest.mark.e2e
ALBUM = [f"img{i:03d}.jpg" for i in range(8)]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    if redis_binary() is None:
        pytest.skip("no redis-server: `make test` installs Debian's redis-server as root with apt-get")
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, redis_server: RedisServer,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if nginx_binary() is None:
        pytest.skip("no nginx binary on PATH or in /usr/sbin: `make test` installs nginx-light as root with apt-get")
    weights_file: Path = request.getfixturevalue("weights_file")
    image_host: ImageHost = request.getfixturevalue("image_host")
    # no memory tier: every lookup goes to Redis, so what is shown is Redis's doing (and its outage is felt)
    env = e2e_env(weights_file, image_host, GREENSERVE_TORCH_THREADS="1", GREENSERVE_CACHE=redis_server.url,
                  GREENSERVE_CACHE_TIMEOUT_MS="100", GREENSERVE_CACHE_MEMORY_MB="0")
    with Fleet(env, tmp_path_factory.mktemp("nginx-redis")).running() as fleet:
        yield fleet


def embed(url: str, names: list[str]) -> requests.Response:
    r = requests.post(url + "/v1/embeddings", json={"images": names}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_two_instances_share_hits_through_one_redis(fleet: Fleet) -> None:
    names = [f"{n}?fleet=1" for n in ALBUM]
    cold = embed(fleet.nginx.url, names)
    assert "fwd=miss; stored" in cold.headers["Cache-Status"]
    for i in (0, 1):  # each instance directly: one of them never saw the album
        inferred = metric(fleet.instance(i), "greenserve_images_total")
        warm = embed(fleet.instance(i).url, names)
        assert cache_counts(warm)["hit"] == "8", warm.headers
        assert metric(fleet.instance(i), "greenserve_images_total") == inferred
        assert [d["embedding"] for d in warm.json()["data"]] == [d["embedding"] for d in cold.json()["data"]]


def test_redis_killed_under_load_fails_nothing_and_hits_resume(fleet: Fleet, redis_server: RedisServer,
                                                                image_host: ImageHost) -> None:
    names = [f"{n}?kill=1" for n in ALBUM]
    embed(fleet.nginx.url, names)
    with Load(fleet.nginx.url, clients=4, body={"images": names}, duration_s=8) as load:
        time.sleep(2)
        redis_server.kill()
        time.sleep(3)
        redis_server.start()
    summary = load_summary(load.done)
    assert load.done and all(d.status == 200 for d in load.done), summary
    errors = sum(metric(fleet.instance(i), "greenserve_cache_store_errors_total", 'store="redis"') for i in (0, 1))
    assert errors > 0  # the outage was seen, and cost no request
    time.sleep(1.5)  # past RETRY_S: each instance tries Redis again on its next request
    # photos no instance has seen (none in its memory): one instance embeds them, the other finds them in Redis
    new = [f"after-{i}.jpg" for i in range(3)]
    for i, name in enumerate(new):
        image_host.blobs[name] = images.jpeg(500, 400, seed=7700 + i)
    embed(fleet.instance(0).url, new)
    inferred = metric(fleet.instance(1), "greenserve_images_total")
    again = embed(fleet.instance(1).url, new)
    assert cache_counts(again)["hit"] == "3" and metric(fleet.instance(1), "greenserve_images_total") == inferred
