"""The GPU path on one lent machine, in one bounded command: ``python -m bench.gpu_check --out DIR [--budget-s 520]``.

The device machine is bare but for its own python3 (torch, torchvision, numpy, Pillow, requests); nothing can
be installed from a registry there. So, here, ``make gpu-wheels`` (4 MB of wheels into bench/out/gpu-wheels),
then with the ``run`` device tool one call (timeout_s 600, carry ["bench/out/gpu-wheels"]; ~10 of the
session's 15 device minutes):

    python3 -m pip install -q --no-index --find-links bench/out/gpu-wheels flask gunicorn gevent orjson python-json-logger &&
        PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out $OUT/gpu --budget-s 500

It prints the command, the machine and the plan, then runs the steps in priority order; a step starts only
while its time estimate fits the budget left, the others are recorded as skipped. Results go to
DIR/gpu.json (the tables to DIR/gpu.md) after every measurement, a phase's tables are printed after each
phase and all of them at the end, so a run cut short still leaves what it measured (a watchdog prints and
exits at budget + 40 s). Throughput is the server's own images through the model in the window
(/metrics); CPU % of the server, the image hosts and the clients and GPU utilisation show the bottleneck.

 0. setup    command, machine (CPU model, flags, cores, torch; GPU, CUDA, nvidia-smi memory); the 30-photo
             phone album (bench.album, up to 12 MP, the one bench.compare uses; rendered on every core when
             bench/out has no copy), seeded random resnet50 weights (bench.bare), the CPU float32 reference
 1. model    resnet50 on cuda:0, batch 64, float32 / bfloat16 / float16 autocast: images/s; the album's
             JPEG decode alone: nvJPEG batch decode (torchvision.io.decode_jpeg(list, device="cuda")),
             also as the server's device path (+ upright, resize, crop), vs Pillow decode_and_crop in
             one thread per core
 2. server   gunicorn -k gevent greenserve on the GPU, 2 workers, GREENSERVE_DTYPE=auto (the dtype chosen is
             recorded), GREENSERVE_JPEG_DECODE=pillow vs device: images/s under 16 clients sending
             30-photo album requests by URL (local image hosts), /healthz p50/p99, embeddings vs CPU
 3. oom      1 worker, device decode, max batch 64: the worker's GPU memory after warm-up; a hog process
             takes all but a margin of the GPU, then all of it: album requests under each (200, or 503
             out_of_memory + Retry-After), /healthz p99; the hog gone: requests must be 200 again and
             the worker's GPU memory back near its baseline
 4. layouts  workers per GPU 1, 4, 8 (2 is phase 2) with device decode, 2x decode threads and pillow at the
             best; then the CPU alone: the bare pipeline (cores x 1 and 1 x cores, the yardstick) and
             GREENSERVE_DEVICE=cpu with 16, 4, 8, 2 workers, float32 at the best (--layouts to change)

Goals: >= 1,100 phone photos/s with resnet50 on one H200 (274 with CPU decode, 2 workers, before); /healthz
p99 stays low (tens of ms) while saturated; after OOM the worker answers 200 and its GPU memory returns
near its baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench import gpu_plan
from bench.gpu_plan import Layout, Skip, Step, default_layouts, parse_layout, plan_rows, resolve, run_steps, server_estimate_s

PHASES = ("model", "server", "oom", "layouts")
SETUP_ESTIMATE_S = 30.0
GRACE_S = 40.0  # the watchdog's margin past the budget (the run tool stops a command at 600 s)


def _layout_arg(spec: str) -> Layout:
    try:
        return parse_layout(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--out", type=Path, required=True, help="directory for gpu.json")
    p.add_argument("--budget-s", type=float, default=520, help="seconds for everything (default 520)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--layouts", nargs="+", type=_layout_arg, help="phase 4's layouts (see Layout; default "
                   "cuda:4 cuda:8 cuda:1 cuda:best:2x cuda:best:0:auto:pillow bare:Cx1 bare:1xC cpu:C ... cpu:best:0:float32)")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients, each sending album requests")
    p.add_argument("--warm-s", type=float, default=2.0, help="load before the measured window")
    p.add_argument("--load-s", type=float, default=7.0, help="the measured window of every server run")
    p.add_argument("--oom-margin-mib", type=int, default=512, help="GPU memory the hog leaves free at first")
    p.add_argument("--model", default="resnet50", help="smoke runs use a tiny one (mobilenet_v3_small)")
    p.add_argument("--album-count", type=int, default=30)
    p.add_argument("--album-max-side", type=int, help="shrink the album (smoke runs); default: phone sizes")
    p.add_argument("--image-hosts", type=int, help="image host processes on one port (default cores // 4)")
    p.add_argument("--plan-only", action="store_true", help="print the plan and exit (no CUDA needed)")
    p.add_argument("--cores", type=int, help="plan as if the machine had this many cores (default: its own)")
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    if unknown := set(args.phases) - set(PHASES):
        p.error(f"unknown phase(s) {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")
    return args


@dataclass
class Run:
    """One run's state: its arguments, results document and budget; the steps are its methods."""

    args: argparse.Namespace
    cores: int
    budget: gpu_plan.Budget
    doc: dict[str, Any]
    rig: Any = None  # gpu_phases.Rig once set up
    pixels: Any = None
    blobs: list[bytes] = dataclasses.field(default_factory=list)
    transform: Any = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def layouts(self) -> list[Layout]:
        return self.args.layouts or default_layouts(self.cores)

    def save(self) -> None:
        with self.lock:
            path = self.args.out / "gpu.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.doc, indent=1, default=str))
            tmp.replace(path)
            (self.args.out / "gpu.md").write_text(gpu_plan.tables(self.doc) + "\n")  # the tables, as printed

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.doc.setdefault(section, []).append(row)
        print("   " + gpu_plan.one_line(row), flush=True)
        self.save()

    def steps(self) -> list[Step]:
        a, out = self.args, []
        if "model" in a.phases:
            out += [Step("1 model", f"{a.model} cuda:0 batch 64, 3 dtypes", 25, self.model_level),
                    Step("1 model", "JPEG decode: nvJPEG vs Pillow", 15, self.decode)]
        if "server" in a.phases:
            for jpeg in ("pillow", "device"):
                lay = Layout("cuda", 2, 0, "auto", jpeg)
                out.append(Step("2 server", lay.label, server_estimate_s(lay, a.warm_s, a.load_s) + 2,
                                partial(self.server, lay, "server", True)))
        if "oom" in a.phases:
            out.append(Step("3 oom", "1 worker, device decode, GPU memory hog", 70, self.oom))
        if "layouts" in a.phases:
            for lay in self.layouts:
                est = 22.0 if lay.device == "bare" else server_estimate_s(lay, a.warm_s, a.load_s)
                out.append(Step("4 layouts", lay.label, est, partial(self.layout, lay)))
        return out

    def model_level(self) -> None:
        from bench import gpu_phases

        batch = np.concatenate([self.pixels] * (-(-64 // len(self.pixels))))[:64]  # the album, repeated to 64
        gpu_phases.model_level(self.args.model, self.rig.weights, batch, partial(self.add, "model_level"))

    def decode(self) -> None:
        from bench import gpu_phases

        gpu_phases.decode_bench(self.blobs, self.transform, self.cores, partial(self.add, "decode"))

    def server(self, layout: Layout, section: str, check: bool = False) -> None:
        from bench import gpu_phases

        measured = [r.get("label") for r in self.doc.get("server", []) + self.doc.get("layouts", [])]
        if layout.label in measured:
            raise Skip(f"{layout.label} measured already")
        self.add(section, gpu_phases.server_run(self.rig, layout, check=check))

    def layout(self, layout: Layout) -> None:
        from bench import gpu_phases

        layout = resolve(layout, self.doc.get("server", []) + self.doc.get("layouts", []), self.cores)
        if layout.device == "bare":
            self.add("bare", gpu_phases.bare_run(self.rig, layout))
        else:
            self.server(layout, "layouts")

    def oom(self) -> None:
        from bench import gpu_phases

        self.doc["oom"] = {"layout": Layout("cuda", 1, 0, "auto", "device").label, "margin_mib": self.args.oom_margin_mib}
        gpu_phases.oom_phase(self.rig, Layout("cuda", 1, 0, "auto", "device"), self.args.oom_margin_mib,
                             self.doc["oom"], self.save)


def needs_cuda(args: argparse.Namespace, layouts: list[Layout]) -> bool:
    return bool({"model", "server", "oom"} & set(args.phases)) or (
        "layouts" in args.phases and any(lay.device == "cuda" for lay in layouts))


def cuda_problem() -> str | None:
    """None when torch sees a CUDA device, else why not (one line)."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return None
        return f"torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'}) sees no CUDA device"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def setup(run: Run) -> None:
    """Machine facts, album, weights, crops, CPU reference; the image hosts are started by main."""
    from bench import bare, gpu_phases, report
    from bench.album import DEFAULT_DIR, load_album
    from service.engine.loading import load_model

    a, t0 = run.args, time.monotonic()
    album_dir = DEFAULT_DIR if a.album_count == 30 and a.album_max_side is None else \
        DEFAULT_DIR.parent / f"album-{a.album_count}-{a.album_max_side}"
    rendered = gpu_phases.ensure_album_fast(album_dir, count=a.album_count, max_side=a.album_max_side,
                                            processes=min(run.cores, a.album_count))
    album = load_album(album_dir)
    run.doc["album"] = {**report.album_facts(album), "dir": str(album_dir), "rendered_s": round(time.monotonic() - t0, 1)
                        if rendered else "cached"}
    weights = bare.save_random_weights(a.model, DEFAULT_DIR.parent / "weights" / f"{bare.slug(a.model)}-seed0.pt")
    run.blobs = list(album.values())
    run.transform = load_model(a.model, str(weights)).info.transform
    run.pixels = gpu_phases.crops(run.blobs, run.transform, run.cores)
    run.rig = gpu_phases.Rig(a.model, weights, album_dir, "", [], list(album), gpu_phases.cpu_reference(
        a.model, weights, run.pixels), a.clients, a.warm_s, a.load_s, lambda: max(30.0, min(150.0, run.budget.left())))
    run.doc["setup_s"] = round(time.monotonic() - t0, 1)
    print(f"-- setup: album {run.doc['album']}, weights {weights.name}, {run.doc['setup_s']} s", flush=True)


def gpu_facts() -> dict[str, Any]:
    import torch

    from bench import gpu_procs

    return {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))), "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "driver_cuda": gpu_procs.parse_cuda_version(gpu_procs.smi()),
            "nvidia_smi": gpu_procs.gpus()}


def watchdog(run: Run) -> threading.Timer:
    """At budget + GRACE_S: stop what runs, save, print the tables, exit 3 (before the run tool's kill)."""
    def fire() -> None:
        print(f"!! hard deadline ({run.budget.total_s + GRACE_S:.0f} s): stopping", flush=True)
        for thing in list(run.rig.live if run.rig else []):
            try:
                thing.stop(timeout=5)
            except Exception:
                pass
        run.doc["cut_short"] = True
        run.save()
        print(gpu_plan.tables(run.doc), flush=True)
        os._exit(3)

    timer = threading.Timer(run.budget.total_s + GRACE_S - run.budget.used(), fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cores = args.cores or len(os.sched_getaffinity(0))
    command = "python -m bench.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    run = Run(args, cores, gpu_plan.Budget(args.budget_s), {"command": command, "budget_s": args.budget_s})
    steps = run.steps()
    plan = plan_rows(steps, args.budget_s, SETUP_ESTIMATE_S)
    if args.plan_only:
        print(gpu_plan.plan_table(plan, args.budget_s, SETUP_ESTIMATE_S))
        return 0
    if needs_cuda(args, run.layouts) and (problem := cuda_problem()):
        print(f"no CUDA device: {problem}. bench.gpu_check needs one for phases model, server, oom and cuda "
              "layouts (run it on the GPU machine, or --phases layouts --layouts with cpu/bare ones)", file=sys.stderr)
        return 2
    from bench import gpu_procs, report

    args.out.mkdir(parents=True, exist_ok=True)
    run.doc["machine"] = report.start("bench.gpu_check", args.model, argv)
    if needs_cuda(args, run.layouts):
        run.doc["gpu"] = gpu_facts()
        print(json.dumps(run.doc["gpu"]), flush=True)
    run.doc["plan"] = plan
    print(gpu_plan.plan_table(plan, args.budget_s, SETUP_ESTIMATE_S), flush=True)
    timer = watchdog(run)
    try:
        setup(run)
        run.save()
        with gpu_procs.ImageHosts(run.rig.album_dir, args.image_hosts or max(1, cores // 4)) as hosts:
            run.rig.base_url, run.rig.host_pids = hosts.base_url, hosts.pids
            run_steps(steps, run.budget, run.doc.setdefault("steps", []), on_phase_end=partial(phase_end, run),
                      skip=(Skip,))
    except Exception as exc:  # setup or the image hosts: nothing can be measured without them
        run.doc["error"] = f"{type(exc).__name__}: {exc}"
        run.save()
        print(f"!! {run.doc['error']}", file=sys.stderr, flush=True)
        return 1
    finally:
        timer.cancel()
    run.doc["seconds"] = round(run.budget.used(), 1)
    run.save()
    print(gpu_plan.tables(run.doc), flush=True)
    print(f"wrote {args.out / 'gpu.json'} ({run.doc['seconds']} s of {args.budget_s:.0f})", flush=True)
    return 0


def phase_end(run: Run, phase: str, seconds: float) -> None:
    run.save()
    print(f"-- phase {phase}: {seconds:.0f} s; {run.budget.left():.0f} s of the budget left", flush=True)
    print(gpu_plan.tables(run.doc, phase), flush=True)


if __name__ == "__main__":
    sys.exit(main())
