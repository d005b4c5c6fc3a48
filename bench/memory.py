"""Memory per worker: PSS of 1, 2 and 4 gunicorn workers serving resnet50, weights shared vs private.

``python -m bench.memory [--model resnet50 | open_clip:ViT-B-32] [--workers 1 2 4]``

Three ways to load the same weights:
- ``export``: a checkpoint written by ``greenserve export`` (already channels_last): mapped from the page
  cache, shared by every worker;
- ``plain-cl``: a plain state dict converted to channels_last after loading: a private copy per worker;
- ``plain``: a plain state dict served without channels_last: shared, but the slower layout.

PSS (proportional set size) charges shared pages to each process by share, so the workers' PSS add up
to what they really cost together. Read from /proc/PID/smaps_rollup after each worker has loaded and
warmed up its model and served one request.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
from pathlib import Path

import requests

from bench.report import machine
from harness.launch import GunicornServer

MODES = ("export", "plain-cl", "plain")


def smaps(pid: int) -> dict[str, int]:
    """kB figures from /proc/PID/smaps_rollup."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


def weights_files(model: str, directory: Path) -> dict[str, Path]:
    """A seeded random state dict, and its ``greenserve export`` form (torchvision; an open_clip model has
    no layout to convert, so its plain file is the shared one)."""
    import torch
    import torchvision

    from service.engine.torchvision_family import export_checkpoint

    if model.startswith("open_clip:"):
        from bench.bare import save_random_weights, slug

        return {"plain": save_random_weights(model, directory / f"{slug(model)}-plain.pt")}

    plain = directory / f"{model}-plain.pt"
    exported = directory / f"{model}-export.pt"
    if not plain.exists():
        torch.manual_seed(0)
        torch.save(torchvision.models.get_model(model, weights=None).state_dict(), plain)
    if not exported.exists():
        export_checkpoint(model, str(plain), str(exported))
    return {"export": exported, "plain-cl": plain, "plain": plain}


def measure(model: str, weights: Path, mode: str, workers: int) -> dict[str, object]:
    env = {"GREENSERVE_MODEL": model, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_TORCH_THREADS": "1",
           "GREENSERVE_CHANNELS_LAST": "false" if mode == "plain" else "true",
           "GREENSERVE_LOG_LEVEL": "info"}  # launch waits for the "model ready" lines
    image = "data:image/jpeg;base64," + base64.b64encode(_jpeg()).decode()
    with GunicornServer(env, cache="off", workers=workers, ready_timeout_s=300) as srv:
        served = set()
        for _ in range(20 * workers):
            r = requests.post(srv.url + "/v1/embeddings", json={"images": [image]}, timeout=120)
            served.add(int(r.headers["X-Worker-PID"]))
            if len(served) == workers:
                break
        pids = sorted(srv.worker_pids())
        per = [smaps(pid) for pid in pids]
        master = smaps(srv.proc.pid)  # type: ignore[union-attr]
    mb = lambda kb: round(kb / 1024, 1)  # noqa: E731
    return {"mode": mode, "workers": workers, "pss_per_worker_mb": mb(sum(p["Pss"] for p in per) / len(per)),
            "private_per_worker_mb": mb(sum(p["Private_Clean"] + p["Private_Dirty"] for p in per) / len(per)),
            "shared_file_per_worker_mb": mb(sum(p.get("Pss_File", 0) for p in per) / len(per)),
            "rss_per_worker_mb": mb(sum(p["Rss"] for p in per) / len(per)),
            "pss_total_mb": mb(sum(p["Pss"] for p in per) + master["Pss"])}


def _jpeg() -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def table(rows: list[dict[str, object]]) -> str:
    cols = ["mode", "workers", "pss_per_worker_mb", "private_per_worker_mb", "shared_file_per_worker_mb",
            "rss_per_worker_mb", "pss_total_mb"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=Path("bench/out/memory.json"))
    args = parser.parse_args(argv)
    print("$ python -m bench.memory " + " ".join(argv if argv is not None else sys.argv[1:]))
    info = machine(args.model, len(os.sched_getaffinity(0)))
    print(f"{info['cores']} cores ({info['cpu']}), torch {info['torch']}, model {args.model}", flush=True)
    directory = Path(tempfile.gettempdir()) / "greenserve-memory-bench"
    directory.mkdir(exist_ok=True)
    files = weights_files(args.model, directory)
    print(f"weights file: {files['plain'].stat().st_size / 2**20:.1f} MB", flush=True)
    rows = []
    for workers in args.workers:
        for mode in (m for m in MODES if m in files):
            rows.append(measure(args.model, files[mode], mode, workers))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
