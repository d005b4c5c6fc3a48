"""A request's answer, shaped: each image's result for its task (an embedding, labels, a score), its
errors, and its timings in one shape for images and texts.

``timings_ms`` holds, per stage, the wall-clock span from its first start to its last end for this request;
stages overlap (image 2 is fetched while image 1 is decoded), so they need not add up to ``total``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.engine.types import ModelInfo, Row
from service.errors import ImageError, image_error_item
from service.pipeline import postprocess
from service.pipeline.requests import ImageRef, InferenceRequest
from service.pipeline.text_encoder import TextRow

STAGES = ("text", "fetch", "decode", "queue", "inference")


@dataclass
class Spans:
    """First start and last end of each stage (monotonic seconds)."""

    spans: dict[str, list[float]] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)  # the request's arrival (its Admission.arrived)

    def add(self, stage: str, start: float, end: float) -> None:
        s = self.spans.setdefault(stage, [start, end])
        s[0], s[1] = min(s[0], start), max(s[1], end)

    def ms(self, stage: str) -> float:
        s = self.spans.get(stage)
        return round((s[1] - s[0]) * 1000, 1) if s else 0.0

    def timings(self, *, texts: bool, stages: Sequence[str] = STAGES) -> dict[str, float]:
        """Each stage's span and the total so far, in ms (``text`` only where texts were embedded)."""
        timings = {stage: self.ms(stage) for stage in stages if stage != "text" or texts}
        timings["total"] = round((time.monotonic() - self.started) * 1000, 1)
        return timings


def images(req: InferenceRequest, task: str, info: ModelInfo, outcomes: dict[int, Row | ImageError],
           failures: list[tuple[int, str, ImageError]], spans: Spans, prompts: np.ndarray | None) -> dict[str, Any]:
    """``{"data": [{"index", "image", ...its result}], "errors": [...], "timings_ms": {...}}``."""
    data = []
    for ref in req.refs:
        row = outcomes.get(ref.index)
        if isinstance(row, Row):
            data.append({"index": ref.index, "image": ref.name, **result(req, task, info, row, prompts)})
    if task == "rank":  # best first; ties keep request order
        data = sorted(data, key=lambda item: -item["score"])[:req.top_k]
    return {"data": data, "errors": [image_error_item(i, name, err) for i, name, err in failures],
            "timings_ms": spans.timings(texts=prompts is not None)}


def texts(req: InferenceRequest, rows: Sequence[TextRow], spans: Spans) -> dict[str, Any]:
    """Text embeddings: ``{"data": [{"index", "embedding", "tokens", "truncated"}], ...}``; the timings are
    the slowest text's queue and inference, as spans ending now."""
    end = time.monotonic()
    inference, queue = max(r.inference_s for r in rows), max(r.queue_s for r in rows)
    spans.add("queue", end - inference - queue, end - inference)
    spans.add("inference", end - inference, end)
    data = [{"index": i, "embedding": postprocess.embedding(r.embedding, normalize=req.normalize),
             "tokens": r.tokens, "truncated": r.truncated} for i, r in enumerate(rows)]
    return {"data": data, "errors": [], "timings_ms": spans.timings(texts=False, stages=("queue", "inference"))}


def item(req: InferenceRequest, task: str, info: ModelInfo, ref: ImageRef, outcome: Row | ImageError,
         prompts: np.ndarray | None) -> dict[str, Any]:
    """One image's line in a streamed answer: its result as in ``data``, or its error as in ``errors``."""
    if isinstance(outcome, ImageError):
        err = image_error_item(ref.index, ref.name, outcome)
        return {"index": ref.index, "image": ref.name, "error": {k: v for k, v in err.items() if k not in ("index", "image")}}
    return {"index": ref.index, "image": ref.name, **result(req, task, info, outcome, prompts)}


def result(req: InferenceRequest, task: str, info: ModelInfo, row: Row, prompts: np.ndarray | None) -> dict[str, Any]:
    """One image's answer for ``task``."""
    if task == "embeddings":
        assert row.features is not None  # the api refuses embeddings from a model without them
        return {"embedding": postprocess.embedding(row.features, normalize=req.normalize)}
    if prompts is None:  # a classifier's own labels
        assert row.logits is not None
        return {"labels": postprocess.top_k(row.logits, req.top_k, info.labels)}
    assert row.features is not None
    if task == "rank":
        return {"score": postprocess.cosine(row.features, prompts[0])}
    return {"labels": postprocess.zero_shot(row.features, prompts, req.top_k, req.text.labels,
                                            scale=info.logit_scale, bias=info.logit_bias)}
