"""Fixtures only the e2e tests use: a saved CLIP checkpoint, and a server with a token and a short queue. The
servers and image host that tests elsewhere use too are in ``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import CLIP_ARCH, GUARD_TOKEN, e2e_env


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
def guarded(weights_file: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    """One worker with a token (GUARD_TOKEN) and a 4-image queue: auth and overload, for every protocol."""
    env = e2e_env(weights_file, image_host, GREENSERVE_API_TOKEN=GUARD_TOKEN, GREENSERVE_MAX_QUEUE_IMAGES="4")
    with GunicornServer(env, workers=1) as srv:
        yield srv
