"""One batch through the model, in the inference thread: its items stacked, the forward, each item's rows
handed back as numpy (or why it has none); and the running figures of the batches (``BatchStats``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.engine.types import BatchOutputs
from service.errors import OutOfMemory

log = logging.getLogger(__name__)

# Forward function: a stacked batch (uint8 (N, H, W, 3) crops, or (N, context) token ids) → (features or
# None, logits or None) with row i for item i, or ``BatchOutputs`` when some items got no row.
RunBatch = Callable[[Any], "tuple[Any, Any] | BatchOutputs"]
RunModel = Callable[[str, Any], "tuple[Any, Any] | BatchOutputs"]  # the same, for the model it names


# One item's outcome from the inference thread: its (features row, logits row), or why it has none
Outcome = tuple[np.ndarray | None, np.ndarray | None] | Exception


def _stacked(items: list[Any]) -> Any:
    """Crops or token ids stacked into one array; a batch holding JPEGs for the device stays a list
    (``LoadedModel.forward_items``)."""
    return np.stack(items) if all(isinstance(item, np.ndarray) for item in items) else items


def forward_stacked(run_batch: RunBatch, pixels: list[Any]) -> list[Outcome] | Exception:
    """In the inference thread: stack, forward, hand back each item's numpy rows, or the model's exception
    (which the collector logs once; raising here would make gevent print it as a crashed task too).

    A batch that runs out of device memory is split and its halves retried, down to single items; an
    item that does not fit alone gets the ``OutOfMemory`` (503 + Retry-After) and the rest their rows."""
    try:
        out = run_batch(_stacked(pixels))
    except OutOfMemory as exc:
        if len(pixels) == 1:
            log.warning("out of memory on a single item: %s", exc)
            return [exc]
        half = len(pixels) // 2
        log.warning("out of memory on a batch of %d: retrying it as %d + %d", len(pixels), half, len(pixels) - half)
        first, second = forward_stacked(run_batch, pixels[:half]), forward_stacked(run_batch, pixels[half:])
        if isinstance(first, Exception) or isinstance(second, Exception):
            return first if isinstance(first, Exception) else second
        return first + second
    except Exception as exc:
        return exc
    if not isinstance(out, BatchOutputs):
        out = BatchOutputs(*out)
    feats = None if out.features is None else np.asarray(out.features)
    logits = None if out.logits is None else np.asarray(out.logits)
    return [out.failed[i] if i in out.failed else (None if feats is None else feats[i], None if logits is None else logits[i])
            for i in range(len(pixels))]


@dataclass
class BatchStats:
    """Running figures of a batcher's forwards: Retry-After and the quantum read ``seconds_per_image``."""

    batches: int = 0
    seconds_per_image: float = 0.05  # refined by an exponential average of real batches
    on_batch: Callable[[int, float], None] | None = None
    on_interjected: Callable[[int], None] | None = None  # images run inside another caller's forward

    def record(self, n: int, seconds: float) -> None:
        self.batches += 1
        per_image = seconds / max(1, n)
        self.seconds_per_image = per_image if self.batches == 1 else 0.8 * self.seconds_per_image + 0.2 * per_image
        if self.on_batch:
            self.on_batch(n, seconds)
