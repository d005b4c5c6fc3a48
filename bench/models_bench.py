"""Several models in one server: ``python -m bench.models_bench [--clip open_clip:ViT-B-32] [--seconds 30] [--reloads 3]``.

CLIP (seeded random weights) and resnet18 from saved files, the 30-photo album on the local image host, one
worker on every core, the embedding cache off. Three questions, each a ratio measured in this run:

- reload   CLIP's image tower after an idle TTL (2 s): the one-photo request that brings it back from its mapped
           file, minus the same request warm, against the model's first load (goal: <= 2 s for ViT-B/32)
- mixed    both models in one server under load together (a closed loop of 2 clients on each), each model's
           images/s as a share of its images/s alone on the same server; the shares' sum (goal: >= 0.9)
- memory   the two-model server's worker (PSS, after an album through each model) against a one-model server
           of each, summed

Prints the command, the machine and a table; writes bench/out/models.json.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import requests

from bench import bare
from bench.album import DEFAULT_DIR, ensure_album, load_album
from bench.report import rows_table, start, write_json
from harness.imagehost import ImageHost
from harness.launch import ROOT, GunicornServer
from harness.load import Load

OUT = ROOT / "bench" / "out"
LIMITS = {"GREENSERVE_MAX_QUEUE_IMAGES": "512", "GREENSERVE_REQUEST_TIMEOUT_S": "300", "GREENSERVE_WORKERS": "1"}


def pss_bytes(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines() if x.startswith("Pss:"))
    return int(line.split()[1]) * 1024


def timed(url: str, body: dict[str, Any]) -> float:
    t0 = time.monotonic()
    r = requests.post(url + "/v1/embeddings", json=body, timeout=300)
    r.raise_for_status()
    return time.monotonic() - t0


def card(url: str, model: str) -> dict[str, Any]:
    return next(c for c in requests.get(url + "/v1/models", timeout=30).json()["data"] if c["id"] == model)


def reloads(srv: GunicornServer, photo: str, n: int) -> dict[str, Any]:
    one = {"images": [photo], "model": "clip"}
    warm = statistics.median(timed(srv.url, one) for _ in range(5))
    times = []
    for _ in range(n):
        while card(srv.url, "clip")["residency"]["image"]["state"] != "unloaded":
            time.sleep(0.2)
        times.append(timed(srv.url, one) - warm)
    return {"first_load_s": round(card(srv.url, "clip")["load_seconds"], 2), "warm_one_photo_s": round(warm, 3),
            "reload_s": [round(t, 2) for t in times]}


def images_per_s(url: str, bodies: dict[str, dict[str, Any]], seconds: float) -> dict[str, float]:
    loads = {name: Load(url, 2, body, duration_s=seconds, timeout_s=300).start() for name, body in bodies.items()}
    out = {}
    for name, load in loads.items():
        load.join()
        ok = [d for d in load.done if d.status == 200]
        out[name] = round(sum(d.images for d in ok) / seconds, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clip", default="open_clip:ViT-B-32")
    parser.add_argument("--seconds", type=float, default=30.0, help="each load window")
    parser.add_argument("--reloads", type=int, default=3)
    args = parser.parse_args(argv)
    info = start("bench.models_bench", args.clip, argv)
    blobs = load_album(ensure_album(DEFAULT_DIR))
    names = list(blobs)
    clip = bare.save_random_weights(args.clip, OUT / "weights" / f"{bare.slug(args.clip)}-seed0.pt")
    cls = bare.save_random_weights("resnet18", OUT / "weights" / "resnet18-seed0.pt")
    result: dict[str, Any] = {"machine": info}
    with ImageHost(blobs) as host, contextlib.ExitStack() as stack:
        base = {"GREENSERVE_IMAGE_BASE_URL": host.base_url, **LIMITS}
        both = f"clip={args.clip}@{clip},cls=resnet18@{cls}"
        short = stack.enter_context(GunicornServer({**base, "GREENSERVE_MODELS": both.replace(",", ";image=ttl:2,", 1)},
                                                   cache="off", workers=1, ready_timeout_s=300))
        result["reload"] = reloads(short, names[0], args.reloads)
        stack.close()
        two = stack.enter_context(GunicornServer({**base, "GREENSERVE_MODELS": both}, cache="off", workers=1,
                                                 ready_timeout_s=300))
        bodies = {m: {"images": names, "model": m} for m in ("clip", "cls")}
        for body in bodies.values():
            timed(two.url, body)  # warm: the album's shapes once, each tower's pages touched
        alone = {m: images_per_s(two.url, {m: bodies[m]}, args.seconds)[m] for m in bodies}
        mixed = images_per_s(two.url, bodies, args.seconds)
        shares = {m: round(mixed[m] / alone[m], 3) for m in bodies}
        result["mixed"] = {"alone": alone, "mixed": mixed, "shares": shares, "sum": round(sum(shares.values()), 3)}
        two_pss = sum(pss_bytes(pid) for pid in two.worker_pids())
        stack.close()
        singles = {}
        for m, spec in (("clip", f"clip={args.clip}@{clip}"), ("cls", f"cls=resnet18@{cls}")):
            one = stack.enter_context(GunicornServer({**base, "GREENSERVE_MODELS": spec}, cache="off", workers=1,
                                                     ready_timeout_s=300))
            timed(one.url, bodies[m])
            singles[m] = sum(pss_bytes(pid) for pid in one.worker_pids())
            stack.close()
        result["memory"] = {"two_models_mb": round(two_pss / 1e6), "clip_alone_mb": round(singles["clip"] / 1e6),
                            "cls_alone_mb": round(singles["cls"] / 1e6),
                            "ratio": round(two_pss / sum(singles.values()), 3)}
    r, m, mem = result["reload"], result["mixed"], result["memory"]
    print(rows_table([
        {"question": "reload", "figure": f"first load {r['first_load_s']} s; reloads {r['reload_s']} s "
                                         f"(one photo warm {r['warm_one_photo_s']} s)"},
        {"question": "mixed", "figure": f"alone {m['alone']} img/s; mixed {m['mixed']}; shares {m['shares']}, "
                                        f"sum {m['sum']}"},
        {"question": "memory", "figure": f"two models {mem['two_models_mb']} MB; alone {mem['clip_alone_mb']} + "
                                         f"{mem['cls_alone_mb']} MB; ratio {mem['ratio']}"}]), flush=True)
    write_json(OUT / "models.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
