"""The text side without a model: request parsing, the label cache's LRU, zero-shot and rank scoring."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gevent.event import AsyncResult

from service.engine.types import Row, Tokens
from service.errors import PayloadTooLarge, RequestError
from service.pipeline import postprocess
from service.pipeline.inputs import parse_json
from service.pipeline.text_encoder import TextEncoder
from service.settings import Settings


class _Admission:
    arrived = 0.0
    model = "fake"

    def rank(self, index: int) -> tuple[float, int]:
        return (0.0, index)


class _Runner:
    """Embeds a text as a one-hot of its length: enough to tell texts apart and count forwards."""

    info = None

    def __init__(self) -> None:
        self.forwarded: list[int] = []

    def engine(self, name=None):
        return self

    def tokenize(self, texts, model=None):
        ids = np.zeros((len(texts), 8), np.int64)
        for i, t in enumerate(texts):
            ids[i, 0] = len(t)
        return Tokens(ids, tuple(min(len(t), 8) for t in texts), tuple(len(t) > 8 for t in texts))

    def infer_text(self, ids, deadline, admission):
        self.forwarded.append(int(ids[0]))
        vec = np.zeros(16, np.float32)
        vec[int(ids[0]) % 16] = 3.0
        result = AsyncResult()
        result.set(Row(vec, None, 0.0, 0.0, 1))
        return result


def test_the_label_cache_serves_repeats_without_a_forward_and_evicts_the_least_recent() -> None:
    runner = _Runner()
    enc = TextEncoder(runner, cache_size=2, max_tokens=1 << 20)
    first = enc.unit_vectors(["a", "bb"], deadline=1e9, admission=_Admission())
    assert np.allclose(np.linalg.norm(first, axis=1), 1) and runner.forwarded == [1, 2]
    enc.unit_vectors(["bb", "a"], deadline=1e9, admission=_Admission())
    assert runner.forwarded == [1, 2] and (enc.hits, enc.misses) == (2, 2)
    enc.unit_vectors(["ccc"], deadline=1e9, admission=_Admission())  # evicts "bb"
    enc.unit_vectors(["a", "bb"], deadline=1e9, admission=_Admission())
    assert runner.forwarded == [1, 2, 3, 2]


def test_a_label_cache_of_0_keeps_nothing() -> None:
    runner = _Runner()
    enc = TextEncoder(runner, cache_size=0, max_tokens=1 << 20)
    for _ in range(2):
        enc.unit_vectors(["a"], deadline=1e9, admission=_Admission())
    assert runner.forwarded == [1, 1] and enc.hits == 0


def test_refusing_truncation_names_the_text() -> None:
    enc = TextEncoder(_Runner(), cache_size=0, max_tokens=1 << 20)
    with pytest.raises(RequestError) as err:
        enc.encode(["ok", "x" * 20], deadline=1e9, admission=_Admission(), truncate=False)
    assert err.value.code == "over_context_length" and "text 1" in err.value.message


def test_texts_past_the_token_budget_are_413_before_any_forward() -> None:
    runner = _Runner()
    enc = TextEncoder(runner, cache_size=0, max_tokens=10)
    with pytest.raises(PayloadTooLarge) as err:
        enc.encode(["aaaaaa", "bbbbbb"], deadline=1e9, admission=_Admission())
    assert err.value.code == "too_many_tokens" and "12 tokens" in err.value.message and runner.forwarded == []
    assert len(enc.encode(["aaaaa", "bbbbb"], deadline=1e9, admission=_Admission())) == 2  # at the budget


def test_cached_labels_cost_nothing_of_the_budget() -> None:
    runner = _Runner()
    enc = TextEncoder(runner, cache_size=8, max_tokens=10)
    enc.unit_vectors(["aaaaaa"], deadline=1e9, admission=_Admission())
    enc.unit_vectors(["aaaaaa", "bbbbbb"], deadline=1e9, admission=_Admission())  # 6 new tokens, 6 cached
    assert runner.forwarded == [6, 6]


def test_texts_go_to_the_batcher_shortest_first_and_come_back_in_order() -> None:
    runner = _Runner()
    rows = TextEncoder(runner, cache_size=0, max_tokens=1 << 20).encode(["ccc", "a", "bb"], deadline=1e9,
                                                                        admission=_Admission())
    assert runner.forwarded == [1, 2, 3]  # a batch runs at its longest text's length: like lengths together
    assert [r.tokens for r in rows] == [3, 1, 2] and [int(np.argmax(r.embedding)) for r in rows] == [3, 1, 2]


def test_zero_shot_scores_are_a_softmax_over_scaled_cosines() -> None:
    labels_v = np.eye(3, 4, dtype=np.float32)
    image = np.array([3.0, 1.0, 0.0, 0.0], np.float32)
    scored = postprocess.zero_shot(image, labels_v, 3, ["a", "b", "c"], scale=100.0, bias=0.0)
    cos = labels_v @ (image / np.linalg.norm(image))
    expected = np.exp(100 * cos - 100 * cos.max())
    expected /= expected.sum()
    assert [s["label"] for s in scored] == ["a", "b", "c"]
    assert [s["score"] for s in scored] == pytest.approx(sorted(expected, reverse=True), abs=1e-6)
    assert scored[0]["cosine"] == pytest.approx(cos[0], abs=1e-6)


def _parse(doc: dict, task: str, **settings: object):
    return parse_json(json.dumps(doc).encode(), Settings(**settings), task)


def test_texts_labels_and_queries_parse_with_their_limits() -> None:
    req = _parse({"texts": ["a", "b"]}, "embeddings")
    assert req.refs == () and req.text.texts == ("a", "b")
    req = _parse({"images": ["https://x.example/a.jpg"], "labels": ["cat", "dog"], "template": "art of a {}"}, "classify")
    assert req.text.prompts == ("art of a cat", "art of a dog")
    req = _parse({"images": ["https://x.example/a.jpg"], "query": "sea"}, "rank")
    assert req.text.prompts == ("sea",) and req.top_k == 100  # rank returns everything by default
    with pytest.raises(PayloadTooLarge) as err:
        _parse({"texts": ["a"] * 3}, "embeddings", max_texts=2)
    assert err.value.code == "too_many_texts"
    with pytest.raises(RequestError, match="unknown field"):
        _parse({"images": ["https://x.example/a.jpg"], "labels": ["a"]}, "embeddings")
    with pytest.raises(RequestError, match="unknown field"):
        _parse({"texts": ["a"]}, "classify")
