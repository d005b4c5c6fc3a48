"""Stage 5: model rows → response items (L2-normalised embeddings, softmax top-k labels)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

NORM_EPS = 1e-12  # an all-zero feature vector stays zero instead of dividing by zero


def embedding(features: np.ndarray, *, normalize: bool) -> np.ndarray:
    """A contiguous float32 vector, for ``orjson.OPT_SERIALIZE_NUMPY``: each float written in its shortest
    float32 form (shorter and faster than ``tolist()``'s Python floats: docs/SCHEDULING.md#hub-turns); a
    client reading them back as float32 gets the model's exact values."""
    vec = features.astype(np.float32, copy=False)
    if normalize:
        vec = vec / np.float32(max(float(np.linalg.norm(vec)), NORM_EPS))
    return np.ascontiguousarray(vec)


def probabilities(logits: np.ndarray) -> np.ndarray:
    """The softmax of one row of logits (float64: the top-k scores are rounded from these)."""
    z = logits.astype(np.float64) - float(np.max(logits))
    probs = np.exp(z)
    return cast(np.ndarray, probs / probs.sum())


def top_k(logits: np.ndarray, k: int, labels: Sequence[str]) -> list[dict[str, Any]]:
    """Softmax scores of the ``k`` best classes, best first."""
    probs = probabilities(logits)
    k = min(k, probs.shape[0])
    best = np.argpartition(-probs, k - 1)[:k]
    best = best[np.argsort(-probs[best], kind="stable")]
    return [{"label": labels[i], "class_id": int(i), "score": round(float(probs[i]), 6)} for i in best]


def zero_shot(image: np.ndarray, label_units: np.ndarray, k: int, labels: Sequence[str], *, scale: float,
              bias: float) -> list[dict[str, Any]]:
    """CLIP zero-shot: softmax over ``scale * cosine + bias`` against the caller's labels, best ``k`` first."""
    cosines = label_units @ embedding(image, normalize=True)
    scored = top_k(cosines * np.float32(scale) + np.float32(bias), k, labels)
    for item in scored:
        item["cosine"] = round(float(cosines[item["class_id"]]), 6)
    return scored


def cosine(image: np.ndarray, unit: np.ndarray) -> float:
    """The cosine between an image's embedding and a unit vector (a query's)."""
    return round(float(embedding(image, normalize=True) @ unit), 6)


def label_scores(labels: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Top-k items as TorchServe's ``{label: score}`` (KServe v1 and TorchServe answers), best first; a name
    two classes share (ImageNet has two "crane"s) keeps its best score."""
    scores: dict[str, float] = {}
    for item in labels:
        scores.setdefault(item["label"], item["score"])
    return scores
