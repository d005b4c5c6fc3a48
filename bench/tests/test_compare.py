"""The gevent-vs-asyncio comparison harness (bench.compare) keeps working: its quick machinery on a tiny model."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench import album, compare, equivalence, k6

# A torchvision model with a Linear head (embeddings need one) that loads and runs in a blink.
TINY_MODEL = "mobilenet_v3_small"


@pytest.mark.e2e
@pytest.mark.slow
def test_quick_machinery_runs_every_design_and_they_agree(tmp_path: Path) -> None:
    plan = compare.Plan("test", TINY_MODEL, ns=(1,), open_fractions=(1.0,), open_duration_s=2.0,
                        max_inflight=2, bare_reps=1, album_count=3, album_max_side=800,
                        bare_at_end=False)

    doc = compare.run(plan, out_dir=tmp_path)

    labels = [d["label"] for d in doc["designs"]]
    assert labels == [d.label for d in compare.designs(doc["machine"]["cores"], doc["plan"]["model"])]
    for d in doc["designs"]:
        assert "error" not in d, d["error"]
        assert d["check_vs_bare"]["passed"], (d["label"], d["check_vs_bare"])
        closed, = d["closed"]
        assert (closed["images"], closed["errors"], closed["health_errors"]) == (3, 0, 0), d["label"]
        assert closed["health"]["count"] >= 1 and closed["latency"]["mean"] > 0
        assert d["open"][0]["images"] >= 3
    assert compare.passed(doc)
    written = json.loads((tmp_path / "compare-test.json").read_text())
    assert written["designs"][0]["closed"][0]["images"] == 3
    with Image.open(tmp_path / "compare-test.png") as png:
        assert png.size[0] > 1000
    text = compare.report.tables(doc)
    assert all(label in text for label in labels) and "| N |" in text


def _alike_embeddings(n: int = 6, dim: int = 64, seed: int = 0) -> np.ndarray:
    """Like random-weight embeddings: one shared direction plus small per-photo differences."""
    rng = np.random.default_rng(seed)
    x = 1.0 + 0.03 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_check_passes_float_noise() -> None:
    ref = _alike_embeddings()
    noisy = ref + np.float32(1e-6) * np.random.default_rng(1).normal(size=ref.shape).astype(np.float32)
    assert equivalence.compare(noisy, ref).passed


def test_check_fails_when_photos_are_swapped_even_though_raw_cosine_is_high() -> None:
    ref = _alike_embeddings()
    swapped = ref[[1, 0, 2, 3, 4, 5]]
    result = equivalence.compare(swapped, ref)
    assert result.min_cosine > 0.99  # the naive check would have passed
    assert not result.passed and not result.nearest_is_self


def test_check_fails_for_another_model_output_shape() -> None:
    assert not equivalence.compare(np.ones((3, 8)), np.ones((3, 16))).passed


def test_album_is_deterministic_and_carries_exif_orientation() -> None:
    spec = album.album_spec(10, max_side=200)
    assert [p.name for p in spec][:2] == ["img001.jpg", "img002.jpg"]
    assert album.render(spec[2]) == album.render(spec[2])
    with Image.open(io.BytesIO(album.render(spec[2]))) as img:
        assert img.getexif().get(0x0112) == 6 and img.format == "JPEG"
    full = album.album_spec()
    assert max(p.width * p.height for p in full) == 4032 * 3024 and len(full) == 30


def test_k6_loads_only_localhost() -> None:
    with pytest.raises(k6.K6Error, match="127.0.0.1"):
        k6.run_closed("http://10.1.2.3:8000", ["img001.jpg"], 1)


def test_a_design_that_failed_fails_the_comparison() -> None:
    ok = {"label": "x", "check_vs_bare": {"passed": True}}
    assert compare.passed({"designs": [ok]})
    assert not compare.passed({"designs": [ok, {"label": "y", "error": "RuntimeError: gunicorn exited"}]})
    assert not compare.passed({"designs": [{"label": "z", "check_vs_bare": {"passed": False}}]})
    assert not compare.passed({"designs": []})
