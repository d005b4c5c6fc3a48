from __future__ import annotations

import numpy as np
import orjson
import pytest

from service.pipeline.postprocess import embedding, top_k


def test_embedding_is_unit_norm_when_normalized() -> None:
    vec = embedding(np.array([3.0, 4.0], dtype=np.float32), normalize=True)
    assert vec == pytest.approx([0.6, 0.8])


def test_embedding_raw_when_not_normalized() -> None:
    assert embedding(np.array([3.0, 4.0], dtype=np.float32), normalize=False).tolist() == [3.0, 4.0]


def test_zero_embedding_stays_zero() -> None:
    assert embedding(np.zeros(3, dtype=np.float32), normalize=True).tolist() == [0.0, 0.0, 0.0]


def test_embedding_json_holds_the_exact_float32_values() -> None:
    features = np.random.default_rng(0).standard_normal((4, 2048)).astype(np.float32)
    column = features.T[7]  # a strided view: orjson serialises contiguous arrays only
    for row in (features[1], column):
        vec = embedding(row, normalize=True)
        text = orjson.dumps({"embedding": vec}, option=orjson.OPT_SERIALIZE_NUMPY)
        back = np.asarray(orjson.loads(text)["embedding"], dtype=np.float32)
        assert back.dtype == np.float32 and np.array_equal(back, row / np.float32(np.linalg.norm(row)))


def test_top_k_sorted_by_score_with_labels() -> None:
    logits = np.array([0.1, 5.0, 2.0, 3.0], dtype=np.float32)
    out = top_k(logits, 3, ["a", "b", "c", "d"])
    assert [o["label"] for o in out] == ["b", "d", "c"]
    assert [o["class_id"] for o in out] == [1, 3, 2]
    assert out[0]["score"] > out[1]["score"] > out[2]["score"]
    assert sum(o["score"] for o in top_k(logits, 4, "abcd")) == pytest.approx(1.0, abs=1e-5)


def test_top_k_larger_than_classes_is_clamped() -> None:
    assert len(top_k(np.array([1.0, 2.0]), 5, ["a", "b"])) == 2
