r"""The GPU path on one lent machine, in one device call of at most 8 minutes: ``python -m bench.gpu_check --out DIR``.

The device machine is bare but for its own python3 (torch, torchvision, numpy, Pillow, requests); nothing can be
installed from a registry there. So, here, ``make gpu-wheels`` (wheels into bench/out/gpu-wheels), then one call of
the ``run`` device tool (timeout_s 480, carry ["bench/out/gpu-wheels"]): with the machine's start-up it fits the 15
device minutes a session gets.

    python3 -m pip install -q --no-index --find-links bench/out/gpu-wheels \
        flask gunicorn gevent orjson python-json-logger prometheus-client &&
        PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out $OUT/gpu --budget-s 330

It prints the plan, makes the 30-photo phone album (bench.album), random resnet50 weights and the CPU reference,
then runs the steps in order, each only while its estimate fits the budget left (the others are logged as skipped);
DIR/gpu.json and its tables, DIR/gpu.md, are rewritten after every measurement, so a call cut short still brings
back what it measured. Throughput is the server's own count (/metrics); the CPU % of server, image hosts and
clients and the GPU's utilisation show the bottleneck. Each step answers one open question (~265 s at the
estimates, setup included; the budget leaves a minute for slow starts, the call two more for the install):

 1. model    resnet50 on cuda:0, batch 64, float32, bfloat16 and float16 by autocast and cast once: the speeds and
             cosines GREENSERVE_DTYPE=auto chooses between on a GPU (cast once has never run on one)        ~25 s
 2. server   2 workers, dtype auto, JPEG decode pillow then device, 16 clients sending the album by URL: whether
             decoding on the GPU lifts the CPU-decode bound (274 photos/s) toward the goal; /healthz p50/p99,
             the dtype chosen, the embeddings against the CPU's                                             ~70 s
 3. oom      1 worker, device decode; a hog takes all but 512 MiB of the GPU, then all, then leaves: album
             requests under each (200, or 503 out_of_memory + Retry-After), the worker's GPU memory after   ~70 s
 4. layouts  4 workers on the GPU (device decode): whether more than 2 workers a GPU pay; the CPU alone with a
             worker per core: the many-core layout the CPU defaults assume, measured on 2 cores only       ~70 s

Left out to fit one call: 1 and 8 workers a GPU, and the CPU with cores / 2, / 4,
/ 8 workers and in float32; the next call can take them.

Goals: >= 1,100 phone photos/s with resnet50 on one H200 (274 with CPU decode, 2 workers, before); /healthz p99
stays low (tens of ms) while saturated; after OOM the worker answers 200, its GPU memory back near its baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench import album, bare, equivalence, gpu_parts
from bench.gpu_parts import cell, table
from harness.launch import GunicornServer

PHASES = ("model", "server", "oom", "layouts")
SETUP_S, GOAL, BEFORE, MARGIN_MIB = 30.0, 1100, 274, 512  # photos/s: the goal on one H200, 2 workers before
BUDGET_S = 330  # the steps' seconds: with the install and a slow start it ends well inside the call's 480 s
SERVER = ("label dtype_chosen jpeg_decode images_per_s served_images_per_s mean_batch p50_s healthz_p50_ms "
          "healthz_p99_ms failed server_cpu_pct imagehost_cpu_pct client_cpu_pct gpu_util_pct start_s check")
SECTIONS = {"model_level": ("Model level (cuda:0, no server)", "dtype images_per_s ms_per_batch cosine_vs_cpu_fp32"),
            "server": ("Server: pillow vs device decode", SERVER), "layouts": ("Layouts", SERVER),
            "oom": ("GPU out of memory", "stage statuses retry_after served_images_per_s healthz_p99_ms worker_mib")}


@dataclass(frozen=True)
class Layout:
    """A server: GREENSERVE_DEVICE, its workers, GREENSERVE_DTYPE and GREENSERVE_JPEG_DECODE (None: not set)."""

    device: str
    workers: int
    dtype: str = "auto"
    jpeg: str | None = None

    @property
    def label(self) -> str:
        workers = f"{self.workers} worker" + "s" * (self.workers > 1)
        return f"{self.device} {workers}, dtype {self.dtype}, jpeg {self.jpeg or '-'}"


def default_layouts(cores: int) -> list[Layout]:
    """Phase 4: more workers a GPU than phase 2's, and the CPU alone with a worker per core."""
    return [Layout("cuda", 4, jpeg="device"), Layout("cpu", cores)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--out", type=Path, required=True, help="directory for gpu.json and gpu.md")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"seconds for everything (default {BUDGET_S})")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--smoke", action="store_true", help="a tiny run, to try it on a CPU: mobilenet_v3_small, 3 photos"
                   " of 320 px, 2 clients, 1 + 2 s windows; phase 4 is then 1 cpu worker in float32")
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    if unknown := set(args.phases) - set(PHASES):
        p.error(f"unknown phase(s) {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")
    cores = args.cores = len(os.sched_getaffinity(0))
    tiny = dict(model="mobilenet_v3_small", album=(3, 320), clients=2, warm_s=1.0, load_s=2.0, hosts=2,
                layouts=[Layout("cpu", 1, "float32")])
    full = dict(model="resnet50", album=(30, None), clients=16, warm_s=2.0, load_s=7.0, hosts=max(1, cores // 4),
                layouts=default_layouts(cores))
    vars(args).update(tiny if args.smoke else full)
    return args


@dataclass(frozen=True)
class Step:
    phase: str  # "1 model": the steps of one phase are consecutive
    name: str
    estimate_s: float  # it starts only while at least this much of the budget is left
    fn: Callable[[], object] = lambda: None


class Budget:
    """Seconds since the run started, against ``total_s``; ``clock`` is injectable for tests."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_s, self.clock, self.started = total_s, clock, clock()

    def used(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        return self.total_s - self.used()


def plan_rows(steps: Sequence[Step], budget_s: float, setup_s: float) -> list[dict[str, Any]]:
    """When each step would end at the estimates, or "if time" (``run_steps``' rule: later, smaller ones may fit)."""
    t, rows = setup_s, [{"phase": "0 setup", "step": "machine, album, weights, CPU reference",
                         "estimate_s": round(setup_s), "ends_at_s": round(setup_s), "fits": "yes"}]
    for s in steps:
        t += s.estimate_s if (fits := t + s.estimate_s <= budget_s) else 0
        rows.append({"phase": s.phase, "step": s.name, "estimate_s": round(s.estimate_s),
                     "ends_at_s": round(t) if fits else None, "fits": "yes" if fits else "if time"})
    return rows


def run_steps(steps: Sequence[Step], budget: Budget, log: list[dict[str, Any]]) -> None:
    """Run each step that fits the budget left; log each: ok, skipped (the budget), or error (and go on)."""
    for step in steps:
        log.append(rec := {"phase": step.phase, "step": step.name, "estimate_s": round(step.estimate_s)})
        if (left := budget.left()) < step.estimate_s:
            rec.update(status="skipped", reason=f"budget: {left:.0f} s left, needs ~{step.estimate_s:.0f} s")
            continue
        t0 = budget.used()
        print(f"-- [{step.phase}] {step.name} (~{step.estimate_s:.0f} s; {left:.0f} s left)", flush=True)
        try:
            step.fn()
            rec["status"] = "ok"
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
            rec.update(status="error", error=err if len(err) <= 1500 else f"{err[:300]} [...] {err[-1200:]}")
            print(f"!! {step.name}: {rec['error']}", flush=True)
        rec["seconds"] = round(budget.used() - t0, 1)


def goals(doc: dict[str, Any]) -> list[str]:
    out, oom, rows = [], doc.get("oom") or {}, doc.get("server", []) + doc.get("layouts", [])
    if gpu := [r for r in rows if r["device"] == "cuda" and r.get("images_per_s")]:
        b = max(gpu, key=lambda r: r["images_per_s"])
        out.append(f"- best on the GPU: {b['images_per_s']} images/s ({b['label']}, dtype {b.get('dtype_chosen')}) vs "
                   f"goal {GOAL}: {'MET' if b['images_per_s'] >= GOAL else 'not met'} ({BEFORE} before, CPU decode); "
                   f"/healthz p99 there {b.get('healthz_p99_ms')} ms")
    if stages := oom.get("stages"):
        under = {k: sum(s["statuses"].get(k, 0) for s in stages[:-1]) for s in stages[:-1] for k in s["statuses"]}
        out.append(f"- OOM: under the hog {cell({'x': under}, 'x')}; all 200 after it: {oom.get('after_all_200')}; "
                   f"worker GPU MiB {oom.get('baseline_mib')} at baseline -> {oom.get('after_mib')} after; whole GPU "
                   f"{oom.get('gpu_used_baseline_mib')} -> {oom.get('gpu_used_after_mib')} MiB")
    return out


def tables(doc: dict[str, Any]) -> str:
    parts = []
    for s, (title, cols) in SECTIONS.items():
        rows, facts = doc.get(s), ""
        if s == "oom" and rows:
            rows, facts = rows["stages"], ", ".join(f"{k} {cell(rows, k)}" for k in rows if k != "stages") + "\n\n"
        parts += [f"## {title}\n{facts}" + table(rows, cols.split())] if rows else []
    steps = [{**r, "why": (r.get("reason") or r.get("error") or "")[:120]} for r in doc.get("steps", [])]
    return "\n\n".join([*parts, f"## Steps (setup {doc.get('setup_s', '-')} s)\n"
                        + table(steps, ["phase", "step", "estimate_s", "seconds", "status", "why"]),
                        "## Goals\n" + ("\n".join(goals(doc)) or "- nothing measured")])


class Run:
    """A run's arguments, results, budget and what setup made; the phases are its methods, each adding to ``doc``."""

    def __init__(self, args: argparse.Namespace, cores: int, budget: Budget, doc: dict[str, Any]) -> None:
        self.args, self.cores, self.budget, self.doc = args, cores, budget, doc
        self.base_url, self.host_pids = "", list[int]()  # the image hosts'

    def save(self) -> None:
        (tmp := self.args.out / "gpu.json.tmp").write_text(json.dumps(self.doc, indent=1, default=str))
        tmp.replace(self.args.out / "gpu.json")
        (self.args.out / "gpu.md").write_text(tables(self.doc) + "\n")

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.doc.setdefault(section, []).append(row)
        print("   " + ", ".join(f"{k} {cell(row, k)}" for k in SECTIONS[section][1].split() if k in row), flush=True)
        self.save()

    def steps(self) -> list[Step]:
        a = self.args

        def server(phase: str, lay: Layout) -> Step:  # start (~20 s for resnet50), load, stop (+ the check in 2)
            estimate = 22 + a.warm_s + a.load_s + lay.workers / 2 + (2 if phase == "2 server" else 0)
            return Step(phase, lay.label, estimate, partial(self.server_run, lay, phase))

        out = [Step("1 model", f"{a.model} cuda:0 batch 64, 5 numerics", 25, self.model_level)] * ("model" in a.phases)
        out += [server("2 server", Layout("cuda", 2, jpeg=j)) for j in ("pillow", "device")] * ("server" in a.phases)
        out += [Step("3 oom", "1 worker, device decode, GPU memory hog", 70, self.oom)] * ("oom" in a.phases)
        return out + [server("4 layouts", lay) for lay in a.layouts] * ("layouts" in a.phases)

    def setup(self) -> None:
        import torch

        from bench.report import album_facts
        from service.engine.loading import load_model
        from service.pipeline.decode import configure_pillow
        from service.pipeline.prepare import decode_and_crop

        (count, side), t0, name = self.args.album, time.monotonic(), self.args.model
        self.album_dir = album.DEFAULT_DIR.parent / ("album" if count == 30 and not side else f"album-{count}-{side}")
        self.photos = album.load_album(album.ensure_album(self.album_dir, count=count, max_side=side))
        self.weights = bare.save_random_weights(name, self.album_dir.parent / f"weights/{bare.slug(name)}-seed0.pt")
        model = load_model(name, str(self.weights), device=torch.device("cpu"))
        configure_pillow(bare.MAX_PIXELS)  # the crops as the server's Pillow path makes them, on every core
        with ThreadPoolExecutor(self.cores) as pool:
            crop = partial(decode_and_crop, transform=model.info.transform, max_pixels=bare.MAX_PIXELS)
            self.pixels = np.stack(list(pool.map(crop, self.photos.values())))
        emb = model.forward(self.pixels)[0].numpy()  # type: ignore[union-attr]
        self.reference = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        self.doc.update(album=album_facts(self.photos), setup_s=round(time.monotonic() - t0, 1))

    def model_level(self) -> None:
        """float32, then bfloat16 and float16 by autocast and cast once (what GREENSERVE_DTYPE=auto tries)."""
        import torch

        from service.engine.casting import FLOAT32, Numerics
        from service.engine.loading import load_model

        batch, ref = (np.concatenate([x] * -(-64 // len(x)))[:64] for x in (self.pixels, self.reference))
        for how in [FLOAT32, *(Numerics(d, cast=c) for d in (torch.bfloat16, torch.float16) for c in (False, True))]:
            m = load_model(self.args.model, str(self.weights), device=torch.device("cuda:0"), numerics=how)
            feats, t0 = m.forward(batch)[0], time.perf_counter()  # CPU tensors back: the copy and a sync are timed
            for _ in range(10):
                m.forward(batch)
            seconds = (time.perf_counter() - t0) / 10
            cos = torch.nn.functional.cosine_similarity(feats, torch.from_numpy(ref))  # type: ignore[arg-type]
            self.add("model_level", {"dtype": how.name, "images_per_s": round(64 / seconds, 1), "ms_per_batch":
                                     round(seconds * 1000, 2), "cosine_vs_cpu_fp32": round(float(cos.min()), 6)})
            del m
            torch.cuda.empty_cache()

    def server(self, layout: Layout) -> GunicornServer:  # ready in what the budget leaves, up to 150 s
        return gpu_parts.serve(layout, self.args.model, self.weights, self.base_url, min(150.0, self.budget.left()))

    def server_run(self, layout: Layout, phase: str) -> None:
        """``phase``'s row of a layout under a saturating load: its choices, embeddings (2), throughput, health, CPU."""
        a, t0, names = self.args, time.monotonic(), list(self.photos)
        row: dict[str, Any] = {"label": layout.label, "device": layout.device, "workers": layout.workers}
        with self.server(layout) as srv:
            row.update(start_s=round(time.monotonic() - t0, 1), **gpu_parts.model_facts(srv.url, layout.workers))
            if phase == "2 server":  # a server that chose a lower precision is held to the looser tolerance
                tol = equivalence.TOLERANCE if row["dtype_chosen"] == "float32" else equivalence.LOW_PRECISION
                row["check"] = equivalence.compare(gpu_parts.embeddings(srv.url, names), self.reference, tol).to_dict()
            cpu = {"server_cpu_pct": lambda: srv.worker_pids() | {srv.proc.pid if srv.proc else 0},
                   "imagehost_cpu_pct": lambda: self.host_pids, "client_cpu_pct": lambda: [os.getpid()]}
            row.update(gpu_parts.load(srv.url, names, clients=a.clients, warm_s=a.warm_s, measure_s=a.load_s, cpu=cpu,
                                      gpu=layout.device == "cuda"))
        self.add(phase.split()[1], row)

    def oom(self, layout: Layout = Layout("cuda", 1, jpeg="device")) -> None:
        """One worker's GPU memory and album requests as a hog leaves it MARGIN_MIB, then nothing, then is gone."""
        out, names = self.doc.setdefault("oom", {"layout": layout.label, "stages": []}), list(self.photos)
        hog = gpu_parts.Hog()  # imports torch and makes its CUDA context while the server starts
        try:
            with self.server(layout) as srv:
                worker = min(srv.worker_pids())
                out.update(baseline_mib=gpu_parts.apps().get(worker), gpu_used_baseline_mib=gpu_parts.gpu0().get(
                    "memory_used_mib"), **gpu_parts.model_facts(srv.url, 1))
                hog.ready()
                out["hog_full_mib"] = hog.command("fill")
                for stage, command, clients, seconds in ((f"hog leaves ~{MARGIN_MIB} MiB", f"free {MARGIN_MIB}", 4, 6),
                                                         ("hog takes all", "fill", 4, 4), ("hog gone", "", 2, 4)):
                    out[f"{stage}: hog MiB"] = hog.command(command) if command else hog.stop()
                    time.sleep(0 if command else 1)  # the hog's memory freed
                    out["stages"].append({"stage": stage, **gpu_parts.stage(srv.url, names, worker, clients, seconds)})
                    self.save()
                out.update(after_mib=gpu_parts.apps().get(worker), gpu_used_after_mib=gpu_parts.gpu0().get(
                    "memory_used_mib"), same_worker=worker in srv.worker_pids(),
                    after_all_200=set(out["stages"][-1]["statuses"]) == {"200"})
        finally:
            hog.stop()


def machine(cores: int) -> dict[str, Any]:  # the CPU, torch and the GPU (or, without one, the "problem")
    import torch

    cpu = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    out = {"cores": cores, "cpu": cpu[1] if cpu else None, "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        return {**out, "problem": f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no CUDA device"}
    return {**out, "gpu": torch.cuda.get_device_name(0), "capability": torch.cuda.get_device_capability(0),
            "driver_cuda": gpu_parts.parse_cuda_version(gpu_parts.smi()), "nvidia_smi": gpu_parts.gpus()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m bench.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    run = Run(args, args.cores, Budget(args.budget_s), {"command": command, "budget_s": args.budget_s})
    plan = run.doc["plan"] = plan_rows(steps := run.steps(), args.budget_s, SETUP_S)
    fit = sum(r["estimate_s"] for r in plan if r["fits"] == "yes")
    print(f"## Plan: {args.budget_s:.0f} s budget, {fit} s of steps fit at their estimates\n"
          + table(plan, ["phase", "step", "estimate_s", "ends_at_s", "fits"]), flush=True)
    print(json.dumps(facts := run.doc.setdefault("machine", machine(args.cores))), flush=True)
    if "problem" in facts and any(s.phase != "4 layouts" or s.name.startswith("cuda") for s in steps):
        print(f"no CUDA device: {facts['problem']}. bench.gpu_check needs one for phases model, server, oom and cuda "
              "layouts (run it on the GPU machine, or try --phases layouts --smoke)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        run.setup()
        with gpu_parts.ImageHosts(run.album_dir, args.hosts) as hosts:
            run.base_url, run.host_pids = hosts.base_url, hosts.pids
            run_steps(steps, run.budget, run.doc.setdefault("steps", []))
    except Exception as exc:  # setup or the image hosts: nothing can be measured without them
        run.doc["error"] = f"{type(exc).__name__}: {exc}"
        print(f"!! {run.doc['error']}", file=sys.stderr, flush=True)
    run.doc["seconds"] = round(run.budget.used(), 1)
    run.save()
    print(tables(run.doc), f"wrote {args.out / 'gpu.json'} ({run.doc['seconds']} s of {args.budget_s:.0f})", sep="\n")
    return 1 if "error" in run.doc else 0


if __name__ == "__main__":
    sys.exit(main())
