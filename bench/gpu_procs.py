"""The processes around a bench.gpu_check server, and nvidia-smi: the image hosts, the GPU memory hog, GPU
memory and utilisation (parsed from ``--format=csv,noheader,nounits``)."""

from __future__ import annotations

import re
import select
import shutil
import statistics
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.launch import ROOT


def smi(*args: str) -> str:
    """nvidia-smi's output, "" without one (or when it fails)."""
    if not shutil.which("nvidia-smi"):
        return ""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _number(text: str) -> int | float | str | None:
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*(?:MiB|%|W)?\s*", text)
    if m:
        return float(m.group(1)) if "." in m.group(1) else int(m.group(1))
    return None if text.strip().startswith("[") else text.strip()  # [N/A], [Not Supported]


def parse_csv(text: str, fields: Sequence[str]) -> list[dict[str, Any]]:
    """``--format=csv,noheader[,nounits]`` lines → dicts of ``fields`` (numbers as numbers, [N/A] as None)."""
    return [dict(zip(fields, map(_number, line.split(",")), strict=True)) for line in text.splitlines()
            if line.strip() and len(line.split(",")) == len(fields)]


def parse_apps(text: str) -> dict[int, int | None]:
    """``--query-compute-apps=pid,used_memory`` → pid: MiB (None when nvidia-smi cannot tell)."""
    out: dict[int, int | None] = {}
    for row in parse_csv(text, ("pid", "mib")):
        if isinstance(row["pid"], int):
            mib = row["mib"] if isinstance(row["mib"], int) else None
            old = out.get(row["pid"])
            out[row["pid"]] = mib if old is None else old + (mib or 0)  # one line per GPU it uses
    return out


def parse_cuda_version(text: str) -> str | None:
    """The driver's CUDA version from plain ``nvidia-smi``'s banner ("CUDA Version: 13.0")."""
    m = re.search(r"CUDA Version:\s*([\d.]+)", text)
    return m.group(1) if m else None


GPU_FIELDS = ("index", "name", "memory_used_mib", "memory_total_mib", "utilization_pct", "driver")


def gpus() -> list[dict[str, Any]]:
    return parse_csv(smi("--query-gpu=index,name,memory.used,memory.total,utilization.gpu,driver_version",
                         "--format=csv,noheader,nounits"), GPU_FIELDS)


def apps() -> dict[int, int | None]:
    return parse_apps(smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"))


class GpuSampler:
    """GPU 0's utilisation (mean) and memory used (max) over the window, nvidia-smi every 0.5 s."""

    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self.stopped.is_set():
            self.samples += gpus()[:1]
            self.stopped.wait(0.5)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def stop(self) -> dict[str, Any]:
        self.stopped.set()
        if self.thread:
            self.thread.join(20)
        util = [s["utilization_pct"] for s in self.samples if isinstance(s.get("utilization_pct"), int)]
        mem = [s["memory_used_mib"] for s in self.samples if isinstance(s.get("memory_used_mib"), int)]
        return {"gpu_util_pct": round(statistics.mean(util)) if util else None, "gpu_mem_max_mib": max(mem, default=None)}


def readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The child's next stdout line, or RuntimeError when it does not come in time (or the child died)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"{proc.args!r} gave no line in {timeout_s:.0f} s (exit code {proc.poll()})")
    return line.strip()


class Child:
    """A helper process that ends when its stdin closes: ``stop()`` closes it, then kills if need be."""

    def __init__(self, code: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


# Several processes on one port (SO_REUSEPORT: the kernel spreads connections), so Python's http.server
# and its GIL do not cap what the GPU can be fed; each serves the album from memory.
HOST_CODE = """import sys
from pathlib import Path
from bench.album import load_album
from harness import imagehost
imagehost._Server.allow_reuse_port = True
host = imagehost.ImageHost(load_album(Path(sys.argv[1])), port=int(sys.argv[2])).start()
print(host.base_url, flush=True)
sys.stdin.read()
"""


class ImageHosts:
    """``processes`` image hosts of the album on one 127.0.0.1 port: ``with ImageHosts(dir, 4) as h: h.base_url``."""

    def __init__(self, album_dir: Path, processes: int) -> None:
        self.album_dir, self.processes = album_dir, processes
        self.children: list[Child] = []
        self.base_url = ""

    def __enter__(self) -> ImageHosts:
        port = "0"
        for _ in range(self.processes):
            self.children.append(Child(HOST_CODE, str(self.album_dir), port))
            self.base_url = readline(self.children[-1].proc, 60)
            port = self.base_url.rstrip("/").rsplit(":", 1)[1]
        return self

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]

    def __exit__(self, *exc: object) -> None:
        for c in self.children:
            c.stop()


# Takes GPU memory on command: "fill" allocates 1 GiB, then 64 MiB, then 16 MiB chunks until CUDA refuses
# (smaller ones land in PyTorch's 20 MiB blocks); "free N" gives back about N MiB. Answers "held MiB".
HOG_CODE = """import sys, torch
torch.zeros(1, device="cuda")
chunks = []
def fill():
    for size in (1 << 30, 1 << 26, 1 << 24):
        while True:
            try:
                chunks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except RuntimeError:
                break
def free(mib):
    left = mib << 20
    while chunks and left > 0:
        left -= chunks.pop().numel()
print("ready", flush=True)
for line in sys.stdin:
    cmd, *arg = line.split()
    fill() if cmd == "fill" else free(int(arg[0]))
    torch.cuda.empty_cache()
    print("held", sum(c.numel() for c in chunks) >> 20, flush=True)
"""


class Hog(Child):
    """The GPU memory hog of bench.gpu_check's OOM phase (a tiny ``python -c`` process)."""

    def __init__(self) -> None:
        super().__init__(HOG_CODE)

    def ready(self, timeout_s: float = 90) -> None:
        if readline(self.proc, timeout_s) != "ready":
            raise RuntimeError("the GPU hog did not start")

    def command(self, line: str, timeout_s: float = 60) -> int:
        """Send "fill" or "free N"; the MiB the hog holds afterwards."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return int(readline(self.proc, timeout_s).split()[1])
