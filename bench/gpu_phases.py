"""bench.gpu_check's phases: the album and the reference, model level, JPEG decode, one server run, the OOM
phase and a bare run. Each appends its results through a callback, so the caller can save after every one."""

from __future__ import annotations

import contextlib
import inspect
import io
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import requests
from PIL import Image

from bench import album, bare, equivalence
from bench.gpu_load import CpuSampler, MetricsSampler, Sampler, load
from bench.gpu_procs import GpuSampler, Hog, apps, gpus
from harness.launch import GunicornServer

if TYPE_CHECKING:
    import torch

    from bench.gpu_plan import Layout
    from service.engine.types import Transform

MAX_PIXELS = bare.MAX_PIXELS
Row = Callable[[dict[str, Any]], None]


def _render(photo: album.Photo) -> bytes:  # a pool process's job (module level: picklable)
    return album.render(photo)


def ensure_album_fast(directory: Path, *, count: int, max_side: int | None, processes: int) -> bool:
    """``bench.album.ensure_album``, its photos rendered in ``processes`` processes when it has to render
    them (same bytes, same cache); True when it did."""
    spec = album.album_spec(count, max_side=max_side)
    rendered: dict[str, bytes] = {}
    original = album.render

    def render(photo: album.Photo) -> bytes:
        if not rendered:
            with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
                rendered.update(zip((p.name for p in spec), pool.map(_render, spec), strict=True))
        return rendered[photo.name]

    setattr(album, "render", render)  # noqa: B010 - ensure_album calls the module's render
    try:
        album.ensure_album(directory, count=count, max_side=max_side)
    finally:
        setattr(album, "render", original)  # noqa: B010
    return bool(rendered)


def crops(blobs: list[bytes], transform: Transform, threads: int) -> np.ndarray:
    """The album as the server's Pillow path sees it: decode_and_crop in ``threads`` threads."""
    from service.pipeline.decode import configure_pillow
    from service.pipeline.orchestrate import decode_and_crop

    configure_pillow(MAX_PIXELS)
    with ThreadPoolExecutor(threads) as pool:
        return np.stack(list(pool.map(lambda b: decode_and_crop(b, transform, MAX_PIXELS), blobs)))


def cpu_reference(model: str, weights: Path, pixels: np.ndarray) -> np.ndarray:
    """L2-normalised float32 CPU embeddings of ``pixels``: what every server run is checked against."""
    import torch

    from service.engine.loading import load_model

    feats = load_model(model, str(weights), device=torch.device("cpu")).forward(pixels)[0]
    assert feats is not None
    emb = feats.numpy()
    return emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)


def model_level(model: str, weights: Path, pixels: np.ndarray, on_row: Row) -> None:
    """``model`` on cuda:0 in float32, then bfloat16 and float16 each by autocast and cast once: images/s for
    a ``len(pixels)`` batch (pinned host memory, non-blocking copy, results copied back) and cosine to CPU
    float32 (the choices ``GREENSERVE_DTYPE=auto`` tries: bf16 on sm >= 8, fp16 on sm 7.x)."""
    import torch

    from service.engine.casting import FLOAT32, Numerics
    from service.engine.loading import load_model

    reference = load_model(model, str(weights), device=torch.device("cpu")).forward(pixels[:8])[0]
    ways = [FLOAT32] + [Numerics(d, cast=c) for d in (torch.bfloat16, torch.float16) for c in (False, True)]
    for numerics in ways:
        m = load_model(model, str(weights), device=torch.device("cuda:0"), numerics=numerics)
        for _ in range(3):
            m.forward(pixels)
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            m.forward(pixels)  # returns CPU tensors: includes the copy back and a sync
        seconds = (time.perf_counter() - t0) / reps
        feats = m.forward(pixels[:8])[0]
        assert feats is not None and reference is not None
        cos = torch.nn.functional.cosine_similarity(feats, reference)
        on_row({"dtype": numerics.name, "batch": len(pixels), "images_per_s": round(len(pixels) / seconds, 1),
                "ms_per_batch": round(seconds * 1000, 2), "cosine_vs_cpu_fp32_min": round(float(cos.min()), 6)})
        del m
        torch.cuda.empty_cache()


def _timed(method: str, blobs: list[bytes], megapixels: float, reps: int, fn: Callable[[], object]) -> dict[str, Any]:
    import torch

    fn()  # warm-up: first-call allocations, nvJPEG handles
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        fn()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    n = len(blobs) * reps
    return {"method": method, "images": len(blobs), "images_per_s": round(n / wall, 1),
            "megapixels_per_s": round(megapixels * reps / wall), "cpu_ms_per_image": round(1000 * cpu / n, 2),
            "gpu_peak_mib": round((torch.cuda.max_memory_allocated() - base) / 2**20)}


def decode_bench(blobs: list[bytes], transform: Transform, threads: int, on_row: Row, reps: int = 3) -> None:
    """The album's JPEGs decoded alone: Pillow decode_and_crop in ``threads`` threads (the server's CPU
    path) vs nvJPEG batch decode on cuda:0, alone and as the server's device path (+ upright, resize, crop)."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from service.pipeline.decode import configure_pillow
    from service.pipeline.orchestrate import decode_and_crop

    megapixels, orientations = 0.0, []
    for b in blobs:
        with Image.open(io.BytesIO(b)) as img:
            megapixels += img.width * img.height / 1e6
            orientations.append(int(img.getexif().get(0x0112, 1)))
    configure_pillow(MAX_PIXELS)
    with ThreadPoolExecutor(threads) as pool:
        on_row(_timed(f"Pillow decode_and_crop, {threads} threads", blobs, megapixels, reps,
                      lambda: list(pool.map(lambda b: decode_and_crop(b, transform, MAX_PIXELS), blobs))))
    datas = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]

    def nvjpeg() -> list[torch.Tensor]:
        out = decode_jpeg(datas, mode=ImageReadMode.RGB, device="cuda")
        torch.cuda.synchronize()
        return out

    on_row(_timed("nvJPEG batch decode (cuda)", blobs, megapixels, reps, nvjpeg))
    from service.engine import device_decode  # the server's own device path: nvJPEG + upright + resize + crop

    jpegs = [device_decode.EncodedJpeg(np.frombuffer(b, dtype=np.uint8).copy(), o)
             for b, o in zip(blobs, orientations, strict=True)]

    def crops_synced() -> None:
        device_decode.crops(jpegs, transform, torch.device("cuda"))
        torch.cuda.synchronize()

    on_row(_timed("greenserve device_decode.crops (cuda)", blobs, megapixels, reps, crops_synced))
    torch.cuda.empty_cache()


@dataclass
class Rig:
    """What every server run shares: the model, the album on its image hosts, the load's shape."""

    model: str
    weights: Path
    album_dir: Path
    base_url: str
    host_pids: list[int]
    names: list[str]
    reference: np.ndarray | None
    clients: int
    warm_s: float
    load_s: float
    ready_timeout: Callable[[], float]
    live: list[Any] = field(default_factory=list)  # what is running now (the watchdog stops it)


def server_env(rig: Rig, layout: Layout) -> dict[str, str]:
    env = {"GREENSERVE_MODEL": rig.model, "GREENSERVE_WEIGHTS": str(rig.weights), "GREENSERVE_DEVICE": layout.device,
           "GREENSERVE_IMAGE_BASE_URL": rig.base_url, "GREENSERVE_DECODE_THREADS": str(layout.decode),
           "GREENSERVE_LOG_LEVEL": "info",  # launch waits for the "model ready" lines
           # a saturating closed load: 16 clients x 30 images fit one worker's queue, nothing times out
           "GREENSERVE_MAX_QUEUE_IMAGES": "1024", "GREENSERVE_REQUEST_TIMEOUT_S": "60"}
    if layout.device == "cuda":
        env["GREENSERVE_MAX_BATCH"] = "64"
    if layout.dtype:
        env["GREENSERVE_DTYPE"] = layout.dtype
    if layout.jpeg:
        env["GREENSERVE_JPEG_DECODE"] = layout.jpeg
    return env


@contextlib.contextmanager
def serving(rig: Rig, layout: Layout) -> Iterator[GunicornServer]:
    srv = GunicornServer(server_env(rig, layout), workers=int(layout.workers), ready_timeout_s=rig.ready_timeout())
    rig.live.append(srv)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop(timeout=15)
        rig.live.remove(srv)


def model_facts(url: str, workers: int) -> dict[str, Any]:
    """What the workers chose (GET /v1/models over fresh connections, spread over the workers)."""
    seen: dict[str, set[str]] = {"device": set(), "dtype": set(), "jpeg_decode": set()}
    precision = None
    for _ in range(2 * workers + 2):
        d = requests.get(url + "/v1/models", timeout=30).json()["data"][0]
        for key, values in seen.items():
            values.add(str(d.get(key, "-")))
        precision = d.get("precision", precision)
    return {"device_chosen": ",".join(sorted(seen["device"])), "dtype_chosen": ",".join(sorted(seen["dtype"])),
            "jpeg_decode": ",".join(sorted(seen["jpeg_decode"])), "precision": precision}


def gpu_placement(srv: GunicornServer) -> dict[str, Any]:
    assert srv.proc is not None
    on_gpu, workers = apps(), srv.worker_pids()
    mib = [m for p, m in on_gpu.items() if p in workers and m is not None]
    return {"master_holds_cuda": srv.proc.pid in on_gpu, "workers_on_gpu": len(workers & on_gpu.keys()),
            "worker_gpu_mib_max": max(mib, default=None)}


def check_embeddings(url: str, names: list[str], reference: np.ndarray) -> dict[str, Any]:
    r = requests.post(url + "/v1/embeddings", json={"images": names}, timeout=120)
    r.raise_for_status()
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    return equivalence.compare(np.asarray([d["embedding"] for d in data], dtype=np.float32), reference).to_dict()


def _samplers(rig: Rig, srv: GunicornServer, gpu: bool) -> list[Sampler]:
    assert srv.proc is not None
    master = srv.proc.pid
    out: list[Sampler] = [MetricsSampler(srv.url), CpuSampler("server_cpu_pct", lambda: srv.worker_pids() | {master}),
                          CpuSampler("imagehost_cpu_pct", lambda: rig.host_pids),
                          CpuSampler("client_cpu_pct", lambda: [os.getpid()])]
    return out + [GpuSampler()] if gpu else out


def server_run(rig: Rig, layout: Layout, *, check: bool = False) -> dict[str, Any]:
    """One layout under a saturating closed load: start, what it chose, (embeddings), throughput, health."""
    row: dict[str, Any] = {"label": layout.label, "device": layout.device, "workers": layout.workers,
                           "decode_threads": layout.decode or "default", "dtype": layout.dtype or "default",
                           "jpeg": layout.jpeg or "default", "clients": rig.clients}
    t0 = time.monotonic()
    with serving(rig, layout) as srv:
        row["start_s"] = round(time.monotonic() - t0, 1)
        row.update(model_facts(srv.url, int(layout.workers)))
        if layout.device == "cuda":
            row.update(gpu_placement(srv))
        if check and rig.reference is not None:
            row["check"] = check_embeddings(srv.url, rig.names, rig.reference)
        row.update(load(srv.url, rig.names, clients=rig.clients, warm_s=rig.warm_s, measure_s=rig.load_s,
                        samplers=_samplers(rig, srv, layout.device == "cuda")))
    return row


def _stage(rig: Rig, srv: GunicornServer, name: str, worker: int, clients: int, seconds: float) -> dict[str, Any]:
    r = load(srv.url, rig.names, clients=clients, warm_s=0, measure_s=seconds, samplers=[GpuSampler()],
             timeout_s=30, drain=True)
    gpu = (gpus() or [{}])[0]
    free = gpu.get("memory_total_mib", 0) - gpu.get("memory_used_mib", 0) if gpu.get("memory_total_mib") else None
    return {"stage": name, **r, "worker_mib": apps().get(worker), "gpu_free_mib": free}


def _used() -> int | None:
    """GPU 0's memory used, all processes (nvidia-smi in a container may list none of them)."""
    return (gpus() or [{}])[0].get("memory_used_mib")


def oom_phase(rig: Rig, layout: Layout, margin_mib: int, out: dict[str, Any], save: Callable[[], None]) -> None:
    """One worker; its GPU memory after warm-up; a hog leaves ``margin_mib``, then nothing; album requests
    under each; the hog gone, requests again (must be 200) and the worker's memory (back near baseline?)."""
    hog = Hog()  # imports torch and makes its CUDA context while the server starts
    rig.live.append(hog)
    try:
        with serving(rig, layout) as srv:
            out.update(model_facts(srv.url, 1))
            worker = min(srv.worker_pids())
            out.update(worker_pid=worker, baseline_mib=apps().get(worker), gpu_used_baseline_mib=_used(), stages=[])
            first = requests.post(srv.url + "/v1/embeddings", json={"images": rig.names}, timeout=120)
            out.update(first_album_status=first.status_code, after_one_album_mib=apps().get(worker))
            save()
            hog.ready()
            out["hog_full_mib"] = hog.command("fill")
            out["hog_mib"] = hog.command(f"free {margin_mib}")
            out["stages"].append(_stage(rig, srv, f"hog leaves ~{margin_mib} MiB", worker, 4, 6))
            save()
            out["hog_full_again_mib"] = hog.command("fill")
            out["stages"].append(_stage(rig, srv, "hog takes all", worker, 4, 4))
            save()
            hog.stop()
            time.sleep(1)
            after = _stage(rig, srv, "hog gone", worker, 2, 4)
            out["stages"].append(after)
            out.update(after_mib=apps().get(worker), gpu_used_after_mib=_used(), same_worker=worker in srv.worker_pids(),
                       after_all_200=bool(after["requests"]) and set(after["statuses"]) == {"200"})
            if isinstance(out["after_mib"], int) and isinstance(out["baseline_mib"], int):
                out["after_minus_baseline_mib"] = out["after_mib"] - out["baseline_mib"]
    finally:
        hog.stop()
        rig.live.remove(hog)


def bare_run(rig: Rig, layout: Layout) -> dict[str, Any]:
    """The bare pipeline (bench.bare) in ``workers`` processes x ``threads`` torch threads: the yardstick."""
    kwargs: dict[str, Any] = {}
    if layout.dtype not in (None, "float32"):
        if "dtype" not in inspect.signature(bare.measure).parameters:
            raise ValueError(f"bench.bare.measure takes no dtype: {layout.label} cannot run")
        kwargs["dtype"] = layout.dtype
    r = bare.measure(rig.model, rig.weights, rig.album_dir, processes=int(layout.workers), threads=layout.threads,
                     reps=1, **kwargs)
    return {"label": layout.label, **r}
