"""The comparison's report: machine header, Markdown tables and a PNG chart from the results document.

Tables are Markdown so they can be pasted into docs/BENCHMARKS.md as printed. Throughput is also given
as a ratio to the bare pipeline's best layout measured in the same run ("x bare"): the machine is shared
and absolute figures drift between runs, ratios much less.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from PIL import Image

# The widely shared experiment (FastAPI + uvicorn, CLIP inside async def, 30 images per request):
# mean latency in seconds for N users sending one request each at once.
SEED_NUMBERS = {"source": "FastAPI + uvicorn, CLIP in async def, k6 --vus N --iterations N, 30 images/request",
                "mean_latency_s": {"1": 3.68, "2": 7.05, "3": 10.67, "4": 13.48, "5": 16.55}}


# the CPU features that decide torch's speed (AMX and avx512_bf16: native bf16 matmuls)
MATH_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine(model: str, cores: int) -> dict[str, Any]:
    from bench.k6 import k6_binary

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    k6_version = subprocess.run([k6_binary(), "version"], capture_output=True, text=True).stdout.split("\n")[0]
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return {"commit": _git("rev-parse", "--short", "HEAD"),
            # other work in the same checkout can leave greenserve's code uncommitted while this runs
            "service_uncommitted": bool(_git("status", "--porcelain", "--", "service", "gunicorn.conf.py")),
            "cores": cores, "cpu": cpu, "cpu_flags": [f for f in MATH_FLAGS if f in flags],
            "python": platform.python_version(), "torch": metadata.version("torch"),
            "torchvision": metadata.version("torchvision"), "k6": k6_version.strip(), "model": model,
            "loadavg_at_start": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def start(module: str, model: str, argv: list[str] | None) -> dict[str, Any]:
    """A benchmark's first lines: the command that ran it and the machine (returned, ``cores`` included)."""
    print(f"$ python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]))
    info = machine(model, len(os.sched_getaffinity(0)))
    print(json.dumps(info), flush=True)
    return info


def write_json(path: Path, doc: Any) -> Path:
    """A benchmark's last step: its whole result as JSON at ``path`` (folders made), and a line saying where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}", flush=True)
    return path


def _git(*args: str) -> str:
    from harness.launch import ROOT

    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def album_facts(blobs: dict[str, bytes]) -> dict[str, Any]:
    sizes = []
    for data in blobs.values():
        with Image.open(io.BytesIO(data)) as img:
            sizes.append(img.width * img.height)
    return {"photos": len(blobs), "megabytes": round(sum(map(len, blobs.values())) / 1e6, 1),
            "max_megapixels": round(max(sizes) / 1e6, 1),
            "mean_megapixels": round(sum(sizes) / len(sizes) / 1e6, 1)}


def header(doc: dict[str, Any]) -> str:
    m, a = doc["machine"], doc["album"]
    bare = ", ".join(f"{b['processes']}x{b['threads']}: {b['images_per_s']} img/s ({b.get('when', '')})"
                     for b in doc["bare"])
    commit = f"commit {m.get('commit') or '?'}"
    if m.get("service_uncommitted"):
        commit += " + uncommitted service/ changes"
    layout = "" if m["model"].startswith("open_clip:") else ", channels_last"  # a ViT has no layout to pick
    return (f"# gevent vs asyncio ({doc['plan']['name']}, {commit})\n"
            f"{m['cores']} cores ({m['cpu']}), load avg {m['loadavg_at_start']} at start; python {m['python']}, "
            f"torch {m['torch']}, torchvision {m['torchvision']}, {m['k6']}\n"
            f"model {m['model']} (seeded random weights{layout}); album {a['photos']} JPEGs, "
            f"{a['megabytes']} MB, up to {a['max_megapixels']} MP\n"
            f"bare pipeline (no server, same decode + model): {bare}\n"
            f"open-loop offered rates: {doc['open_rates_per_min']} requests/min")


def rows_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table whose columns are the first row's keys, in order (a later row may leave some out)."""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows])


def _best_bare(doc: dict[str, Any]) -> float:
    """The bare pipeline's best layout, averaged over its runs at the start and at the end."""
    best: dict[str, float] = {}
    for b in doc["bare"]:
        best[b.get("when", "")] = max(best.get(b.get("when", ""), 0.0), b["images_per_s"])
    return sum(best.values()) / len(best) if best else 1.0


def _s(stats: dict[str, Any] | None, key: str) -> str:
    return f"{stats[key] / 1000:.2f}" if stats else "-"


def _ms(stats: dict[str, Any] | None, key: str) -> str:
    return f"{stats[key]:.0f}" if stats else "-"


def closed_table(doc: dict[str, Any]) -> str:
    rows = ["| design | N | mean s | p50 s | p95 s | max s | first s | img/s | x bare | healthz p50 ms "
            "| p99 ms | max ms | errors |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    best = _best_bare(doc)
    for d in doc["designs"]:
        for r in d.get("closed", []):
            lat, h = r["latency"], r["health"]
            rows.append(f"| {d['label']} | {r['vus']} | {_s(lat, 'mean')} | {_s(lat, 'p50')} | {_s(lat, 'p95')} "
                        f"| {_s(lat, 'max')} | {_s(lat, 'min')} | {r['images_per_s']:.1f} "
                        f"| {r['images_per_s'] / best:.2f} | {_ms(h, 'p50')} | {_ms(h, 'p99')} | {_ms(h, 'max')} "
                        f"| {r['errors'] + r['health_errors']} |")
    return "\n".join(rows)


def open_table(doc: dict[str, Any]) -> str:
    rows = ["| design | offered req/min | offered img/s | served img/s | x bare | p50 s | p95 s | healthz p99 ms "
            "| max ms | dropped | errors |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    best, n_images = _best_bare(doc), doc["album"]["photos"]
    for d in doc["designs"]:
        for r in d.get("open", []):
            lat, h = r["latency"], r["health"]
            rows.append(f"| {d['label']} | {r['rate_per_min']:.0f} | {r['rate_per_min'] * n_images / 60:.1f} "
                        f"| {r['images_per_s']:.1f} | {r['images_per_s'] / best:.2f} | {_s(lat, 'p50')} "
                        f"| {_s(lat, 'p95')} | {_ms(h, 'p99')} | {_ms(h, 'max')} | {r['dropped']} "
                        f"| {r['errors'] + r['health_errors']} |")
    return "\n".join(rows)


def check_table(doc: dict[str, Any]) -> str:
    t = doc["tolerance"]
    rows = [f"Tolerance per image: cosine >= {t['cosine']}, centered cosine >= {t['centered_cosine']}, "
            f"max |diff| <= {t['max_abs_diff']}, nearest reference is itself. Different photos of the album: "
            f"{doc['reference_spread']}", "",
            "| design | vs bare: min cos | min centered cos | max abs diff | vs greenserve: min centered cos "
            "| max abs diff | passed |", "|---|---|---|---|---|---|---|"]
    for d in doc["designs"]:
        if "error" in d and "check_vs_bare" not in d:
            rows.append(f"| {d['label']} | - | - | - | - | - | error: {d['error'][:80]} |")
            continue
        b, g = d["check_vs_bare"], d.get("check_vs_greenserve")
        ok = b["passed"] and (g is None or g["passed"])
        vs_g = f"{g['min_centered_cosine']:.6f} | {g['max_abs_diff']:.1e}" if g else "(the baseline) | -"
        rows.append(f"| {d['label']} | {b['min_cosine']:.6f} | {b['min_centered_cosine']:.6f} "
                    f"| {b['max_abs_diff']:.1e} | {vs_g} | {'yes' if ok else 'NO'} |")
    return "\n".join(rows)


def tables(doc: dict[str, Any]) -> str:
    errors = [f"- {d['label']}: {d['error']}" for d in doc["designs"] if "error" in d]
    for d in doc["designs"]:
        for r in d.get("closed", []) + d.get("open", []):
            step = f"N={r['vus']}" if r["mode"] == "closed" else f"open {r['rate_per_min']:.0f}/min"
            errors += [f"- {d['label']} {step}: {sample}" for sample in r.get("error_samples", [])]
    bare = ", ".join(f"{b['processes']}x{b['threads']} {b['images_per_s']} img/s ({b.get('when', '')})"
                     for b in doc["bare"])
    parts = [f"Bare pipeline (the yardstick of the x bare columns, best layout averaged: "
             f"{_best_bare(doc):.1f} img/s): {bare}",
             "## Closed: N users x 1 request of the album, all at once", closed_table(doc),
             "## Open loop: constant arrival rate", open_table(doc), "## Same embeddings?", check_table(doc)]
    if errors:
        parts += ["## Errors", "\n".join(errors)]
    return "\n\n".join(parts)


def chart(doc: dict[str, Any], path: Path) -> Path:
    """Latency vs N per design (with the seed's numbers), /healthz p99 vs N, open-loop images/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5.2))
    for d in doc["designs"]:
        closed = d.get("closed", [])
        if not closed:
            continue
        ns = [r["vus"] for r in closed]
        style = "-" if d["design"] == "greenserve" else "--"
        mean_s = [(r["latency"] or {}).get("mean", 0) / 1000 for r in closed]
        health_p99 = [max((r["health"] or {}).get("p99", 0), 1) for r in closed]  # log axis: no zeros
        ax1.plot(ns, mean_s, style, marker="o", label=d["label"])
        ax2.plot(ns, health_p99, style, marker="o", label=d["label"])
    seed = doc["seed"]["mean_latency_s"]
    ax1.plot([int(n) for n in seed], list(seed.values()), ":", color="black", marker="x",
             label="seed experiment (CLIP, published)")
    ax1.set(xlabel="N users (1 request of the album each, at once)", ylabel="mean latency (s)",
            title="Latency vs N")
    ns = sorted({r["vus"] for d in doc["designs"] for r in d.get("closed", [])})
    ax1.set_xticks(sorted(set(ns) | {int(n) for n in seed}))
    ax2.set_xticks(ns)
    ax2.set(xlabel="N users", ylabel="/healthz p99 (ms, log)", yscale="log", title="/healthz while loaded")
    labels = [d["label"] for d in doc["designs"] if d.get("open")]
    width = 0.8 / max(1, len(doc["open_rates_per_min"]))
    for i, rate in enumerate(doc["open_rates_per_min"]):
        served = [next((r["images_per_s"] for r in d["open"] if r["rate_per_min"] == rate), 0)
                  for d in doc["designs"] if d.get("open")]
        ax3.bar([x + i * width for x in range(len(labels))], served, width,
                label=f"offered {rate * doc['album']['photos'] / 60:.1f} img/s")
    ax3.axhline(_best_bare(doc), color="black", linestyle=":", label="bare pipeline, best layout")
    ax3.set_xticks([x + width * (len(doc["open_rates_per_min"]) - 1) / 2 for x in range(len(labels))])
    ax3.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax3.set(ylabel="served images/s", title="Open loop (constant arrival rate)")
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    m = doc["machine"]
    fig.suptitle(f"gevent vs asyncio - {m['model']}, {m['cores']} cores, torch {m['torch']} "
                 f"({doc['plan']['name']} run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    """``python -m bench.report docs/compare-full.json [--chart out.png]``: re-print a run's tables."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", type=Path)
    parser.add_argument("--chart", type=Path, help="also redraw the chart into this PNG")
    args = parser.parse_args()
    doc = json.loads(args.results.read_text())
    print(header(doc), tables(doc), sep="\n\n")
    if args.chart:
        print(f"wrote {chart(doc, args.chart)}")


if __name__ == "__main__":
    main()
