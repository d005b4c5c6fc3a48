"""The bare pipeline, no server: the yardstick every design is quoted against, and the reference embeddings.

``python -m bench.bare --model M --weights W --album DIR --threads T --reps R [--out emb.npy]`` loads the
model exactly as every design does (``load_model`` from the same state-dict file, channels_last; ``--dtype
bfloat16`` casts the weights and input to bf16 once, as ``GREENSERVE_DTYPE=bfloat16`` does; ``bfloat16-autocast``
runs the float32 weights under autocast), decodes
the album with greenserve's ``decode_and_crop`` (in T threads: Pillow drops the GIL) and runs it as one
batch, R times after a warm-up. With ``--out`` it saves the L2-normalised embeddings (album order) as float32
``.npy``. It prints "ready" after the warm-up, then for each line on stdin (so the processes of a layout
start together) times R runs and prints one JSON line ``{"images_per_s", "seconds_per_batch"}``; EOF
ends it.

Run as a subprocess, one per process of the layout being measured (``measure()`` does that), so torch
never runs in the comparison harness itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.album import load_album
from harness.launch import ROOT

MAX_PIXELS = 40_000_000  # greenserve's GREENSERVE_MAX_IMAGE_PIXELS default
READY = "ready"
DTYPES = ("float32", "bfloat16", "bfloat16-autocast")  # bfloat16: weights cast once, as GREENSERVE_DTYPE=bfloat16


def slug(model: str) -> str:
    """A model name fit for a file name: open_clip:ViT-B-32 → open_clip-ViT-B-32."""
    return model.replace(":", "-").replace("/", "-")


def save_random_weights(model: str, path: Path, seed: int = 0) -> Path:
    """A seeded random state dict for ``model`` (no downloads here; torchvision or ``open_clip:ARCH``), saved
    once, convnets in channels_last.

    Saved already converted, as ``greenserve export`` does (docs/SIZING.md, Memory), so ``load_model``'s
    channels_last step is a no-op and the mmapped weights stay shared. Every design loads this one file, so
    they serve the same model.
    """
    if path.is_file():
        return path
    import torch
    import torchvision

    from service.engine.loading import parse_model_name

    family, arch = parse_model_name(model)
    torch.manual_seed(seed)
    if family == "open_clip":  # a ViT has no channels_last to save in
        import open_clip

        net = open_clip.create_model(arch, pretrained=None).eval()
    else:
        net = torchvision.models.get_model(arch, weights=None).eval().to(memory_format=torch.channels_last)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(net.state_dict(), tmp)
    tmp.replace(path)
    return path


def measure(model: str, weights: Path, album: Path, *, processes: int, threads: int, reps: int,
            out: Path | None = None, dtype: str = "float32") -> dict[str, float]:
    """Bare throughput of ``processes`` × ``threads`` running at once; ``out`` gets process 0's embeddings."""
    procs = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "bench.bare", "--model", model, "--weights", str(weights), "--album",
               str(album), "--threads", str(threads), "--reps", str(reps), *_dtype_args(dtype)]
        if out is not None and i == 0:
            cmd += ["--out", str(out)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    # every process loads and warms up, then all start timing together: the layout is measured at once
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != READY:
            _, stderr = p.communicate(timeout=60)
            raise RuntimeError(f"bench.bare did not get ready ({p.returncode}):\n{stderr[-3000:]}")
    results = []
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"bench.bare failed ({p.returncode}):\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return {"processes": processes, "threads": threads,
            "images_per_s": round(sum(r["images_per_s"] for r in results), 2),
            "seconds_per_batch": round(max(r["seconds_per_batch"] for r in results), 3)}


def numerics_of(dtype: str) -> Any:
    """A ``DTYPES`` name as the engine's ``Numerics``."""
    import torch

    from service.engine.casting import Numerics

    name, _, how = dtype.partition("-")
    return Numerics(getattr(torch, name), cast=how != "autocast" and name != "float32")


def _dtype_args(dtype: str) -> list[str]:
    """The child's ``--dtype``, left out for float32 so the default command line stays what it was."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return [] if dtype == "float32" else ["--dtype", dtype]


def _run(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from service.engine.loading import load_model
    from service.pipeline.decode import configure_pillow
    from service.pipeline.prepare import decode_and_crop

    torch.set_num_threads(args.threads)
    configure_pillow(MAX_PIXELS)
    model = load_model(args.model, str(args.weights), channels_last=True, numerics=numerics_of(args.dtype))
    model.warm_up()
    blobs = list(load_album(args.album).values())
    t = model.info.transform
    with ThreadPoolExecutor(args.threads) as pool:
        def once() -> np.ndarray:
            crops = list(pool.map(lambda b: decode_and_crop(b, t, MAX_PIXELS), blobs))
            feats, _ = model.forward(np.stack(crops))
            assert feats is not None
            return feats.numpy()

        feats = once()  # warm-up with the real batch shape (first-call allocations)
        if args.out:
            norms = np.maximum(np.linalg.norm(feats, axis=1, keepdims=True), 1e-12)
            np.save(args.out, (feats / norms).astype(np.float32))
        print(READY, flush=True)
        # each line is a go signal (sibling processes of a layout start timing together); EOF ends
        for _ in sys.stdin:
            started = time.perf_counter()
            for _ in range(args.reps):
                once()
            elapsed = (time.perf_counter() - started) / args.reps
            print(json.dumps({"images_per_s": round(len(blobs) / elapsed, 2),
                              "seconds_per_batch": round(elapsed, 4)}), flush=True)


class BareProcess:
    """One bare process kept warm, timed on demand: ``with BareProcess(...) as b: b.seconds_per_batch()``,
    so a benchmark can alternate bare and server measurements instead of taking them minutes apart."""

    def __init__(self, model: str, weights: Path, album: Path, *, threads: int, reps: int,
                 dtype: str = "float32") -> None:
        self.cmd = [sys.executable, "-m", "bench.bare", "--model", model, "--weights", str(weights), "--album",
                    str(album), "--threads", str(threads), "--reps", str(reps), *_dtype_args(dtype)]
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> BareProcess:
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != READY:
            _, stderr = self.proc.communicate(timeout=60)
            raise RuntimeError(f"bench.bare did not get ready ({self.proc.returncode}):\n{stderr[-3000:]}")
        return self

    def seconds_per_batch(self) -> float:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["seconds_per_batch"]

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.communicate(timeout=60)  # closes stdin: the process ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--album", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the forward's numerics: float32, bfloat16 (weights cast once), bfloat16-autocast")
    _run(parser.parse_args())


if __name__ == "__main__":
    main()
