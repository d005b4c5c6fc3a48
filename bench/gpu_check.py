"""The GPU path, checked on a machine with CUDA: one prepared run (``python -m bench.gpu_check --out DIR``).

1. model level, in this process: resnet50 on ``cuda:0`` in float32 / bfloat16 / float16 autocast, images/s
   for a 64-image batch (pinned host memory, non-blocking copy) and embedding cosine against float32 on
   the CPU for the same pixels;
2. server level: real ``gunicorn -k gevent`` greenserve with ``GREENSERVE_DEVICE=auto``, 1 and 2 workers:
   which device each worker chose, that the gunicorn master holds no CUDA context (nvidia-smi), the
   embeddings of an album against the CPU reference, and throughput + /healthz latency under a closed
   load of 4 clients sending 30-image album requests.

Writes ``gpu.json`` into ``--out`` and prints a table. Everything is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests

from bench.album import ensure_album, load_album
from harness.imagehost import ImageHost
from harness.launch import GunicornServer

MODEL = "resnet50"
LOAD_SECONDS = 15.0
CLIENTS = 4


def model_level(weights: Path, pixels: np.ndarray) -> list[dict[str, Any]]:
    import torch

    from service.engine.model import load_model

    reference = load_model(MODEL, str(weights), device=torch.device("cpu")).forward(pixels[:8])[0]
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        m = load_model(MODEL, str(weights), device=torch.device("cuda:0"), dtype=dtype)
        for _ in range(3):
            m.forward(pixels)
        t0 = time.perf_counter()
        reps = 10
        for _ in range(reps):
            m.forward(pixels)  # returns CPU tensors: includes the copy back and a sync
        seconds = (time.perf_counter() - t0) / reps
        cos = torch.nn.functional.cosine_similarity(m.forward(pixels[:8])[0], reference)
        rows.append({"dtype": str(dtype).replace("torch.", ""), "batch": len(pixels),
                     "images_per_s": round(len(pixels) / seconds, 1), "ms_per_batch": round(seconds * 1000, 2),
                     "cosine_vs_cpu_fp32_min": round(float(cos.min()), 6)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def gpu_pids() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    return {int(p) for p in out.split() if p.strip().isdigit()}


def server_level(weights: Path, host: ImageHost, names: list[str], reference: np.ndarray, workers: int,
                 dtype: str, decode_threads: int = 0, clients: int = CLIENTS) -> dict[str, Any]:
    env = {"GREENSERVE_MODEL": MODEL, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_DEVICE": "auto",
           "GREENSERVE_DTYPE": dtype, "GREENSERVE_DECODE_THREADS": str(decode_threads),
           "GREENSERVE_IMAGE_BASE_URL": host.base_url, "GREENSERVE_MAX_BATCH": "64",
           "GREENSERVE_LOG_LEVEL": "info"}  # launch waits for the "model ready" lines
    with GunicornServer(env, workers=workers, ready_timeout_s=240) as srv:
        devices = set()
        for _ in range(10 * workers):
            devices.add(requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["device"])
        on_gpu = gpu_pids()
        master_on_gpu = srv.proc.pid in on_gpu  # type: ignore[union-attr]
        workers_on_gpu = len(srv.worker_pids() & on_gpu)
        body = requests.post(srv.url + "/v1/embeddings", json={"images": names}, timeout=120).json()
        got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
        cosine = float((got * reference).sum(axis=1).min())
        latencies: list[float] = []
        health: list[float] = []
        stop = time.monotonic() + LOAD_SECONDS

        def client() -> None:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                r = requests.post(srv.url + "/v1/embeddings", json={"images": names}, timeout=120)
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)

        def probe() -> None:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                requests.get(srv.url + "/healthz", timeout=10)
                health.append(time.perf_counter() - t0)
                time.sleep(0.05)

        threads = [threading.Thread(target=client) for _ in range(clients)] + [threading.Thread(target=probe)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    health.sort()
    return {"workers": workers, "clients": clients, "decode_threads": decode_threads or "default", "dtype": dtype,
            "devices": sorted(devices), "master_holds_cuda": master_on_gpu,
            "workers_on_gpu": workers_on_gpu, "album_cosine_vs_cpu_min": round(cosine, 6),
            "requests": len(latencies), "images_per_s": round(len(latencies) * len(names) / wall, 1),
            "mean_latency_s": round(statistics.mean(latencies), 3) if latencies else None,
            "healthz_p50_ms": round(health[len(health) // 2] * 1000, 1),
            "healthz_p99_ms": round(health[int(len(health) * 0.99)] * 1000, 1)}


def main(argv: list[str] | None = None) -> int:
    import torch

    from service.engine.model import load_model
    from service.pipeline.orchestrate import decode_and_crop

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-model-level", action="store_true")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--layouts", nargs="+", default=["1:0:float32", "2:0:float32", "2:0:bfloat16"],
                        help="server runs as WORKERS:DECODE_THREADS:DTYPE (0 = the default decode threads)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
             "gpus": torch.cuda.device_count()}
    print(json.dumps(facts), flush=True)
    weights = args.out / "resnet50.pt"
    torch.manual_seed(0)
    import torchvision

    torch.save(torchvision.models.resnet50(weights=None).state_dict(), weights)
    album = load_album(ensure_album(Path("bench/out/album-gpu"), count=30, max_side=2048))
    names = list(album)
    transform = load_model(MODEL, str(weights)).info.transform
    pixels = np.stack([decode_and_crop(album[n], transform, 40_000_000) for n in names])
    batch = np.concatenate([pixels, pixels, pixels[:4]])  # 64 images
    doc: dict[str, Any] = {"facts": facts, "model_level": [] if args.skip_model_level else model_level(weights, batch)}
    cpu = load_model(MODEL, str(weights), device=torch.device("cpu")).forward(pixels)[0].numpy()
    reference = cpu / np.linalg.norm(cpu, axis=1, keepdims=True)
    doc["server_level"] = []
    with ImageHost(album) as host:
        for layout in args.layouts:
            workers, decode, dtype = layout.split(":")
            doc["server_level"].append(server_level(weights, host, names, reference, int(workers), dtype, int(decode),
                                                    args.clients))
            print(json.dumps(doc["server_level"][-1]), flush=True)
            (args.out / "gpu.json").write_text(json.dumps(doc, indent=1))
    weights.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
