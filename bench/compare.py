"""gevent vs asyncio, side by side: ``python -m bench.compare [--quick]`` (``make compare [QUICK=1]``).

    1. album      30 photo-like JPEGs up to 12 MP (bench.album), served by a local image host
    2. weights    one seeded random state dict; every design and the bare run load this file
    3. yardstick  the bare pipeline (no server) in 1 x cores and cores x 1: images/s and the
                  reference embeddings (bench.bare)
    4. designs    start them all and check each one's embeddings (bench.equivalence); then every load
                  step on every design, interleaved: the closed runs (N users x 1 request), then the
                  open-loop steps; /healthz probed all along (bench.k6). The yardstick runs again at the end
    5. report     tables on stdout, JSON + PNG chart in docs/ (bench.report)

Exits 1 if a design failed or served different embeddings, so ``make compare`` cannot pass silently.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import requests

from bench import bare, equivalence, k6, report
from bench.album import DEFAULT_DIR, ensure_album, load_album
from bench.asyncio_designs.app import AppConfig
from bench.asyncio_designs.server import UvicornServer
from harness.imagehost import ImageHost
from harness.launch import ROOT, GunicornServer
from service.settings import default_workers

OUT_DIR = ROOT / "bench" / "out"
DOCS_DIR = ROOT / "docs"
# greenserve's defaults, except two limits the asyncio apps do not have: admit a whole N=16 closed run
# (16 x 30 images) on one worker (at the default 256 the 9th request gets 503 + Retry-After at once), and
# give requests k6's 300 s instead of the 60 s deadline (504), so every design serves every request.
READY_TIMEOUT_S = 300.0  # all designs load their models at once on a shared machine
GREENSERVE_LIMITS = {"GREENSERVE_MAX_QUEUE_IMAGES": "512", "GREENSERVE_REQUEST_TIMEOUT_S": "300"}
# The defaults design serves the dtype it chooses (GREENSERVE_DTYPE=auto: bfloat16 on a CPU with native
# bf16 where it is measured faster), as a user gets it; the other greenserve design pins float32, as the
# asyncio apps run, so scheduling is also compared at equal numerics. bench.dtype_bench goes deeper.
FLOAT32 = {"GREENSERVE_DTYPE": "float32"}


@dataclass(frozen=True)
class Plan:
    name: str  # names the outputs: docs/compare-<name>.json / .png
    model: str
    ns: tuple[int, ...]  # closed runs: N users x 1 request each
    open_fractions: tuple[float, ...]  # open-loop offered rates, as fractions of the bare best images/s
    open_duration_s: float
    max_inflight: int  # open loop: most requests in flight; later arrivals are dropped (and counted)
    bare_reps: int
    album_count: int = 30
    album_max_side: int | None = None  # None: phone sizes (up to 12 MP); tests shrink the album
    image_latency_ms: float = 0.0
    bare_at_end: bool = True  # measure the yardstick again at the end (the machine's drift, in the report)


# the seed's experiment on the seed's model (the album service embeds with CLIP); --model resnet50 as before
FULL = Plan("full-open_clip-ViT-B-32", "open_clip:ViT-B-32", (1, 2, 3, 4, 5, 8, 16), (0.6, 1.3), 15.0,
            max_inflight=8, bare_reps=2)
QUICK = Plan("quick", "resnet18", (1, 2), (1.3,), 6.0, max_inflight=6, bare_reps=1)


@dataclass(frozen=True)
class Design:
    name: str
    processes: int
    threads: int  # torch threads per process
    asyncio_mode: str | None = None  # naive | executor | locked; None = greenserve
    defaults: bool = False  # greenserve: leave torch threads to it (it borrows idle siblings' cores)

    @property
    def label(self) -> str:
        return f"{self.name} {self.processes}x{self.threads}" + (" defaults" if self.defaults else "")


def designs(cores: int, model: str = "resnet50") -> tuple[Design, ...]:
    """Run order: greenserve first (its embeddings are the ones the others are checked against): its
    default layout for ``model`` (a worker per core; per 2 cores for a ViT), then the other one."""
    workers = default_workers(model, cores)
    default = Design("greenserve", workers, cores // workers, defaults=True)  # with 1-thread workers it
    # borrows idle siblings' cores (GREENSERVE_BORROW_IDLE_CORES)
    other = Design("greenserve", 1, cores) if workers > 1 else Design("greenserve", cores, 1)
    return (default, other,
            Design("asyncio-naive", 1, cores, "naive"),
            Design("asyncio-executor", 1, cores, "executor"),
            Design("asyncio-executor-locked", 1, cores, "locked"),
            Design("asyncio-executor-locked", cores, 1, "locked"))  # greenserve's layout for convnets


def server_for(design: Design, model: str, weights: Path, base_url: str,
               root: Path = ROOT) -> GunicornServer | UvicornServer:
    """The design's server on 127.0.0.1, not started yet; ``start()`` returns once every model is warm.
    ``root``: the checkout whose greenserve runs (an earlier commit's, for a before/after)."""
    if design.asyncio_mode is None:
        env = {"GREENSERVE_MODEL": model, "GREENSERVE_WEIGHTS": str(weights),
               "GREENSERVE_IMAGE_BASE_URL": base_url, "GREENSERVE_LOG_LEVEL": "info", **GREENSERVE_LIMITS}
        if not design.defaults:  # an explicit thread count pins the layout (no borrowing), in float32
            env |= {"GREENSERVE_TORCH_THREADS": str(design.threads), **FLOAT32}
        return GunicornServer(env, cache="off", workers=design.processes, ready_timeout_s=READY_TIMEOUT_S, cwd=root)
    config = AppConfig(design.asyncio_mode, model, str(weights), base_url, design.threads)
    return UvicornServer(config, workers=design.processes, ready_timeout_s=READY_TIMEOUT_S)


def start_all(selected: list[Design], plan: Plan, weights: Path, base_url: str,
              stack: contextlib.ExitStack, root: Path = ROOT) -> dict[str, str | Exception]:
    """Start every design at once (their model loads overlap); label → URL, or the start-up error.

    Every server is stopped when ``stack`` closes, whether it started or not.
    """
    return start_servers({d.label: server_for(d, plan.model, weights, base_url, root) for d in selected}, stack)


def start_servers(servers: dict[str, GunicornServer | UvicornServer],
                  stack: contextlib.ExitStack) -> dict[str, str | Exception]:
    """Start ``servers`` at once (their model loads overlap): name → URL, or the start-up error (recorded
    per server by the caller). Every server is stopped when ``stack`` closes, whether it started or not."""
    for srv in servers.values():
        stack.callback(srv.stop)
    with ThreadPoolExecutor(len(servers) or 1) as pool:
        started = {name: pool.submit(srv.start) for name, srv in servers.items()}
        urls: dict[str, str | Exception] = {}
        for name, fut in started.items():
            try:
                urls[name] = fut.result().url
            except Exception as exc:
                urls[name] = exc
    return urls


def fetch_embeddings(url: str, names: list[str]) -> np.ndarray:
    """The album's embeddings from a running design, in album order."""
    r = requests.post(url + "/v1/embeddings", json={"images": names}, timeout=300)
    r.raise_for_status()
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    if [d["image"] for d in data] != names:
        raise AssertionError(f"{url} answered for {[d['image'] for d in data]}, not {names}")
    return np.asarray([d["embedding"] for d in data], dtype=np.float32)


def check_design(design: Design, url: str | Exception, names: list[str], reference: np.ndarray,
                 baseline: np.ndarray | None) -> dict[str, Any]:
    """The design's result record, with its embeddings checked; a start-up or check failure is recorded.
    A greenserve that chose a lower precision is checked within ``equivalence.LOW_PRECISION``."""
    out: dict[str, Any] = {"design": design.name, "label": design.label, "processes": design.processes,
                           "threads": design.threads, "dtype": "float32", "closed": [], "open": []}
    try:
        if isinstance(url, Exception):
            raise url
        out["url"] = url
        if design.asyncio_mode is None:
            out["dtype"] = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["dtype"]
        emb = fetch_embeddings(out["url"], names)  # also the warm-up with the real album
        out["embeddings"] = emb
        tolerance = equivalence.TOLERANCE if out["dtype"] == "float32" else equivalence.LOW_PRECISION
        out["check_vs_bare"] = equivalence.compare(emb, reference, tolerance).to_dict()
        if baseline is not None:
            out["check_vs_greenserve"] = equivalence.compare(emb, baseline, tolerance).to_dict()
    except Exception as exc:
        _failed(out, exc)
    return out


def run_steps(plan: Plan, live: list[dict[str, Any]], names: list[str], rates: list[int]) -> None:
    """Every load step on every live design, interleaved: step by step, all designs, in rotating order.

    The machine is shared, so its speed drifts; interleaving spreads the drift over all designs instead
    of handing one design a quiet minute and the next a busy one.
    """
    steps = [("closed", n) for n in plan.ns] + [("open", r) for r in rates]
    for i, (kind, x) in enumerate(steps):
        order = live[i % len(live):] + live[:i % len(live)] if live else []
        for d in order:
            if "error" in d:
                continue
            try:
                if kind == "closed":
                    r = k6.run_closed(d["url"], names, x)
                else:
                    r = k6.run_open(d["url"], names, x, plan.open_duration_s, max_inflight=plan.max_inflight)
            except Exception as exc:
                _failed(d, exc)
                continue
            row = {**r.to_dict(), "loadavg": round(os.getloadavg()[0], 2)}
            d[kind].append(row)
            _progress(d["label"], f"N={x}" if kind == "closed" else f"open {x}/min", row)


def _failed(out: dict[str, Any], exc: Exception) -> None:
    out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    print(f"!! {out['label']} failed: {out['error']}", file=sys.stderr, flush=True)


def _progress(label: str, step: str, r: dict[str, Any]) -> None:
    lat = r["latency"] or {}
    print(f"   {label:32s} {step:14s} mean {lat.get('mean', 0) / 1000:6.2f}s  {r['images_per_s']:6.2f} img/s  "
          f"healthz max {(r['health'] or {}).get('max', 0):7.0f} ms  errors {r['errors']}  "
          f"load {r['loadavg']}", flush=True)


def yardstick(plan: Plan, weights: Path, album_dir: Path, cores: int, when: str,
              ref_path: Path | None = None) -> list[dict[str, Any]]:
    """The bare pipeline in both layouts (1 x cores, cores x 1)."""
    return [{"when": when, **bare.measure(plan.model, weights, album_dir, processes=1, threads=cores,
                                          reps=plan.bare_reps, out=ref_path)},
            {"when": when, **bare.measure(plan.model, weights, album_dir, processes=cores, threads=1,
                                          reps=plan.bare_reps)}]


def run(plan: Plan, *, out_dir: Path, only: set[str] | None = None, chart: bool = True,
        root: Path = ROOT) -> dict[str, Any]:
    """The whole comparison; returns (and writes) the results document."""
    started = time.monotonic()
    cores = len(os.sched_getaffinity(0))
    album_dir = DEFAULT_DIR if plan.album_max_side is None and plan.album_count == 30 else \
        OUT_DIR / f"album-{plan.album_count}-{plan.album_max_side}"
    blobs = load_album(ensure_album(album_dir, count=plan.album_count, max_side=plan.album_max_side))
    names = list(blobs)
    weights = bare.save_random_weights(plan.model, OUT_DIR / "weights" / f"{bare.slug(plan.model)}-seed0.pt")
    ref_path = OUT_DIR / f"reference-{plan.name}.npy"
    bare_runs = yardstick(plan, weights, album_dir, cores, "start", ref_path)
    reference = np.load(ref_path)
    best = max(y["images_per_s"] for y in bare_runs)
    rates = [max(1, round(f * best * 60 / len(names))) for f in plan.open_fractions]
    doc: dict[str, Any] = {"plan": dataclasses.asdict(plan), "machine": report.machine(plan.model, cores),
                           "greenserve_root": str(root),
                           "album": report.album_facts(blobs), "bare": bare_runs, "open_rates_per_min": rates,
                           "tolerance": equivalence.TOLERANCE, "reference_spread": equivalence.spread(reference),
                           "seed": report.SEED_NUMBERS, "designs": []}
    print(report.header(doc), flush=True)
    selected = [d for d in designs(cores, plan.model) if not only or d.label in only or d.name in only]
    with ImageHost(blobs, latency_s=plan.image_latency_ms / 1000) as host, contextlib.ExitStack() as stack:
        print(f"-- starting {', '.join(d.label for d in selected)}", flush=True)
        # all designs stay up (idle ones cost no CPU) so that the load steps can interleave
        urls = start_all(selected, plan, weights, host.base_url, stack, root)
        baseline = None
        for design in selected:
            d = check_design(design, urls[design.label], names, reference, baseline)
            if baseline is None and design.name == "greenserve" and "embeddings" in d and d["dtype"] == "float32":
                baseline = d["embeddings"]
            d.pop("embeddings", None)
            doc["designs"].append(d)
        run_steps(plan, doc["designs"], names, rates)
    for d in doc["designs"]:
        d.pop("url", None)
    if plan.bare_at_end:
        doc["bare"] += yardstick(plan, weights, album_dir, cores, "end")
    doc["seconds"] = round(time.monotonic() - started, 1)
    print(report.tables(doc), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"compare-{plan.name}.json"
    json_path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {json_path} ({doc['seconds']:.0f} s in all)", flush=True)
    if chart:
        print(f"wrote {report.chart(doc, out_dir / f'compare-{plan.name}.png')}", flush=True)
    return doc


def passed(doc: dict[str, Any]) -> bool:
    """Every design ran, and served the reference's embeddings within tolerance."""
    def ok(d: dict[str, Any]) -> bool:
        return ("error" not in d and d["check_vs_bare"]["passed"]
                and d.get("check_vs_greenserve", {"passed": True})["passed"])

    return bool(doc["designs"]) and all(ok(d) for d in doc["designs"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N=1,2 with resnet18 and one open-loop step (~3 min)")
    parser.add_argument("--model", help="override the plan's model (full: open_clip:ViT-B-32, quick: resnet18); "
                        "the outputs are named for it (docs/compare-full-resnet50.json)")
    parser.add_argument("--ns", help="override the closed runs' N, e.g. 1,2,4")
    parser.add_argument("--design", action="append", help="run only this design (name or label); repeatable")
    parser.add_argument("--image-latency-ms", type=float, help="delay the image host adds to every image")
    parser.add_argument("--out-dir", type=Path, default=DOCS_DIR)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose greenserve runs (default: this)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.model and args.model != plan.model:
        plan = dataclasses.replace(plan, model=args.model,
                                   name=f"{'quick' if args.quick else 'full'}-{bare.slug(args.model)}")
    if args.ns:
        plan = dataclasses.replace(plan, ns=tuple(int(n) for n in args.ns.split(",")))
    if args.image_latency_ms is not None:
        plan = dataclasses.replace(plan, image_latency_ms=args.image_latency_ms)
    doc = run(plan, out_dir=args.out_dir, only=set(args.design) if args.design else None, root=args.root)
    ok = passed(doc)
    print("all designs served the same embeddings" if ok else "FAILED: see errors / checks above", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
