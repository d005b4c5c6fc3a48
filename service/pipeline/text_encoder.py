"""Texts through the text tower: tokenise in a decode thread, forward in the text batcher, and a per-worker
LRU of label and query embeddings so that a repeated label set (zero-shot) costs no text forward.

The cache lives on the hub (greenlets only, no lock) and holds unit vectors keyed by the exact prompt.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service import metrics
from service.engine.runner import Runner
from service.engine.scheduling import Admission
from service.engine.types import Row
from service.errors import PayloadTooLarge, RequestError
from service.pipeline.postprocess import embedding


@dataclass(frozen=True)
class TextRow:
    embedding: np.ndarray  # float32, not normalised
    tokens: int
    truncated: bool
    queue_s: float
    inference_s: float


class TextEncoder:
    def __init__(self, runner: Runner, cache_size: int, *, max_tokens: int) -> None:
        self.runner = runner
        self.cache_size = cache_size
        # The text tower's work grows with the tokens sent through it; without this bound, the largest label set
        # of long labels the other limits allow took a ViT-B/32 ~55 s of one core (docs/SIZING.md, Texts)
        self.max_tokens = max_tokens
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def encode(self, texts: Sequence[str], *, deadline: float, admission: Admission,
               truncate: bool = True) -> list[TextRow]:
        """Each text's embedding, in order. With ``truncate`` false, a text past the context length is refused."""
        tokens = self.runner.tokenize(texts, admission.model or None)
        if not truncate and any(tokens.truncated):
            first = tokens.truncated.index(True)
            info = self.runner.engine(admission.model or None).info
            raise RequestError(f"text {first} has more tokens than the model's context length "
                               f"({info.context_length if info else '?'}), or a run of letters longer than any word; "
                               "shorten it or send \"truncate\": true", code="over_context_length")
        total = sum(tokens.lengths)
        if total > self.max_tokens:
            raise PayloadTooLarge(f"the texts come to {total} tokens through the text tower; the limit is "
                                  f"{self.max_tokens} a request: send fewer or shorter texts (or labels), or split "
                                  "the request (GREENSERVE_MAX_TEXT_TOKENS)", code="too_many_tokens")
        # shortest first: the text batcher takes them in turn, and a batch runs at its longest text's length
        by_length = sorted(range(len(texts)), key=tokens.lengths.__getitem__)
        pending = {i: self.runner.infer_text(tokens.ids[i], deadline, admission) for i in by_length}
        rows: list[Row] = [pending[i].get() for i in range(len(texts))]
        out = []
        for row, n, cut in zip(rows, tokens.lengths, tokens.truncated, strict=True):
            assert row.features is not None
            out.append(TextRow(row.features, n, cut, row.queue_s, row.inference_s))
        return out

    def unit_vectors(self, prompts: Sequence[str], *, deadline: float, admission: Admission) -> np.ndarray:
        """(len(prompts), dim) unit vectors; prompts seen before come from the cache, the rest in one go."""
        keys = [f"{admission.model}\n{p}" for p in prompts]  # each model's vectors apart
        missing = [p for p, k in dict.fromkeys(zip(prompts, keys, strict=True)) if k not in self._cache]
        self.hits += len(prompts) - len(missing)
        self.misses += len(missing)
        metrics.TEXT_CACHE.labels("hit").inc(len(prompts) - len(missing))
        metrics.TEXT_CACHE.labels("miss").inc(len(missing))
        fresh = {}
        if missing:
            started = time.monotonic()
            rows = self.encode(missing, deadline=deadline, admission=admission)
            fresh = {p: embedding(r.embedding, normalize=True) for p, r in zip(missing, rows, strict=True)}
            metrics.STAGE_SECONDS.labels("text").observe(time.monotonic() - started)
        vectors = np.stack([fresh[p] if p in fresh else self._hit(k) for p, k in zip(prompts, keys, strict=True)])
        for p, v in fresh.items():
            self._keep(f"{admission.model}\n{p}", v)
        return vectors

    def _hit(self, key: str) -> np.ndarray:
        self._cache.move_to_end(key)
        return self._cache[key]

    def _keep(self, key: str, vector: np.ndarray) -> None:
        if self.cache_size <= 0:
            return
        self._cache[key] = vector
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

