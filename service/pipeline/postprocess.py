"""Stage 5: model rows → response items (L2-normalised embeddings, softmax top-k labels)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

NORM_EPS = 1e-12  # an all-zero feature vector stays zero instead of dividing by zero


def embedding(features: np.ndarray, *, normalize: bool) -> list[float]:
    vec = features.astype(np.float32, copy=False)
    if normalize:
        vec = vec / max(float(np.linalg.norm(vec)), NORM_EPS)
    return vec.tolist()


def top_k(logits: np.ndarray, k: int, labels: Sequence[str]) -> list[dict[str, Any]]:
    """Softmax scores of the ``k`` best classes, best first."""
    z = logits.astype(np.float64) - float(np.max(logits))
    probs = np.exp(z)
    probs /= probs.sum()
    k = min(k, probs.shape[0])
    best = np.argpartition(-probs, k - 1)[:k]
    best = best[np.argsort(-probs[best], kind="stable")]
    return [{"label": labels[i], "class_id": int(i), "score": round(float(probs[i]), 6)} for i in best]
