"""CLIP saturation in the steady state: ``python -m bench.saturation [--model M] [--rounds 3] [--seconds 45] [--root R]...``.

``make compare``'s saturation step is an open loop of 15 s: six albums, so its served images/s includes the
first album's fill (fetch and decode before the first forward) and the last album's tail, when at most one
album is in flight. This measures the other half of that figure: the server kept busy. greenserve in both
layouts (1 worker x all cores, a worker per core; float32 pinned, as the bare run), every server up at
once; then rounds, each one: the bare pipeline in both layouts (``bench.bare``), and each server under a
closed loop of ``2 x workers + 1`` clients posting the album (URLs on the local image host) for
``--seconds``, in rotating order. Served images/s counts only the albums that finished after every client's
first (the steady window) and is quoted against the best bare layout of the same round. ``--root`` twice
(an earlier commit's worktree, then this checkout) runs both commits' servers side by side, in turn.

Prints the command, the machine and a table; writes bench/out/saturation.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench import bare
from bench.album import DEFAULT_DIR, ensure_album, load_album
from bench.report import rows_table, start, write_json
from harness.imagehost import ImageHost
from harness.launch import ROOT, GunicornServer
from harness.load import Load

OUT = ROOT / "bench" / "out"
LIMITS = {"GREENSERVE_MAX_QUEUE_IMAGES": "512", "GREENSERVE_REQUEST_TIMEOUT_S": "300", "GREENSERVE_DTYPE": "float32"}


def steady(port: int, body: dict[str, Any], clients: int, seconds: float) -> dict[str, Any]:
    """``clients`` clients posting ``body`` one after another for ``seconds``; images/s after the fill."""
    load = Load(f"http://127.0.0.1:{port}", clients, body, duration_s=seconds, timeout_s=300).start().join()
    failed = [d for d in load.done if d.status != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} albums failed: {failed[0]}")
    t0 = load.deadline - seconds
    done = sorted(d.ended - t0 for d in load.done)
    images = load.done[0].images
    end, fill = done[-1], done[min(clients, len(done)) - 1]
    after = len(done) - min(clients, len(done))
    return {"albums": len(done), "seconds": round(end, 1), "all_images_per_s": round(len(done) * images / end, 2),
            "images_per_s": round(after * images / (end - fill), 2) if after else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="open_clip:ViT-B-32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=45.0, help="per server and round")
    parser.add_argument("--root", type=Path, action="append", help="a checkout whose greenserve runs beside "
                        "the others (repeat it: an earlier commit's worktree and this one, measured in turn)")
    args = parser.parse_args(argv)
    roots = args.root or [ROOT]
    info = start("bench.saturation", args.model, argv)
    cores = info["cores"]
    blobs = load_album(ensure_album(DEFAULT_DIR))
    names = list(blobs)
    body = {"images": names}
    weights = bare.save_random_weights(args.model, OUT / "weights" / f"{bare.slug(args.model)}-seed0.pt")
    layouts = [(1, cores), (cores, 1)] if cores > 1 else [(1, 1)]
    rounds: list[dict[str, Any]] = []
    with ImageHost(blobs) as host, contextlib.ExitStack() as stack:
        servers = {}
        for root in roots:
            for workers, threads in layouts:
                env = {"GREENSERVE_MODEL": args.model, "GREENSERVE_WEIGHTS": str(weights),
                       "GREENSERVE_IMAGE_BASE_URL": host.base_url, "GREENSERVE_TORCH_THREADS": str(threads), **LIMITS}
                where = "" if len(roots) == 1 else f" ({root.resolve().name})"
                servers[f"greenserve {workers}x{threads}{where}"] = (workers, stack.enter_context(
                    GunicornServer(env, cache="off", workers=workers, ready_timeout_s=300, cwd=root)))
        for _, srv in servers.values():
            steady(srv.port, body, 1, 0.1)  # warm: the album's shapes once
        for r in range(args.rounds):
            row: dict[str, Any] = {"round": r + 1}
            for p, t in layouts:
                row[f"bare {p}x{t}"] = bare.measure(args.model, weights, DEFAULT_DIR, processes=p, threads=t,
                                                    reps=2)["images_per_s"]
            labels = list(servers)
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                workers, srv = servers[label]
                row[label] = steady(srv.port, body, 2 * workers + 1, args.seconds)
                print(f"   round {r + 1} {label}: {json.dumps(row[label])}", flush=True)
            rounds.append(row)
            print(f"   round {r + 1}: {json.dumps(row)}", flush=True)
    print(rows_table(_table(rounds, list(servers), layouts)), flush=True)
    write_json(OUT / "saturation.json", {"machine": info, "load_avg_end": os.getloadavg()[0], "rounds": rounds})
    return 0


def _table(rounds: list[dict[str, Any]], labels: list[str], layouts: list[tuple[int, int]]) -> list[dict[str, Any]]:
    rows = []
    for row in rounds:
        best = max(row[f"bare {p}x{t}"] for p, t in layouts)
        out: dict[str, Any] = {"round": row["round"], **{f"bare {p}x{t} img/s": row[f"bare {p}x{t}"]
                                                         for p, t in layouts}}
        for label in labels:
            s = row[label]
            out[f"{label} img/s (x best bare)"] = f"{s['images_per_s']:.2f} ({s['images_per_s'] / best:.2f}x)"
            out[f"{label} incl. fill"] = f"{s['all_images_per_s']:.2f} ({s['all_images_per_s'] / best:.2f}x)"
        rows.append(out)
    return rows


if __name__ == "__main__":
    sys.exit(main())
