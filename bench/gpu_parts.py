"""bench.gpu_check's machinery, none of it importing torch: nvidia-smi parsed and sampled, the server, window
samplers of its /metrics (a closed loop of 30-image requests ends in bursts: the clients' count in a short window is
coarse) and of processes' CPU, the album load (harness.load) with a /healthz prober and the window's summary,
Markdown tables, the image host processes and the GPU memory hog (a child with its own torch)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import requests

from harness.launch import GunicornServer
from harness.load import Done, Load, load_summary
from harness.stats import percentile

GPU_FIELDS = ("index", "name", "memory_used_mib", "memory_total_mib", "utilization_pct", "driver")


def smi(*args: str) -> str:
    """nvidia-smi's output, "" without one (or when it fails)."""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _number(text: str) -> int | float | str | None:
    if m := re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*(?:MiB|%|W)?\s*", text):
        return float(m[1]) if "." in m[1] else int(m[1])
    return None if text.strip().startswith("[") else text.strip()  # [N/A], [Not Supported]


def parse_csv(text: str, fields: Sequence[str]) -> list[dict[str, Any]]:
    """``--format=csv,noheader[,nounits]`` lines → dicts of ``fields`` (numbers as numbers, [N/A] as None)."""
    return [dict(zip(fields, map(_number, line.split(",")), strict=True)) for line in text.splitlines()
            if line.strip() and len(line.split(",")) == len(fields)]


def parse_apps(text: str) -> dict[int, int | None]:
    """``--query-compute-apps=pid,used_memory`` → pid: MiB over all its GPUs (None when nvidia-smi cannot tell)."""
    out: dict[int, int | None] = {}
    for row in parse_csv(text, ("pid", "mib")):
        if isinstance(pid := row["pid"], int):
            mib, old = row["mib"] if isinstance(row["mib"], int) else None, out.get(pid)
            out[pid] = mib if old is None else old + (mib or 0)
    return out


def parse_cuda_version(text: str) -> str | None:
    """The driver's CUDA version from plain ``nvidia-smi``'s banner ("CUDA Version: 13.0")."""
    return m[1] if (m := re.search(r"CUDA Version:\s*([\d.]+)", text)) else None


def gpus() -> list[dict[str, Any]]:
    return parse_csv(smi("--query-gpu=index,name,memory.used,memory.total,utilization.gpu,driver_version",
                         "--format=csv,noheader,nounits"), GPU_FIELDS)


def gpu0() -> dict[str, Any]:
    """GPU 0's row of ``gpus()`` and its free MiB (None without nvidia-smi; in a container it may list no processes)."""
    gpu = (gpus() or [{}])[0]
    used, total = gpu.get("memory_used_mib"), gpu.get("memory_total_mib")
    return {**gpu, "memory_free_mib": total - used if isinstance(used, int) and isinstance(total, int) else None}


def apps() -> dict[int, int | None]:
    return parse_apps(smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"))


class GpuSampler:
    """GPU 0's utilisation (mean) and memory used (max) over the window, nvidia-smi every 0.5 s."""

    def start(self) -> None:
        self.samples: list[dict[str, Any]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        self.samples.append(gpu0())  # one sample at least
        while not self.stopped.wait(0.5):
            self.samples.append(gpu0())

    def stop(self) -> dict[str, Any]:
        self.stopped.set()
        self.thread.join(20)
        util, mem = ([s[k] for s in self.samples if isinstance(s.get(k), int)]
                     for k in ("utilization_pct", "memory_used_mib"))
        return {"gpu_util_pct": round(statistics.mean(util)) if util else None,
                "gpu_mem_max_mib": max(mem, default=None)}


def parse_metric(text: str, name: str) -> float:
    """Sum of a Prometheus text exposition's samples named exactly ``name`` (any labels)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)", text, re.M))


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of processes (all their threads) from /proc; gone ones count 0."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


class Window:
    """Read at the window's start and stop: the images through the model and the mean batch (the server's /metrics,
    all workers), and the CPU of groups of processes in % of one core (1600: 16 busy), ``{key: pids()}``."""

    def __init__(self, url: str, cpu: dict[str, Callable[[], Iterable[int]]]) -> None:
        self.url, self.cpu = url, cpu

    def _read(self) -> list[float]:
        text = requests.get(self.url + "/metrics", timeout=10).text
        return [time.monotonic(), *(parse_metric(text, f"greenserve_{n}") for n in
                                    ("images_total", "batch_size_sum", "batch_size_count"))]

    def start(self) -> None:
        self.pids = {key: set(pids()) for key, pids in self.cpu.items()}
        self.first, self.cpu0 = self._read(), {key: cpu_seconds(p) for key, p in self.pids.items()}

    def stop(self) -> dict[str, Any]:
        cpu = {key: cpu_seconds(p) - self.cpu0[key] for key, p in self.pids.items()}
        t, images, size, batches = (b - a for a, b in zip(self.first, self._read(), strict=True))
        return {"images_per_s": round(images / t, 1), "mean_batch": round(size / batches, 1) if batches else None,
                **{key: round(100 * c / t) for key, c in cpu.items()}}


def summarise(done: Sequence[Done], probes: Sequence[tuple[float, float, bool]], t0: float, t1: float,
              count_until: float | None = None) -> dict[str, Any]:
    """The load's figures over the window [t0, t1] (``load_summary``'s and more), of the requests ending up to
    ``count_until`` (the drain) when given. ``probes``: (start, seconds, answered 200) of each /healthz probe."""
    window = [d for d in done if t0 <= d.ended <= (t1 if count_until is None else count_until)]
    health = sorted(round(s * 1000, 1) for t, s, good in probes if t0 <= t <= t1 and good)  # ms
    served = sum(d.images for d in window if d.status == 200 and d.ended <= t1)
    return {**load_summary(window), "window_s": round(t1 - t0, 2), "served_images_per_s": round(served / (t1 - t0), 1),
            "statuses": dict(sorted(Counter(f"{d.status} {d.code or d.error}".strip() for d in window).items())),
            "retry_after": sorted({d.retry_after for d in window if d.status != 200 and d.retry_after}),
            "healthz_p50_ms": percentile(health, 0.5), "healthz_p99_ms": percentile(health, 0.99),
            "healthz_max_ms": max(health, default=None), "healthz_probes": len(health),
            "healthz_errors": sum(1 for t, _, good in probes if t0 <= t <= t1 and not good)}


def _probe(url: str, stop: threading.Event, out: list[tuple[float, float, bool]]) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            good = requests.get(url + "/healthz", timeout=10).status_code == 200  # a fresh connection each time
        except requests.RequestException:
            good = False
        out.append((t0, time.monotonic() - t0, good))
        stop.wait(max(0.0, 0.05 - (time.monotonic() - t0)))


def load(url: str, names: Sequence[str], *, clients: int, warm_s: float, measure_s: float, timeout_s: float = 90.0,
         cpu: dict[str, Callable[[], Iterable[int]]] | None = None, gpu: bool = False,
         drain: bool = False) -> dict[str, Any]:
    """``clients`` users each posting the album (``names``) back to back, /healthz probed every 50 ms: the figures
    of the ``measure_s`` window after ``warm_s``, with a ``Window`` of ``cpu`` and (``gpu``) a ``GpuSampler`` over it.
    ``drain``: the statuses count the requests that end after the window too."""
    samplers = [*([Window(url, cpu)] if cpu is not None else []), *([GpuSampler()] if gpu else [])]
    stop, probes = threading.Event(), list[tuple[float, float, bool]]()
    threading.Thread(target=_probe, args=(url, stop, probes), daemon=True).start()
    with Load(url, clients, {"images": list(names)}, duration_s=3600, timeout_s=timeout_s) as clients_load:
        time.sleep(warm_s)
        t0 = time.monotonic()
        for s in samplers:
            s.start()
        time.sleep(measure_s)
        extra = {k: v for s in samplers for k, v in s.stop().items()}
        t1 = time.monotonic()
        stop.set()
    return {**summarise(clients_load.done, probes, t0, t1, time.monotonic() if drain else None), **extra}


def model_facts(url: str, workers: int) -> dict[str, str]:
    """What the workers chose: GET /v1/models over fresh connections (the kernel spreads them over the workers)."""
    seen: dict[str, set[str]] = {"device": set(), "dtype": set(), "jpeg_decode": set()}
    for _ in range(2 * workers + 2):
        model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]
        for key, values in seen.items():
            values.add(str(model.get(key, "-")))
    return {key if key == "jpeg_decode" else f"{key}_chosen": ",".join(sorted(v)) for key, v in seen.items()}


def serve(layout: Any, model: str, weights: Path, image_base_url: str, ready_s: float) -> GunicornServer:
    """A gunicorn greenserve (to start) of ``layout`` (``device``, ``workers``, ``dtype``, ``jpeg``: None leaves
    GREENSERVE_JPEG_DECODE unset) on the image hosts; the queue and timeout let a closed load of 16 clients x 30
    images saturate it without a request timing out."""
    env = {"GREENSERVE_MODEL": model, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_DEVICE": layout.device,
           "GREENSERVE_IMAGE_BASE_URL": image_base_url, "GREENSERVE_DTYPE": layout.dtype,
           "GREENSERVE_LOG_LEVEL": "info", "GREENSERVE_MAX_QUEUE_IMAGES": "1024", "GREENSERVE_REQUEST_TIMEOUT_S": "60",
           **({"GREENSERVE_MAX_BATCH": "64"} if layout.device == "cuda" else {}),
           **({"GREENSERVE_JPEG_DECODE": layout.jpeg} if layout.jpeg else {})}
    return GunicornServer(env, cache="off", workers=layout.workers, ready_timeout_s=ready_s)  # it waits for the "ready" lines


def stage(url: str, names: Sequence[str], worker: int, clients: int, seconds: float) -> dict[str, Any]:
    """Album requests for ``seconds`` (the statuses of all, drained), then the worker's and the GPU's memory."""
    r = load(url, names, clients=clients, warm_s=0, measure_s=seconds, timeout_s=30, gpu=True, drain=True)
    return {**r, "worker_mib": apps().get(worker), "gpu_free_mib": gpu0()["memory_free_mib"]}


def embeddings(url: str, names: Sequence[str]) -> np.ndarray:
    """The server's embeddings of the images ``names`` (one request), in their order."""
    r = requests.post(url + "/v1/embeddings", json={"images": list(names)}, timeout=120)
    r.raise_for_status()
    return np.asarray([d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])], dtype=np.float32)


def cell(row: dict[str, Any], key: str) -> str:
    """A table cell: dicts as "k: v, ...", lists joined, missing as "-"; ``check``: its centered cosine, pass/FAIL."""
    value = row.get(key)
    if key == "check" and value:
        value = f"{value['min_centered_cosine']:.5f} {'pass' if value['passed'] else 'FAIL'}"
    value = ", ".join(f"{k}: {v}" for k, v in value.items()) if isinstance(value, dict) else value
    value = ", ".join(map(str, value)) if isinstance(value, list) else value
    return "-" if value is None or value == "" else str(value)


def table(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
    """A Markdown table of ``rows``, their keys ``cols`` the headers."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows])


class Child:
    """A spawned process running ``target(conn, *args)``, to end when its pipe closes (``stop()``)."""

    def __init__(self, target: Callable[..., None], *args: object) -> None:
        self.conn, theirs = multiprocessing.Pipe()
        self.proc = multiprocessing.get_context("spawn").Process(target=target, args=(theirs, *args), daemon=True)
        self.proc.start()
        theirs.close()

    def ask(self, message: object = None, timeout_s: float = 60) -> Any:
        """Send ``message`` (unless None); the child's answer, or RuntimeError when none comes in time."""
        if message is not None:
            self.conn.send(message)
        with contextlib.suppress(EOFError):
            if self.conn.poll(timeout_s):
                return self.conn.recv()
        raise RuntimeError(f"{self.proc.name} gave no answer in {timeout_s:.0f} s (exit code {self.proc.exitcode})")

    def stop(self, timeout: float = 10.0) -> None:
        self.conn.close()
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _host(conn: Connection, album_dir: str, port: int) -> None:
    from bench.album import load_album
    from harness import imagehost

    imagehost._Server.allow_reuse_port = True
    conn.send(imagehost.ImageHost(load_album(Path(album_dir)), port=port).start().base_url)
    with contextlib.suppress(EOFError):
        conn.recv()  # serves until the pipe closes


class ImageHosts:
    """``processes`` image hosts of the album from memory on one 127.0.0.1 port (SO_REUSEPORT: the kernel spreads
    the connections, so no one GIL caps what the GPU is fed): ``with ImageHosts(dir, 4) as hosts: hosts.base_url``."""

    def __init__(self, album_dir: Path, processes: int) -> None:
        self.album_dir, self.processes, self.children, self.base_url = album_dir, processes, list[Child](), ""

    def __enter__(self) -> ImageHosts:
        for _ in range(self.processes):
            port = int(self.base_url.rstrip("/").rsplit(":", 1)[1]) if self.base_url else 0
            self.children.append(Child(_host, str(self.album_dir), port))
            self.base_url = self.children[-1].ask()
        self.pids = [c.proc.pid or 0 for c in self.children]
        return self

    def __exit__(self, *exc: object) -> None:
        for c in self.children:
            c.stop()


def _hog(conn: Connection) -> None:
    """"fill" takes 1 GiB, then 64 MiB, then 16 MiB chunks of GPU memory until CUDA refuses (smaller ones land in
    PyTorch's 20 MiB blocks), "free N" gives about N MiB back; each answers the MiB held."""
    import torch

    torch.zeros(1, device="cuda")
    chunks: list[Any] = []
    conn.send("ready")
    with contextlib.suppress(EOFError):
        while command := conn.recv():
            for size in (1 << 30, 1 << 26, 1 << 24) if command == "fill" else ():
                with contextlib.suppress(RuntimeError):
                    while True:
                        chunks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            left = int(command.split()[1]) << 20 if command.startswith("free") else 0
            while chunks and left > 0:
                left -= chunks.pop().numel()
            torch.cuda.empty_cache()
            conn.send(sum(c.numel() for c in chunks) >> 20)


class Hog(Child):
    """The OOM phase's GPU memory hog: it makes its CUDA context at once, ``ready()`` waits for it."""

    def __init__(self) -> None:
        super().__init__(_hog)

    def ready(self, timeout_s: float = 90) -> None:
        self.ask(timeout_s=timeout_s)  # "ready": its CUDA context is made

    def command(self, line: str, timeout_s: float = 60) -> int:
        """Send "fill" or "free N"; the MiB the hog holds afterwards."""
        return int(self.ask(line, timeout_s))
