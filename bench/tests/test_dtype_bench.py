"""The float32-vs-bfloat16 benchmark (bench.dtype_bench): its tables and verdicts from a made-up results
document, and one quick run on real servers."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench import bare, dtype_bench


def _load(images_per_s: float, mean_ms: float, max_ms: float, p99_ms: float, errors: int = 0) -> dict[str, Any]:
    """A k6 LoadResult row, only the fields the report reads."""
    return {"images_per_s": images_per_s, "errors": errors, "health_errors": 0,
            "latency": {"mean": mean_ms, "max": max_ms}, "health": {"p99": p99_ms}}


def _check(min_cosine: float, passed: bool, nearest: bool = True) -> dict[str, Any]:
    return {"images": 30, "min_cosine": min_cosine, "min_centered_cosine": min_cosine, "max_abs_diff": 1e-3,
            "nearest_is_self": nearest, "passed": passed}


def _server(requested: str, dtype: str | None, check: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    s = {"label": "greenserve 2x1 defaults", "requested": requested, "dtype": dtype, "precision": None,
         "saturation": [], "n5": [], **extra}
    if check is not None:
        s["check_vs_bare"] = check
    return s


def _doc() -> dict[str, Any]:
    bare_rows = [{"when": w, "dtype": d, "layout": lay, "images_per_s": ips}
                 for w, d, lay, ips in [("round 1", "float32", "2x1", 10.0), ("round 1", "float32", "1x2", 12.0),
                                        ("round 1", "bfloat16", "2x1", 24.0), ("end", "float32", "2x1", 8.0),
                                        ("end", "bfloat16", "2x1", 26.0)]]
    precision = {"requested": "auto", "chosen": "bfloat16", "reason": "amx_bf16, probe cosine 0.99998"}
    auto = _server("auto", "bfloat16", _check(0.99995, False), precision=precision,
                   saturation=[_load(22.0, 0, 0, 12), _load(24.0, 0, 0, 18)],
                   n5=[_load(20.0, 6000, 7000, 9), _load(20.0, 8000, 9500, 11, errors=1)])
    fp32 = _server("float32", "float32", _check(0.999999, True), saturation=[_load(9.9, 0, 0, 15)],
                   n5=[_load(9.0, 15000, 16000, 20)])
    return {"plan": {"name": "test"}, "album": {"photos": 30, "max_megapixels": 12.2},
            "machine": {"model": "resnet50", "cores": 2, "cpu": "Xeon", "cpu_flags": ["avx2", "amx_bf16"],
                        "torch": "2.x"},
            "bare": bare_rows, "bare_bf16_check": _check(0.99996, False), "servers": [auto, fp32], "seconds": 12.0}


def test_bare_best_is_the_best_layout_averaged_over_rounds() -> None:
    doc = _doc()
    assert dtype_bench.bare_best(doc["bare"], "float32") == 10.0  # (max(10, 12) + 8) / 2
    assert dtype_bench.bare_best(doc["bare"], "bfloat16") == 25.0
    assert dtype_bench.bare_best(doc["bare"], "float16") is None


def test_summary_rows_give_ratios_to_both_bare_dtypes_and_the_seeds_n5() -> None:
    auto, fp32 = dtype_bench.summary_rows(_doc())
    assert (auto["dtype requested"], auto["dtype chosen"]) == ("auto", "bfloat16")
    assert auto["saturation img/s"] == "23.0" and auto["x bare fp32"] == "2.30" and auto["x bare bf16"] == "0.92"
    assert (auto["N=5 mean s"], auto["N=5 max s"], auto["healthz p99 ms"]) == ("7.00", "9.50", "18")
    assert auto["errors"] == 1 and auto["min cosine"] == "0.999950"
    assert auto["verdict"] == "ok (cosine < 0.99999)"  # bf16's level: noted, even though equivalence fails it
    assert (fp32["x bare fp32"], fp32["verdict"]) == ("0.99", "ok")


def test_report_prints_the_machine_bare_table_servers_table_and_precision() -> None:
    text = dtype_bench.report_text(_doc())
    assert "native bf16: amx_bf16" in text and "| bare dtype | layout |" in text
    assert "| bfloat16 | 2x1 | 24.00, 26.00 | 25.00 | 2.78 |" in text  # bf16 over fp32 in the same layout
    assert "| design | dtype requested | dtype chosen | saturation img/s | x bare fp32 | x bare bf16 |" in text
    assert '"reason": "amx_bf16, probe cosine 0.99998"' in text


def test_verdicts_fail_errors_wrong_photos_and_inexact_float32() -> None:
    doc = _doc()
    assert dtype_bench.passed(doc)
    failed = _server("auto", None, None, error="RuntimeError: greenserve exited with 1:\nGREENSERVE_DTYPE='auto'")
    cases = [("FAILED: RuntimeError: greenserve exited with 1:", failed),
             ("WRONG embeddings", _server("bfloat16", "bfloat16", _check(0.998, False))),
             ("WRONG embeddings", _server("bfloat16", "bfloat16", _check(0.9999, False, nearest=False))),
             ("WRONG embeddings (float32 outside tolerance)", _server("float32", "float32", _check(0.9995, False)))]
    for expected, s in cases:
        assert dtype_bench.verdict(s) == expected
        assert not dtype_bench.passed({**doc, "servers": doc["servers"] + [s]})
    assert not dtype_bench.passed({**doc, "servers": []})
    assert "| - | - | - |" in dtype_bench.report.rows_table(dtype_bench.summary_rows({**doc, "servers": [failed]}))


def test_open_load_saturates_a_slow_dtype_with_enough_arrivals() -> None:
    plan = dtype_bench.FULL
    fast = dtype_bench.open_load(plan, 30.0, 30)  # 1.3 x 1 album/s = 78 albums/min
    assert fast == {"rate_per_min": 78, "duration_s": 15.0, "graceful_stop_s": 60}
    slow = dtype_bench.open_load(plan, 1.5, 30)  # bf16 emulated: 4 albums/min, so 2 min for 8 arrivals
    assert slow["rate_per_min"] == 4 and slow["duration_s"] == 120.0 and slow["graceful_stop_s"] == 300


def test_bare_float32_keeps_its_command_line() -> None:
    assert bare._dtype_args("float32") == [] and bare._dtype_args("bfloat16") == ["--dtype", "bfloat16"]
    with pytest.raises(ValueError, match="float16"):
        bare._dtype_args("float16")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DTYPE_BENCH_SMOKE"), reason="~2 min on 2 cores: set DTYPE_BENCH_SMOKE=1")
def test_quick_machinery_measures_both_dtypes_bare_and_served(tmp_path: Path) -> None:
    # opt-in: bf16 is emulated on CPUs without avx512_bf16/AMX, and this took 113 s on a loaded 2-core host
    # (--quick itself 104 s). --quick's plan on compare's test album (3 photos), a shorter open loop
    plan = dataclasses.replace(dtype_bench.QUICK, name="test", album_count=3, album_max_side=800,
                               open_duration_s=2.0, max_inflight=2)

    doc = dtype_bench.run(plan, ["float32", "bfloat16"], tmp_path, argv=["(test)"])

    assert dtype_bench.passed(doc), [dtype_bench.verdict(s) for s in doc["servers"]]
    assert {b["dtype"] for b in doc["bare"]} == {"float32", "bfloat16"}
    assert [(s["requested"], s["dtype"]) for s in doc["servers"]] == [("float32", "float32"), ("bfloat16", "bfloat16")]
    for s in doc["servers"]:
        sat, n5 = s["saturation"][0], s["n5"][0]
        assert sat["images"] >= 3 and (n5["images"], n5["errors"]) == (15, 0), s["requested"]
        assert n5["health"]["count"] >= 1 and s["check_vs_bare"]["min_cosine"] >= dtype_bench.COSINE_FAIL
    written = json.loads((tmp_path / "dtype-resnet18.json").read_text())
    assert [s["requested"] for s in written["servers"]] == ["float32", "bfloat16"] and "url" not in written["servers"][0]
