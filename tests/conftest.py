"""Shared fixtures. End-to-end fixtures start real processes: gunicorn -k gevent and a local image host."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import images
from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import CLIP_ARCH, GUARD_TOKEN, e2e_env


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
def clip_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seeded random weights saved the way open_clip's training saves them (``state_dict``, ``module.``)."""
    import open_clip
    import torch

    torch.manual_seed(7)
    model = open_clip.create_model(CLIP_ARCH, pretrained=None)
    path = tmp_path_factory.mktemp("clip") / f"{CLIP_ARCH}.pt"
    torch.save({"epoch": 1, "name": "test", "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}},
               path)
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


@pytest.fixture(scope="session")
def guarded(weights_file: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    """One worker with a token (GUARD_TOKEN) and a 4-image queue: auth and overload, for every protocol."""
    env = e2e_env(weights_file, image_host, GREENSERVE_API_TOKEN=GUARD_TOKEN, GREENSERVE_MAX_QUEUE_IMAGES="4")
    with GunicornServer(env, workers=1) as srv:
        yield srv
