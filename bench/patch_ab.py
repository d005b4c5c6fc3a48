"""A hot-path change measured before and after in one session: ``python -m bench.patch_ab CHANGE.patch
[--models open_clip:ViT-B-32=torch,resnet50=auto] [--rounds 2] [--duration 30]``.

The patch is applied to the working tree (``git apply``) for its turns and reverted after each (also on failure),
so "base" is the tree as it is and "patch" the tree with the change. Rounds alternate which goes first. Per round,
variant and model a fresh server as ``bench.runtime_bench`` starts one (a worker per core, ``GREENSERVE_DTYPE=auto``,
``GREENSERVE_RUNTIMES`` as given, with ``GREENSERVE_INT8=allow`` for ``auto+int8``, the cache off) on the seeded
random weights, serving the 30-photo album from the local image host:

    N=5          five albums at once (the seed's shape): images/s and mean seconds
    saturation   k6 open loop at 1.3x that server's N=5 rate for ``--duration`` seconds, with the workers' and
                 the machine's CPU (``runtime_bench.n5_then_saturation``)
    N=1          one album alone: seconds

Prints the command, the machine, every round and the means; writes bench/out/patch-ab.json. Make the patch
with ``git diff > change.patch`` and leave the tree clean (``git stash``) before running.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench import bare, k6, runtime_bench
from bench.album import DEFAULT_DIR, ensure_album, load_album
from bench.compare import OUT_DIR
from bench.report import rows_table, start, write_json
from harness.imagehost import ImageHost
from harness.launch import ROOT


def apply(patch: Path, on: bool) -> None:
    subprocess.run(["git", "apply", *([] if on else ["-R"]), str(patch)], cwd=ROOT, check=True)


def measure(model: str, runtimes: str, base_url: str, names: list[str], duration: float, cores: int) -> dict[str, float]:
    """One fresh server's figures, a worker per core; ``runtimes`` is GREENSERVE_RUNTIMES, ``+int8`` after it
    GREENSERVE_INT8=allow."""
    runtimes, _, int8 = runtimes.partition("+")
    weights = bare.save_random_weights(model, OUT_DIR / "weights" / f"{bare.slug(model)}-seed0.pt")
    variant = {"GREENSERVE_RUNTIMES": runtimes, **({"GREENSERVE_INT8": "allow"} if int8 else {})}
    with tempfile.TemporaryDirectory(prefix="greenserve-ab-") as cache, \
            runtime_bench.server(model, variant, weights, base_url, cores, cache) as srv:
        k6.run_closed(srv.url, names, 2)  # warm: first forwards at these sizes
        n5, sat, cpu = runtime_bench.n5_then_saturation(srv, names, duration)
        n1 = k6.run_closed(srv.url, names, 1)
    return {"n5_img_s": n5.images_per_s, "n5_mean_s": (n5.latency.mean if n5.latency else 0) / 1000,
            "saturation_img_s": sat.images_per_s, "n1_s": (n1.latency.mean if n1.latency else 0) / 1000,
            "errors": n5.errors + sat.errors + n1.errors, **cpu}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patch", type=Path)
    parser.add_argument("--models", default="open_clip:ViT-B-32=torch,resnet50=auto",
                        help="MODEL=GREENSERVE_RUNTIMES pairs, comma-separated; RUNTIMES+int8 adds GREENSERVE_INT8=allow")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=30.0)
    args = parser.parse_args(argv)
    patch = args.patch.resolve()
    info = start("bench.patch_ab", args.models, argv)
    subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, check=True)
    blobs = load_album(ensure_album(DEFAULT_DIR))
    models = [tuple(m.split("=", 1)) for m in args.models.split(",")]
    runs: dict[str, list[dict[str, float]]] = {}
    with ImageHost(blobs) as host:
        for r in range(args.rounds):
            for variant in ("base", "patch") if r % 2 == 0 else ("patch", "base"):
                if variant == "patch":
                    apply(patch, True)
                try:
                    for model, runtimes in models:
                        row = measure(model, runtimes, host.base_url, list(blobs), args.duration, info["cores"])
                        runs.setdefault(f"{model} {runtimes} {variant}", []).append(row)
                        print(f"round {r + 1} {variant:5s} {model} RUNTIMES={runtimes}: "
                              + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
                finally:
                    if variant == "patch":
                        apply(patch, False)
    table: list[dict[str, Any]] = []
    for key, rows in runs.items():
        model, runtimes, variant = key.split(" ")
        means = {k: round(statistics.mean(r[k] for r in rows), 2) for k in rows[0]}
        base = runs[f"{model} {runtimes} base"]
        ratio = means["saturation_img_s"] / statistics.mean(b["saturation_img_s"] for b in base)
        table.append({"model": model, "RUNTIMES": runtimes, "variant": variant, **means,
                      "saturation x base": f"{ratio:.2f}"})
    table.sort(key=lambda t: (t["model"], t["variant"]))
    print(rows_table(table))
    write_json(OUT_DIR / "patch-ab.json", {"machine": info, "patch": patch.read_text(), "cwd": os.getcwd(),
                                           "runs": runs, "table": table})


if __name__ == "__main__":
    main()
