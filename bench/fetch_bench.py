"""Benchmark the fetch stage of a real 1-worker ``gunicorn -k gevent`` greenserve (resnet18, random weights).

    1. latency   one request of 30 image URLs from a host that answers after 0/50/200 ms; reports the
                 request's ``timings_ms.fetch`` (median of --reps) next to a bare baseline measured in the
                 same run: the same 30 URLs fetched one after another with a plain requests.Session
    2. busy      requests of 30 URLs at 50 ms while another client keeps the worker's model busy with
                 32-image batches, against the same requests with the model idle: fetch stage, images
                 fetched per second, request latency and /healthz latency, as ratios from the same run

``python -m bench.fetch_bench [--reps 3] [--busy-requests 4]`` — about a minute and a half on 2 vCPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from harness import images
from harness.imagehost import ImageHost
from harness.launch import GunicornServer

URLS_PER_REQUEST = 30
LATENCIES_MS = (0, 50, 200)
CONCURRENCIES = (16, 32)  # the default, and enough for 30 URLs to go out in one wave
BUSY_LATENCY_MS = 50
BUSY_BATCH = 32
PHOTOS = {f"img{i:03d}.jpg": images.jpeg(800 + 40 * i, 600, seed=i) for i in range(8)}


def machine() -> str:
    import torch

    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass  # not Linux, or a CPU without a model name: the core count still says the essential
    return (f"{len(os.sched_getaffinity(0))} cores ({cpu}), torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def save_weights(directory: str) -> str:
    import torch
    import torchvision

    torch.manual_seed(0)
    path = os.path.join(directory, "resnet18.pt")
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    return path


def urls(host: ImageHost, latency_ms: int, tag: str) -> list[str]:
    """30 distinct URLs (distinct query strings, so nothing is deduplicated) over the 8 photos."""
    return [host.url(f"img{i % 8:03d}.jpg", delay=latency_ms / 1000, r=tag, n=i) for i in range(URLS_PER_REQUEST)]


def post(server: GunicornServer, images_: list[str]) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    resp = requests.post(server.url + "/v1/embeddings", json={"images": images_}, timeout=120)
    elapsed = time.monotonic() - started
    resp.raise_for_status()
    return resp.json(), elapsed


def sequential(image_urls: list[str]) -> float:
    """The bare baseline: one URL after another on one keep-alive session."""
    with requests.Session() as s:
        started = time.monotonic()
        for url in image_urls:
            s.get(url, timeout=30).raise_for_status()
        return time.monotonic() - started


def fetch_stages(server: GunicornServer, host: ImageHost, reps: int) -> dict[int, float]:
    """Median ``timings_ms.fetch`` per host latency."""
    post(server, urls(host, 0, "warm"))  # the first request pays for lazy imports and pools
    return {latency: statistics.median(post(server, urls(host, latency, f"l{latency}-{k}"))[0]["timings_ms"]["fetch"]
                                       for k in range(reps)) for latency in LATENCIES_MS}


def latency_table(stages: dict[int, dict[int, float]], base: dict[int, float]) -> list[str]:
    """Rows per host latency; columns per GREENSERVE_FETCH_CONCURRENCY, as ms and as ratios."""
    head = "| host latency | sequential baseline |"
    for c in stages:
        head += f" fetch stage, concurrency {c} | / sequential | / latency |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for latency in LATENCIES_MS:
        row = f"| {latency} ms | {base[latency]:.0f} ms |"
        for by_latency in stages.values():
            fetch = by_latency[latency]
            per_latency = f"{fetch / latency:.2f}" if latency else "-"
            row += f" {fetch:.0f} ms | {fetch / base[latency]:.2f} | {per_latency} |"
        rows.append(row)
    return rows


class BusyModel:
    """Keeps the worker's model busy: 32-image requests back to back from another thread."""

    def __init__(self, server: GunicornServer, host: ImageHost) -> None:
        self.server, self.host = server, host
        self.stop = threading.Event()
        self.batches = 0
        self.thread = threading.Thread(target=self._loop, name="busy", daemon=True)

    def _loop(self) -> None:
        k = 0
        while not self.stop.is_set():
            batch = [self.host.url(f"img{i % 8:03d}.jpg", busy=k, n=i) for i in range(BUSY_BATCH)]
            post(self.server, batch)
            self.batches += 1
            k += 1

    def __enter__(self) -> BusyModel:
        self.thread.start()
        time.sleep(1.0)  # let the first batch reach the model
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


def measure(server: GunicornServer, host: ImageHost, n: int, tag: str) -> dict[str, float]:
    fetch, total, health = [], [], []
    for k in range(n):
        body, elapsed = post(server, urls(host, BUSY_LATENCY_MS, f"{tag}{k}"))
        fetch.append(body["timings_ms"]["fetch"])
        total.append(elapsed * 1000)
        started = time.monotonic()
        requests.get(server.url + "/healthz", timeout=30).raise_for_status()
        health.append((time.monotonic() - started) * 1000)
    fetch_ms = statistics.median(fetch)
    return {"fetch": fetch_ms, "rate": URLS_PER_REQUEST / (fetch_ms / 1000), "total": statistics.median(total),
            "healthz": statistics.median(health)}


def busy_table(server: GunicornServer, host: ImageHost, n: int) -> list[str]:
    idle = measure(server, host, n, "idle")
    with BusyModel(server, host) as busy:
        loaded = measure(server, host, n, "busy")
    rows = [f"| 30 URLs at {BUSY_LATENCY_MS} ms, median of {n} | model idle | model busy | busy / idle |",
            "|---|---|---|---|"]
    for key, label, unit in (("fetch", "fetch stage", "ms"), ("rate", "images fetched per second", "/s"),
                             ("total", "request latency", "ms"), ("healthz", "/healthz after each", "ms")):
        rows.append(f"| {label} | {idle[key]:.0f} {unit} | {loaded[key]:.0f} {unit} | "
                    f"{loaded[key] / idle[key]:.2f} |")
    rows.append(f"\n(the busy client finished {busy.batches} batches of {BUSY_BATCH} images meanwhile)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="requests per latency (median reported)")
    parser.add_argument("--busy-requests", type=int, default=4, help="requests per idle/busy measurement")
    args = parser.parse_args()
    print("command:", " ".join([os.path.basename(sys.executable), "-m", "bench.fetch_bench", *sys.argv[1:]]))
    print("machine:", machine(), flush=True)
    with tempfile.TemporaryDirectory() as tmp, ImageHost(PHOTOS) as host:
        env = {"GREENSERVE_MODEL": "resnet18", "GREENSERVE_WEIGHTS": save_weights(tmp),
               "GREENSERVE_IMAGE_BASE_URL": host.base_url, "GREENSERVE_MAX_BATCH": str(BUSY_BATCH)}
        base = {latency: sequential(urls(host, latency, "seq")) * 1000 for latency in LATENCIES_MS}
        stages = {}
        for concurrency in CONCURRENCIES:
            with GunicornServer({**env, "GREENSERVE_FETCH_CONCURRENCY": str(concurrency)}, cache="off", workers=1) as server:
                stages[concurrency] = fetch_stages(server, host, args.reps)
                if concurrency == CONCURRENCIES[0]:
                    busy = busy_table(server, host, args.busy_requests)
        print(f"\n## fetch stage, 1 worker, {URLS_PER_REQUEST} URLs per request (median of {args.reps})\n")
        print("\n".join(latency_table(stages, base)))
        print(f"\n## fetching while the model is busy, 1 worker, concurrency {CONCURRENCIES[0]}\n")
        print("\n".join(busy))


if __name__ == "__main__":
    main()
