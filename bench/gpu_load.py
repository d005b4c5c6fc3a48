"""bench.gpu_check's machinery without torch: closed load with a /healthz probe, window samplers (server
metrics, CPU of processes, nvidia-smi), nvidia-smi parsers, the image host processes and the GPU memory hog.

Throughput is read from the server's own ``greenserve_images_total`` (all workers, multiprocess metrics) at
the window's edges: a closed loop of N clients x 30 images completes in bursts, so counting finished
requests in a short window is coarse; the client-side count is kept too (``served_images_per_s``).
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import requests

from harness.stats import percentile

PROBE_PERIOD_S = 0.05


@dataclass(frozen=True)
class Done:
    """One finished request of the load."""

    t: float  # time.monotonic() when its response ended
    seconds: float
    status: int  # 0: no response (connection error, timeout)
    images: int
    code: str = ""  # a non-200 body's error code, with its details' codes: "out_of_memory"
    retry_after: str | None = None


class Sampler(Protocol):
    def start(self) -> None: ...

    def stop(self) -> dict[str, Any]: ...


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def summarise(done: Sequence[Done], probes: Sequence[tuple[float, float, bool]], t0: float, t1: float,
              count_until: float | None = None) -> dict[str, Any]:
    """The load's figures over the window [t0, t1]; statuses of requests ending up to ``count_until`` (the
    drain included) when given."""
    end = t1 if count_until is None else count_until
    window = [d for d in done if t0 <= d.t <= end]
    ok = [d for d in window if d.status == 200]
    in_window = [d for d in ok if d.t <= t1]
    health = sorted(s for t, s, good in probes if t0 <= t <= t1 and good)
    latencies = sorted(d.seconds for d in ok)
    return {"window_s": round(t1 - t0, 2), "requests": len(window), "ok": len(ok), "errors": len(window) - len(ok),
            "served_images_per_s": round(sum(d.images for d in in_window) / max(t1 - t0, 1e-9), 1),
            "mean_latency_s": round(statistics.mean(latencies), 3) if latencies else None,
            "p95_latency_s": round(p, 3) if (p := percentile(latencies, 0.95)) is not None else None,
            "statuses": dict(sorted(Counter(f"{d.status} {d.code}".strip() for d in window).items())),
            "retry_after": sorted({d.retry_after for d in window if d.status != 200 and d.retry_after}),
            "healthz_p50_ms": _ms(percentile(health, 0.5)), "healthz_p99_ms": _ms(percentile(health, 0.99)),
            "healthz_max_ms": _ms(health[-1] if health else None), "healthz_probes": len(health),
            "healthz_errors": sum(1 for t, _, good in probes if t0 <= t <= t1 and not good)}


def error_code(body: Any) -> str:
    """``{"error": {"code", "details": [{"code"}]}}`` → "code" or "code/detail,codes"."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return "?"
    details = sorted({str(d.get("code")) for d in err.get("details") or [] if isinstance(d, dict) and d.get("code")})
    return str(err.get("code", "?")) + (f"/{','.join(details)}" if details and details != [err.get("code")] else "")


def _client(url: str, body: dict[str, Any], stop: threading.Event, out: list[Done], timeout_s: float) -> None:
    n = len(body["images"])
    with requests.Session() as session:
        while not stop.is_set():
            t0 = time.monotonic()
            code, retry = "", None
            try:
                r = session.post(url + "/v1/embeddings", json=body, timeout=timeout_s)
                status = r.status_code
                if status != 200:  # 200 bodies are not parsed: the client must not be the bottleneck
                    retry = r.headers.get("Retry-After")
                    try:
                        code = error_code(r.json())
                    except ValueError:
                        code = "not_json"
            except requests.RequestException as exc:
                status, code = 0, type(exc).__name__
            t1 = time.monotonic()
            out.append(Done(t1, t1 - t0, status, n, code, retry))


def _probe(url: str, stop: threading.Event, out: list[tuple[float, float, bool]]) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            good = requests.get(url + "/healthz", timeout=10).status_code == 200  # a fresh connection each time
        except requests.RequestException:
            good = False
        out.append((t0, time.monotonic() - t0, good))
        stop.wait(max(0.0, PROBE_PERIOD_S - (time.monotonic() - t0)))


def load(url: str, names: Sequence[str], *, clients: int, warm_s: float, measure_s: float,
         samplers: Iterable[Sampler] = (), timeout_s: float = 90.0, drain: bool = False) -> dict[str, Any]:
    """``clients`` users each sending album requests back to back, /healthz probed every 50 ms; figures of
    the ``measure_s`` window after ``warm_s``. ``drain``: statuses include requests finishing after it."""
    stop = threading.Event()
    done: list[Done] = []
    probes: list[tuple[float, float, bool]] = []
    body = {"images": list(names)}
    threads = [threading.Thread(target=_client, args=(url, body, stop, done, timeout_s), daemon=True)
               for _ in range(clients)] + [threading.Thread(target=_probe, args=(url, stop, probes), daemon=True)]
    for t in threads:
        t.start()
    time.sleep(warm_s)
    samplers = list(samplers)
    t0 = time.monotonic()
    for s in samplers:
        s.start()
    time.sleep(measure_s)
    extra: dict[str, Any] = {}
    for s in samplers:
        extra.update(s.stop())
    t1 = time.monotonic()
    stop.set()
    for t in threads:
        t.join(timeout_s + 5)
    return {**summarise(done, probes, t0, t1, time.monotonic() if drain else None), **extra}


def parse_metric(text: str, name: str) -> float:
    """Sum of a Prometheus text exposition's samples named exactly ``name`` (any labels)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)", line)
        if m:
            total += float(m.group(1))
    return total


class MetricsSampler:
    """Images through the model (all workers) over the window, and the mean batch size, from /metrics."""

    def __init__(self, url: str) -> None:
        self.url, self.first = url, (0.0, 0.0, 0.0, 0.0)

    def _read(self) -> tuple[float, float, float, float]:
        text = requests.get(self.url + "/metrics", timeout=10).text
        return (time.monotonic(), parse_metric(text, "greenserve_images_total"),
                parse_metric(text, "greenserve_batch_size_sum"), parse_metric(text, "greenserve_batch_size_count"))

    def start(self) -> None:
        self.first = self._read()

    def stop(self) -> dict[str, Any]:
        t, images, size, batches = (b - a for a, b in zip(self.first, self._read(), strict=True))
        return {"images_per_s": round(images / t, 1), "mean_batch": round(size / batches, 1) if batches else None}


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of processes (all their threads) from /proc; gone ones count 0."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """CPU use of some processes over the window, in % of one core (1600 = 16 cores busy)."""

    def __init__(self, key: str, pids: Callable[[], Iterable[int]]) -> None:
        self.key, self.pids_of = key, pids
        self.pids: set[int] = set()
        self.t, self.c = 0.0, 0.0

    def start(self) -> None:
        self.pids = set(self.pids_of())
        self.t, self.c = time.monotonic(), cpu_seconds(self.pids)

    def stop(self) -> dict[str, Any]:
        return {self.key: round(100 * (cpu_seconds(self.pids) - self.c) / max(time.monotonic() - self.t, 1e-9))}
