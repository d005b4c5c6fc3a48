"""bfloat16 vs float32, bare and served: ``python -m bench.dtype_bench [--model resnet50] [--out-dir DIR] [--quick]``.

    1. album      the 30-photo phone album (bench.album) on a local image host; --quick: 6 photos of 512 px
    2. weights    one seeded random state dict (bench.bare); every bare run and every server loads it
    3. yardstick  the bare pipeline (bench.bare: decode_and_crop + one batched forward, no server) in float32
                  and in bfloat16 autocast, cores x 1 (and 1 x cores); float32's embeddings are the reference
    4. servers    greenserve in compare's "cores x1 defaults" design, one per GREENSERVE_DTYPE of --dtypes
                  (default auto,float32; --with-pinned-bf16 adds bfloat16), all started at once; each one's
                  dtype as it reports it (GET /v1/models: dtype, precision), its album embeddings checked
                  against the reference (bench.equivalence)
    5. rounds     interleaved, so the shared machine's drift lands on all alike: per round the yardstick,
                  then on every server in rotating order saturation (k6 open loop at 1.3x the bare images/s
                  of the dtype it chose, as compare's saturation step), then the seed's N=5 (five albums at
                  once, one request each); /healthz probed all along. The yardstick once more at the end
    6. report     the command, the machine (CPU flags: avx512_bf16, amx_bf16), two tables; JSON in --out-dir
                  as dtype-<model>.json

Ratios are the result (x bare fp32, x bare bf16): absolute figures drift on a shared machine. Exits 1 if a
server failed to start or to serve, or served wrong embeddings: a min cosine to the reference below 0.999 or
a photo nearer another's reference (bf16 lands near 0.9999: below 0.99999 is noted, not failed), or, for a
server that chose float32, anything outside bench.equivalence's tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import requests

from bench import bare, compare, equivalence, k6, report
from bench.album import DEFAULT_DIR, ensure_album, load_album
from bench.asyncio_designs.server import UvicornServer
from bench.compare import DOCS_DIR, GREENSERVE_LIMITS, OUT_DIR, READY_TIMEOUT_S, fetch_embeddings
from harness.imagehost import ImageHost
from harness.launch import GunicornServer

BARE_DTYPES = bare.DTYPES  # float32, bfloat16
COSINE_FAIL = 0.999  # below it a server serves other embeddings than the model's, whatever its dtype
COSINE_NOTE = 0.99999  # bf16 autocast lands near 0.9999: noted in the table, not a failure


@dataclass(frozen=True)
class Plan:
    name: str
    model: str
    album_count: int
    album_max_side: int | None  # None: phone sizes (up to 12 MP)
    rounds: int  # each: the yardstick, then every server's saturation step, then every server's N=5
    bare_reps: int
    both_layouts: bool  # the yardstick in 1 x cores too, beside cores x 1 (the servers' layout)
    open_duration_s: float  # saturation's open loop, at least (a slow dtype's low rate stretches it)
    max_inflight: int  # saturation: most albums in flight; later arrivals are dropped (and counted)
    bare_at_end: bool = True
    n: int = 5  # the seed's closed run: N users x 1 request of the album, all at once
    overload: float = 1.3  # saturation: offered images/s as a multiple of the bare images/s in that dtype


FULL = Plan("full", "resnet50", 30, None, rounds=2, bare_reps=2, both_layouts=True, open_duration_s=15.0,
            max_inflight=8)
QUICK = Plan("quick", "resnet18", 6, 512, rounds=1, bare_reps=1, both_layouts=False, open_duration_s=4.0,
             max_inflight=4, bare_at_end=False)


def bare_round(plan: Plan, weights: Path, album_dir: Path, cores: int, *, when: str, flip: bool = False,
               refs: dict[str, Path] | None = None) -> list[dict[str, Any]]:
    """The bare pipeline in both dtypes (their order flips every other round) and the plan's layouts;
    ``refs`` gets each dtype's embeddings from the first layout."""
    layouts = [(cores, 1)] + ([(1, cores)] if plan.both_layouts and cores > 1 else [])
    rows = []
    for dtype in BARE_DTYPES[::-1] if flip else BARE_DTYPES:
        for i, (p, t) in enumerate(layouts):
            out = refs[dtype] if refs is not None and i == 0 else None
            r = bare.measure(plan.model, weights, album_dir, processes=p, threads=t, reps=plan.bare_reps,
                             out=out, dtype=dtype)
            rows.append({"when": when, "dtype": dtype, "layout": f"{p}x{t}", **r})
            print(f"   bare {dtype:8s} {p}x{t}  {r['images_per_s']:7.2f} img/s  ({when}, load "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
    return rows


def bare_best(rows: list[dict[str, Any]], dtype: str) -> float | None:
    """The dtype's best layout, averaged over the rounds it was measured in (as compare's yardstick)."""
    best: dict[str, float] = {}
    for b in rows:
        if b["dtype"] == dtype:
            best[b["when"]] = max(best.get(b["when"], 0.0), b["images_per_s"])
    return statistics.mean(best.values()) if best else None


def open_load(plan: Plan, bare_images_per_s: float, n_images: int) -> dict[str, float]:
    """Saturation's open loop for a server whose dtype runs ``bare_images_per_s`` bare."""
    rate = max(1, round(plan.overload * bare_images_per_s * 60 / n_images))
    album_s = n_images / bare_images_per_s
    # at least max_inflight arrivals (a slow dtype's low rate would send only one or two in 15 s), and time
    # for the albums still in flight at the end to finish
    return {"rate_per_min": rate, "duration_s": round(max(plan.open_duration_s, plan.max_inflight * 60 / rate), 1),
            "graceful_stop_s": round(min(300.0, max(60.0, 2 * plan.max_inflight * album_s)))}


def server(requested: str, plan: Plan, weights: Path, base_url: str, cores: int) -> GunicornServer:
    """compare's "greenserve cores x1 defaults" (a worker per core, torch threads left to greenserve, so it
    borrows idle siblings' cores), with its limits and GREENSERVE_DTYPE=requested."""
    env = {"GREENSERVE_MODEL": plan.model, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_IMAGE_BASE_URL": base_url,
           "GREENSERVE_LOG_LEVEL": "info", **GREENSERVE_LIMITS, "GREENSERVE_DTYPE": requested}
    return GunicornServer(env, cache="off", workers=cores, ready_timeout_s=READY_TIMEOUT_S)


def start_servers(dtypes: list[str], plan: Plan, weights: Path, base_url: str, cores: int,
                  stack: contextlib.ExitStack) -> dict[str, str | Exception]:
    """Every server at once (their model loads overlap): requested dtype → URL, or the start-up error."""
    servers: dict[str, GunicornServer | UvicornServer] = {d: server(d, plan, weights, base_url, cores) for d in dtypes}
    return compare.start_servers(servers, stack)  # each start-up error is recorded by check_server


def check_server(requested: str, url: str | Exception, cores: int, names: list[str],
                 reference: np.ndarray) -> dict[str, Any]:
    """The server's record: the dtype it reports, its embeddings checked; a failure is recorded."""
    out: dict[str, Any] = {"label": f"greenserve {cores}x1 defaults", "requested": requested, "dtype": None,
                           "precision": None, "saturation": [], "n5": []}
    try:
        if isinstance(url, Exception):
            raise url
        out["url"] = url
        r = requests.get(url + "/v1/models", timeout=30)
        r.raise_for_status()
        model = r.json()["data"][0]
        out["dtype"], out["precision"] = model["dtype"], model.get("precision")
        emb = fetch_embeddings(url, names)  # also the warm-up with the real album
        out["check_vs_bare"] = equivalence.compare(emb, reference).to_dict()
    except Exception as exc:
        _failed(out, exc)
    print(f"-- GREENSERVE_DTYPE={requested}: dtype {out['dtype']}, precision {json.dumps(out['precision'])}, "
          f"min cosine {out.get('check_vs_bare', {}).get('min_cosine', '-')}", flush=True)
    return out


def run_rounds(plan: Plan, doc: dict[str, Any], names: list[str], yard: tuple[Plan, Path, Path, int]) -> None:
    """Round by round: the yardstick (from round 2; round 1's ran before the servers started), then each
    step on every live server, in rotating order, so no server always runs first after the bare runs."""
    live = [s for s in doc["servers"] if "error" not in s]
    for r in range(plan.rounds):
        if r:
            doc["bare"] += bare_round(*yard, when=f"round {r + 1}", flip=r % 2 == 1)
        for j, kind in enumerate(("saturation", "n5")):
            k = (2 * r + j) % len(live) if live else 0
            for s in live[k:] + live[:k]:
                if "error" not in s:
                    load_step(plan, s, kind, names)


def load_step(plan: Plan, s: dict[str, Any], kind: str, names: list[str]) -> None:
    """One k6 run on the server: saturation (open loop) or N=5 (closed); its row joins the record."""
    try:
        if kind == "n5":
            r = k6.run_closed(s["url"], names, plan.n)
        else:
            o = s["offered"]
            r = k6.run_open(s["url"], names, o["rate_per_min"], o["duration_s"], max_inflight=plan.max_inflight,
                            graceful_stop_s=o["graceful_stop_s"])
    except Exception as exc:
        _failed(s, exc)
        return
    row = {**r.to_dict(), "loadavg": round(os.getloadavg()[0], 2)}
    s[kind].append(row)
    lat, health = row["latency"] or {}, row["health"] or {}
    print(f"   {s['requested']:9s} {kind:10s} {row['images_per_s']:7.2f} img/s  mean {lat.get('mean', 0) / 1000:6.2f}s  "
          f"max {lat.get('max', 0) / 1000:6.2f}s  healthz p99 {health.get('p99', 0):6.0f} ms  errors {row['errors']}  "
          f"dropped {row['dropped']}  load {row['loadavg']}", flush=True)


def _failed(out: dict[str, Any], exc: Exception) -> None:
    msg = f"{type(exc).__name__}: {exc}"
    # a start-up failure carries the server's whole log: its head names the error, its tail the cause
    out["error"] = msg if len(msg) <= 2000 else f"{msg[:300]} [...] {msg[-1500:]}"
    print(f"!! GREENSERVE_DTYPE={out['requested']} failed: {out['error']}", file=sys.stderr, flush=True)


def verdict(s: dict[str, Any]) -> str:
    """"ok", "ok (cosine < 0.99999)" (bf16's level: noted), or why the server fails the benchmark."""
    if "error" in s:
        return "FAILED: " + s["error"].split("\n")[0][:80]
    c = s["check_vs_bare"]
    if c["min_cosine"] < COSINE_FAIL or not c["nearest_is_self"]:
        return "WRONG embeddings"
    if s["dtype"] == "float32" and not c["passed"]:
        return "WRONG embeddings (float32 outside tolerance)"
    return "ok" if c["min_cosine"] >= COSINE_NOTE else f"ok (cosine < {COSINE_NOTE})"


def passed(doc: dict[str, Any]) -> bool:
    return bool(doc["servers"]) and all(verdict(s).startswith("ok") for s in doc["servers"])


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}"


def summary_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per server: saturation as a ratio to the bare pipeline in each dtype, N=5, /healthz, cosine."""
    fp32, bf16 = bare_best(doc["bare"], "float32"), bare_best(doc["bare"], "bfloat16")
    rows = []
    for s in doc["servers"]:
        sat = statistics.mean(r["images_per_s"] for r in s["saturation"]) if s["saturation"] else None
        n5 = [r["latency"] for r in s["n5"] if r["latency"]]
        p99 = [r["health"]["p99"] for r in s["saturation"] + s["n5"] if r["health"]]
        check = s.get("check_vs_bare")
        rows.append({"design": s["label"], "dtype requested": s["requested"], "dtype chosen": s["dtype"] or "-",
                     "saturation img/s": _num(sat, 1), "x bare fp32": _ratio(sat, fp32), "x bare bf16": _ratio(sat, bf16),
                     "N=5 mean s": _num(statistics.mean(x["mean"] for x in n5) / 1000 if n5 else None, 2),
                     "N=5 max s": _num(max(x["max"] for x in n5) / 1000 if n5 else None, 2),
                     "healthz p99 ms": _num(max(p99) if p99 else None, 0),
                     "errors": sum(r["errors"] + r["health_errors"] for r in s["saturation"] + s["n5"]),
                     "min cosine": _num(check["min_cosine"] if check else None, 6), "verdict": verdict(s)})
    return rows


def bare_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The yardstick per dtype and layout: every round's images/s, their mean, and bf16 over fp32."""
    keys = list(dict.fromkeys((b["dtype"], b["layout"]) for b in doc["bare"]))
    mean = {k: statistics.mean(b["images_per_s"] for b in doc["bare"] if (b["dtype"], b["layout"]) == k)
            for k in keys}
    return [{"bare dtype": d, "layout": lay, "img/s per round": ", ".join(
                f"{b['images_per_s']:.2f}" for b in doc["bare"] if (b["dtype"], b["layout"]) == (d, lay)),
             "mean img/s": f"{mean[(d, lay)]:.2f}", "x float32": _ratio(mean[(d, lay)], mean.get(("float32", lay)))}
            for d, lay in keys]


def report_text(doc: dict[str, Any]) -> str:
    m, a, c = doc["machine"], doc["album"], doc.get("bare_bf16_check") or {}
    native = [f for f in m["cpu_flags"] if f in ("avx512_bf16", "amx_bf16")]
    notes = [f"- GREENSERVE_DTYPE={s['requested']}: precision {json.dumps(s['precision'])}" for s in doc["servers"]
             if s.get("precision")] + [f"- GREENSERVE_DTYPE={s['requested']}: {s['error']}" for s in doc["servers"]
                                       if "error" in s]
    parts = [f"# float32 vs bfloat16 ({doc['plan']['name']}, {m['model']}): {m['cores']} cores ({m['cpu']}), native "
             f"bf16: {', '.join(native) or 'none'}; torch {m['torch']}; album {a['photos']} JPEGs up to "
             f"{a['max_megapixels']} MP; {doc.get('seconds', 0):.0f} s in all",
             report.rows_table(bare_rows(doc)),
             f"bare bfloat16 vs bare float32 embeddings: min cosine {c.get('min_cosine', '-')}, min centered cosine "
             f"{c.get('min_centered_cosine', '-')}", report.rows_table(summary_rows(doc)) if doc["servers"] else ""]
    return "\n\n".join(parts + (["## Notes", "\n".join(notes)] if notes else []))


def run(plan: Plan, dtypes: list[str], out_dir: Path, argv: list[str] | None = None) -> dict[str, Any]:
    """The whole benchmark; returns (and writes) the results document."""
    started = time.monotonic()
    info = report.start("bench.dtype_bench", plan.model, argv)
    cores = info["cores"]
    album_dir = DEFAULT_DIR if (plan.album_count, plan.album_max_side) == (30, None) else \
        OUT_DIR / f"album-{plan.album_count}-{plan.album_max_side}"
    blobs = load_album(ensure_album(album_dir, count=plan.album_count, max_side=plan.album_max_side))
    names = list(blobs)
    weights = bare.save_random_weights(plan.model, OUT_DIR / "weights" / f"{bare.slug(plan.model)}-seed0.pt")
    refs = {d: OUT_DIR / f"reference-dtype-{plan.name}-{bare.slug(plan.model)}-{d}.npy" for d in BARE_DTYPES}
    doc: dict[str, Any] = {"plan": dataclasses.asdict(plan), "dtypes": dtypes, "machine": info,
                           "album": report.album_facts(blobs), "servers": []}
    yard = (plan, weights, album_dir, cores)
    doc["bare"] = bare_round(*yard, when="round 1", refs=refs)
    reference = np.load(refs["float32"])
    doc["bare_bf16_check"] = equivalence.compare(np.load(refs["bfloat16"]), reference).to_dict()
    with ImageHost(blobs) as host, contextlib.ExitStack() as stack:
        urls = start_servers(dtypes, plan, weights, host.base_url, cores, stack)
        for requested, url in urls.items():
            s = check_server(requested, url, cores, names, reference)
            base = bare_best(doc["bare"], s["dtype"] if s["dtype"] in BARE_DTYPES else "float32")
            s["offered"] = open_load(plan, base or 1.0, len(names))
            doc["servers"].append(s)
        run_rounds(plan, doc, names, yard)
    if plan.bare_at_end:
        doc["bare"] += bare_round(*yard, when="end", flip=plan.rounds % 2 == 1)
    for s in doc["servers"]:
        s.pop("url", None)
    doc["seconds"] = round(time.monotonic() - started, 1)
    print(report_text(doc), flush=True)
    report.write_json(out_dir / f"dtype-{bare.slug(plan.model)}.json", doc)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="resnet18, 6 photos of 512 px, one short round (~2 min)")
    parser.add_argument("--model", help="override the plan's model (resnet50 in the full run)")
    parser.add_argument("--dtypes", default="auto,float32", help="the servers' GREENSERVE_DTYPE values, comma-separated")
    parser.add_argument("--with-pinned-bf16", action="store_true", help="also a server with GREENSERVE_DTYPE=bfloat16")
    parser.add_argument("--out-dir", type=Path, help="where dtype-<model>.json goes (default docs/; --quick: bench/out/)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.model:
        plan = dataclasses.replace(plan, model=args.model)
    dtypes = list(dict.fromkeys(d.strip() for d in args.dtypes.split(",") if d.strip()))
    if args.with_pinned_bf16 and "bfloat16" not in dtypes:
        dtypes.append("bfloat16")
    if not dtypes:
        parser.error("--dtypes names no dtype")
    doc = run(plan, dtypes, args.out_dir or (OUT_DIR if args.quick else DOCS_DIR), argv)
    ok = passed(doc)
    print("every server started and served the model's embeddings" if ok else "FAILED: see the verdicts above",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
