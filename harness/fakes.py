"""Fakes for unit tests of the HTTP layer, the pipeline and the engine (the e2e tests use the real things): a model,
a fetcher whose images live under ``BASE``, and a resolver."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from service.engine.types import ModelInfo, Transform
from service.errors import FetchError, ImageError
from service.pipeline.fetch import Fetched, Validators

LABELS = tuple(f"label{i}" for i in range(10))
BASE = "http://cdn.test/"  # the image base URL of the unit tests' apps: their FakeFetcher's URLs start with it


class FakeModel:
    """Embedding = per-channel means repeated; logits favour class (mean brightness // 26)."""

    def __init__(self, fail_when_batch_has: int | None = None, delay_s: float = 0.0) -> None:
        # a digest of its own: each fake is another model, so no entry of the embedding cache outlives it
        self.info = ModelInfo("fake", ("embeddings", "classify"), 6, LABELS, "cpu", "float32", "random",
                              Transform(resize_size=32, crop_size=32), weights_digest=uuid.uuid4().hex)
        self.fail_when_batch_has = fail_when_batch_has
        self.delay_s = delay_s
        self.batches: list[int] = []
        self.threads: set[str] = set()

    def forward(self, batch: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        self.threads.add(threading.current_thread().name)
        self.batches.append(len(batch))
        if self.delay_s:
            threading.Event().wait(self.delay_s)  # a real native sleep: the hub must not notice
        means = batch.reshape(len(batch), -1, 3).mean(axis=1)
        if self.fail_when_batch_has is not None and np.any(np.isclose(means[:, 0], self.fail_when_batch_has, atol=1)):
            raise RuntimeError("boom")
        feats = np.concatenate([means, means], axis=1).astype(np.float32)
        logits = np.zeros((len(batch), 10), np.float32)
        logits[np.arange(len(batch)), np.clip(means.mean(axis=1) // 26, 0, 9).astype(int)] = 5.0
        return torch.from_numpy(feats), torch.from_numpy(logits)

    def warm_up(self) -> None:
        pass


class FakeFetcher:
    def __init__(self, blobs: dict[str, bytes | ImageError]) -> None:
        self.blobs = blobs
        self.calls: list[str] = []

    def fetch_many(self, urls: Sequence[str], *, deadline: float | None = None, request_id: str = "",
                   validators: Mapping[str, Validators] | None = None) -> Iterator[tuple[int, Fetched | ImageError]]:
        for i, url in enumerate(urls):
            self.calls.append(url)
            blob = self.blobs.get(url, FetchError(f"HTTP 404 for {url}", code="fetch_failed"))
            yield i, blob if isinstance(blob, ImageError) else Fetched(blob)


class FakeDNS:
    """A resolver that answers from a table and counts questions."""

    def __init__(self, table: dict[str, Sequence[str]]) -> None:
        self.table = table
        self.asked: list[str] = []

    def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked.append(host)
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self.table[host]
