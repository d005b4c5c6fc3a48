"""The runtime the precision trial chose, served: ``python -m bench.runtime_bench [--models resnet50,open_clip:ViT-B-32]
[--quick] [--out-dir DIR]``.

For each model, two servers in compare's "cores x1 defaults" design (GREENSERVE_DTYPE=auto, the embedding cache
off), on one seeded random state dict:

    torch    GREENSERVE_RUNTIMES=torch: torch only, the default before OpenVINO was a candidate ("today's")
    auto     GREENSERVE_RUNTIMES=auto: the trial also tries the image tower in OpenVINO (the default now; a CLIP,
             whose searches need the torch forward's block points, stays on torch: --clip-runtimes openvino)
    int8     auto and GREENSERVE_INT8=allow: int8 tried too (models without a text tower)

    1. start-up   each server started twice on one fresh cache directory: the first start converts (and the
                  trial times), the second reads the IR, the compiled blob and the trial's record back; the
                  seconds to every worker ready, and the log's conversions
    2. memory     every worker's RSS and PSS (``/proc/PID/smaps_rollup``) after the album was served
    3. rounds     interleaved (the servers' order rotates): saturation (k6 open loop at 1.3x the server's own
                  N=5 images/s, so a faster runtime is offered more) and the seed's N=5 (five albums at once);
                  during saturation, the workers' CPU and the whole machine's busy CPU in % of all cores (the rest
                  of the busy share is k6 and the image host: a bare pipeline pays neither)
    4. check      each server's album embeddings against the torch float32 bare pipeline's (bench.bare)

Ratios in one run are the result: auto over torch per model. The machine's CPU flags say whether bfloat16 is
native. Exits 1 if a server failed or served embeddings below a cosine of 0.999 to float32's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests

from bench import bare, equivalence, k6, report
from bench.album import DEFAULT_DIR, ensure_album, load_album
from bench.compare import DOCS_DIR, GREENSERVE_LIMITS, OUT_DIR, READY_TIMEOUT_S, fetch_embeddings
from bench.cpu_window import cpu_window
from bench.memory import smaps
from harness.imagehost import ImageHost
from harness.launch import GunicornServer

VARIANTS = {"torch": {"GREENSERVE_RUNTIMES": "torch"}, "auto": {"GREENSERVE_RUNTIMES": "auto"},
            "int8": {"GREENSERVE_RUNTIMES": "auto", "GREENSERVE_INT8": "allow"}}
MODELS = ("resnet50", "open_clip:ViT-B-32")
CONVERTED_LINE = "tower converted in"
COSINE_FAIL = 0.999


def server(model: str, variant: dict[str, str], weights: Path, base_url: str, cores: int,
           cache_dir: str) -> GunicornServer:
    env = {"GREENSERVE_MODEL": model, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_IMAGE_BASE_URL": base_url,
           "GREENSERVE_LOG_LEVEL": "info", **GREENSERVE_LIMITS, "GREENSERVE_DTYPE": "auto", **variant,
           "GREENSERVE_CACHE": "off", "GREENSERVE_CACHE_DIR": cache_dir}
    return GunicornServer(env, cache="off", workers=cores, ready_timeout_s=READY_TIMEOUT_S)


def start(srv: GunicornServer) -> float:
    started = time.monotonic()
    srv.start()
    return round(time.monotonic() - started, 1)


def memory(srv: GunicornServer) -> dict[str, float]:
    rows = [smaps(pid) for pid in srv.worker_pids()]
    return {"rss_mb": round(statistics.mean(r["Rss"] for r in rows) / 1024),
            "pss_mb": round(statistics.mean(r["Pss"] for r in rows) / 1024)}


def served(url: str) -> dict[str, Any]:
    card = requests.get(url + "/v1/models", timeout=30).json()["data"][0]
    p = card.get("precision") or {}
    return {"image": p.get("towers", {}).get("image", {}).get("numerics"),
            "text": p.get("towers", {}).get("text", {}).get("numerics"),
            "trials": {t["numerics"]: round(t["speedup"], 2) for t in p.get("towers", {}).get("image", {}).get("trials", [])}}


def one_model(model: str, args: argparse.Namespace, cores: int, blobs: dict[str, bytes], album: Path) -> dict[str, Any]:
    names = list(blobs)
    weights = bare.save_random_weights(model, OUT_DIR / "weights" / f"{bare.slug(model)}-seed0.pt")
    reference = OUT_DIR / f"reference-runtime-{bare.slug(model)}.npy"
    yard = bare.measure(model, weights, album, processes=cores, threads=1, reps=1, out=reference, dtype="bfloat16")
    ref32 = OUT_DIR / f"reference-runtime-{bare.slug(model)}-f32.npy"
    bare.measure(model, weights, album, processes=1, threads=cores, reps=1, out=ref32, dtype="float32")
    out: dict[str, Any] = {"model": model, "bare_bf16_images_per_s": round(yard["images_per_s"], 2), "servers": {}}
    print(f"== {model}: bare bfloat16 {cores}x1 {yard['images_per_s']:.2f} img/s", flush=True)
    with ImageHost(blobs) as host, contextlib.ExitStack() as stack:
        live: dict[str, tuple[GunicornServer, dict[str, Any]]] = {}
        for runtimes, variant in VARIANTS.items():
            if model.startswith("open_clip:"):
                if runtimes == "int8":
                    continue
                variant = {**variant, "GREENSERVE_RUNTIMES": args.clip_runtimes} if runtimes == "auto" else variant
            cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="greenserve-runtime-"))
            s: dict[str, Any] = {"runtimes": runtimes, "env": variant, "saturation": [], "n5": []}
            first = server(model, variant, weights, host.base_url, cores, cache_dir)
            s["start_first_s"] = start(first)
            s["conversions_first"] = first.log().count(CONVERTED_LINE)
            first.stop()
            again = server(model, variant, weights, host.base_url, cores, cache_dir)
            s["start_cached_s"] = start(again)
            stack.callback(again.stop)
            s["conversions_cached"] = again.log().count(CONVERTED_LINE)
            s.update(served(again.url))
            emb = fetch_embeddings(again.url, names)
            s["check"] = equivalence.compare(emb, np.load(ref32)).to_dict()
            s.update(memory(again))
            print(f"-- {model} {runtimes} {variant}: image {s['image']}, start {s['start_first_s']}s first, "
                  f"{s['start_cached_s']}s cached (conversions {s['conversions_first']}/{s['conversions_cached']}), "
                  f"RSS {s['rss_mb']} MB PSS {s['pss_mb']} MB per worker, min cosine {s['check']['min_cosine']:.6f}",
                  flush=True)
            live[runtimes] = (again, s)
        for r in range(args.rounds):
            order = list(live.values())[r % len(live):] + list(live.values())[:r % len(live)]
            for srv, s in order:
                n5, sat, cpu = n5_then_saturation(srv, names, args.duration)
                s["n5"].append(n5.to_dict())
                s["saturation"].append({**sat.to_dict(), **cpu})
                print(f"   {s['runtimes']:5s} round {r + 1}: N=5 {n5.images_per_s:6.2f} img/s (mean "
                      f"{(n5.latency.mean if n5.latency else 0) / 1000:.2f}s), saturation {sat.images_per_s:6.2f} "
                      f"img/s (CPU: workers {cpu['workers_cpu_pct']}%, busy {cpu['busy_cpu_pct']}%), errors "
                      f"{n5.errors + sat.errors}", flush=True)
        out["servers"] = {k: s for k, (_, s) in live.items()}
    return out


def n5_then_saturation(srv: GunicornServer, names: list[str], duration: float) -> tuple[Any, Any, dict[str, float]]:
    """The seed's N=5 (five albums at once), then saturation: k6's open loop at 1.3x that N=5 rate (a faster server
    is offered more) for ``duration`` seconds, with the workers' and the machine's CPU meanwhile."""
    n5 = k6.run_closed(srv.url, names, 5)
    rate = max(1, round(1.3 * n5.images_per_s * 60 / len(names)))
    sat, cpu = cpu_window(srv.worker_pids, functools.partial(k6.run_open, srv.url, names, rate, duration,
                                                             max_inflight=8, graceful_stop_s=120))
    return n5, sat, cpu


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.mean(values) if values else None


def rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    table = []
    for m in doc["models"]:
        base = m["servers"].get("torch", {})
        for s in m["servers"].values():
            sat, sat0 = _mean(s["saturation"], "images_per_s"), _mean(base.get("saturation", []), "images_per_s")
            n5 = statistics.mean(r["latency"]["mean"] for r in s["n5"] if r["latency"]) / 1000 if s["n5"] else None
            n50 = [r["latency"]["mean"] for r in base.get("n5", []) if r["latency"]]
            table.append({
                "model": m["model"], "server": " ".join(f"{k.removeprefix('GREENSERVE_')}={v}" for k, v in s["env"].items()),
                "image tower serves": s.get("image"),
                "saturation img/s": f"{sat:.1f}" if sat else "-", "x torch": f"{sat / sat0:.2f}" if sat and sat0 else "-",
                "x bare bf16": f"{sat / m['bare_bf16_images_per_s']:.2f}" if sat else "-",
                "CPU % workers / busy": "/".join(f"{v:.0f}" if v else "-" for v in (
                    _mean(s["saturation"], "workers_cpu_pct"), _mean(s["saturation"], "busy_cpu_pct"))),
                "N=5 mean s": f"{n5:.2f}" if n5 else "-",
                "N=5 x torch": f"{n5 / (statistics.mean(n50) / 1000):.2f}" if n5 and n50 else "-",
                "start first / cached s": f"{s['start_first_s']} / {s['start_cached_s']}",
                "conversions first / cached": f"{s['conversions_first']} / {s['conversions_cached']}",
                "RSS / PSS MB per worker": f"{s['rss_mb']} / {s['pss_mb']}",
                "min cosine to float32": f"{s['check']['min_cosine']:.6f}"})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--quick", action="store_true", help="6 photos of 512 px, one short round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=20.0, help="saturation's open loop, seconds")
    parser.add_argument("--clip-runtimes", default="openvino",
                        help="GREENSERVE_RUNTIMES of a CLIP's second server (auto would keep it on torch)")
    parser.add_argument("--max-side", type=int, help="the album's photos at most this many pixels on their longer "
                        "side (1440: what a library's previews or resized uploads weigh); unset: phone photos")
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.max_side = 1, 6.0, 512
    info = report.start("bench.runtime_bench", args.models, argv)
    album = OUT_DIR / f"album-{6 if args.quick else 30}-{args.max_side}" if args.max_side else DEFAULT_DIR
    blobs = load_album(ensure_album(album, count=6 if args.quick else 30, max_side=args.max_side))
    started = time.monotonic()
    doc: dict[str, Any] = {"machine": info, "album": report.album_facts(blobs), "models": []}
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        doc["models"].append(one_model(model, args, info["cores"], blobs, album))
    native = [f for f in info["cpu_flags"] if f in ("avx512_bf16", "amx_bf16")]
    print(f"\n# runtimes served: {info['cores']} cores ({info['cpu']}), native bf16: {', '.join(native) or 'none'}; "
          f"torch {info['torch']}; album {doc['album']['photos']} JPEGs; {time.monotonic() - started:.0f} s\n")
    print(report.rows_table(rows(doc)), flush=True)
    whole = not (args.quick or args.max_side) and args.models == ",".join(MODELS)
    default_dir = DOCS_DIR if whole else OUT_DIR  # docs/ holds the phone photos' run of every model
    report.write_json((args.out_dir or default_dir) / "runtimes-served.json", doc)
    bad = [m["model"] for m in doc["models"] for s in m["servers"].values() if s["check"]["min_cosine"] < COSINE_FAIL]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
