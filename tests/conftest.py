"""Fixtures for the whole tree: a private disk cache for every app, and the real things (a resnet18 state dict, the
image host, a gunicorn server) that the e2e tests share with the few unit, deploy and docs tests that need one. The
fixtures only e2e tests use are in ``e2e/conftest.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import images
from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import e2e_env


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Apps built in this process keep their disk cache under this run's temporary directory, never in the
    user's ~/.cache (an entry from another run would answer instead of the model). Servers the harness
    starts get a directory of their own (``GunicornServer``)."""
    from service.settings import Settings

    directory = str(tmp_path_factory.mktemp("embedding-cache"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Settings, "cache_directory", lambda self: self.cache_dir or directory)
        yield


@pytest.fixture(scope="session")
def weights_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A resnet18 state dict with seeded random weights, saved the way users save theirs."""
    import torch
    import torchvision

    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("weights") / "resnet18.pt"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    return path


@pytest.fixture(scope="session")
def album() -> dict[str, bytes]:
    """What the image host serves: photos plus every kind of bad file."""
    blobs = {f"img{i:03d}.jpg": images.jpeg(800 + 40 * i, 600, seed=i) for i in range(8)}
    blobs.update({
        "big.jpg": images.jpeg(3000, 2000, seed=99),
        "empty.jpg": b"",
        "truncated.jpg": images.truncated_jpeg(),
        "page.jpg": images.HTML,
        "bomb.png": images.pixel_bomb(),
        "scan.tif": images.tiff(),
    })
    return blobs


@pytest.fixture(scope="session")
def image_host(album: dict[str, bytes]) -> Iterator[ImageHost]:
    with ImageHost(album) as host:
        yield host


@pytest.fixture(scope="session")
def server(weights_file: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    """greenserve under gunicorn -k gevent: 2 workers, resnet18 from a saved state dict."""
    with GunicornServer(e2e_env(weights_file, image_host), workers=2) as srv:
        yield srv
