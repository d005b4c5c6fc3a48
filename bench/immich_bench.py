"""immich's load shape: ``python -m bench.immich_bench [--clip open_clip:ViT-B-32] [--seconds 20] [--search-seconds 60]
[--clients 1,2,4,8,16] [--workers N]``.

One CLIP (seeded random weights) served under immich's name the immich way (``ViT-B-32__openai=open_clip:
ViT-B-32__openai@<weights>``, as deploy/immich serves it: immich's preprocessing), the embedding cache off,
``--workers`` workers (unset: a worker per core, as deploy/immich runs it: 2 on 2 cores served 8 one-photo clients
1.17x what one 2-thread worker did). Every photo is a 1440-px preview JPEG (the shorter side, as immich's preview
setting makes them), each request a different one. Each load window also reads the workers' CPU and the machine's.
Measured in this run:

- backfill   1, 2, 4, 8, 16 clients, each posting one preview per ``POST /predict`` (``clip``/``visual``, the multipart
             body immich's server builds), back to back: images/s, p50/p99; against the same server's album
             throughput (2 clients posting the previews 30 at a time to ``/v1/embeddings``; goal: >= 0.9x from 8
             clients up)
- search     one ``clip``/``textual`` query every 2 s, idle and beside 8 backfill clients: p50/p99 (goal: p99 <= 2x
             idle; p50 <= idle + one block of the image forward: the server's mean forward time over the
             tower's residual blocks)
- immich     the same weights exported as immich's exporter does (``harness.immich``), run as immich's ML service
             runs them: ``onnxruntime`` at batch 1 with its session options (CPU arena off, 1 inter-op and 2
             intra-op threads) in a pool of one thread per core, each job immich's decode, crop and normalise,
             then the model. In this process, without HTTP: immich's best case. Images/s at the same client
             counts and the query's p50/p99 beside 8 clients; greenserve's images/s over it (goal: >= 3x on a
             CPU with native bf16, >= 1.5x without)

Prints the command, the machine (its CPU flags say whether it has native bf16) and a table; writes
bench/out/immich.json.
"""

from __future__ import annotations

import argparse
import http.client
import io
import itertools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests
from PIL import Image

from bench import bare
from bench.album import Photo, render
from bench.cpu_window import cpu_window
from bench.report import rows_table, start, write_json
from harness import images
from harness.imagehost import ImageHost
from harness.launch import ROOT, GunicornServer
from harness.load import Load
from harness.stats import percentile

OUT = ROOT / "bench" / "out"
PREVIEW = 1440  # immich's default preview size: the shorter side
PREVIEW_QUALITY = 80  # immich's default preview JPEG quality
PHONE_SIDE = 4032  # the longer side of the originals the previews are made from (a 12 MP phone photo)
SIZES = ((4, 3), (3, 4), (16, 9), (9, 16), (1, 1), (3, 2))
QUERIES = ("a dog on a beach", "birthday cake with candles", "snow in the mountains", "my grandmother's kitchen",
           "red car parked in the street", "sunset over the sea", "children playing football", "a cat asleep")
LIMITS = {"GREENSERVE_MAX_QUEUE_IMAGES": "512", "GREENSERVE_REQUEST_TIMEOUT_S": "300"}


def previews(count: int) -> dict[str, bytes]:
    """``count`` different previews made as immich's server makes them: a phone-sized photo (the album's renderer)
    resized with a Lanczos filter to 1440 px on its shorter side, saved as JPEG at quality 80 with the chroma whole
    (4:4:4, as immich's server writes it from quality 80 on: ``harness.images.preview``); 0.45-0.75 MB. Rendered
    at 1440 px directly, a preview kept the original's full-resolution grain and weighed 0.8-1.4 MB."""
    out = {}
    for i in range(count):
        a, b = SIZES[i % len(SIZES)]
        w, h = (PHONE_SIDE, PHONE_SIDE * b // a) if a >= b else (PHONE_SIDE * a // b, PHONE_SIDE)
        original = Image.open(io.BytesIO(render(Photo(f"original{i:03d}.jpg", w, h, 1, seed=5000 + i))))
        scale = PREVIEW / min(w, h)
        preview = original.resize((round(w * scale), round(h * scale)), Image.Resampling.LANCZOS)
        # sharp keeps the chroma whole from quality 80 on
        out[f"preview{i:03d}.jpg"] = images.encode(preview, "JPEG", quality=PREVIEW_QUALITY, subsampling=0)
    return out


def multipart(entries: dict[str, Any], field: str, value: bytes) -> tuple[bytes, str]:
    """The body Node's FormData writes for immich's request: ``entries`` then the image (a nameless Blob) or text."""
    boundary = "----formdata-undici-0" + uuid.uuid4().hex[:22]
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="entries"\r\n\r\n{json.dumps(entries)}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"')
    head += '; filename="blob"\r\nContent-Type: application/octet-stream\r\n\r\n' if field == "image" else "\r\n\r\n"
    body = head.encode() + value + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


class Predict:
    """One keep-alive connection posting immich's requests; ``post`` returns the seconds it took."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=300)

    def post(self, body: tuple[bytes, str]) -> float:
        t0 = time.monotonic()
        try:
            resp, answer = self._exchange(body)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            # the server closed the idle keep-alive connection first: once more on a new one, as clients do
            self.conn.close()
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
            t0 = time.monotonic()
            resp, answer = self._exchange(body)
        if resp.status != 200 or not json.loads(answer)["clip"].startswith("["):
            raise RuntimeError(f"/predict answered {resp.status}: {answer[:200]!r}")
        return time.monotonic() - t0

    def _exchange(self, body: tuple[bytes, str]) -> tuple[http.client.HTTPResponse, bytes]:
        self.conn.request("POST", "/predict", body=body[0], headers={"Content-Type": body[1]})
        resp = self.conn.getresponse()
        return resp, resp.read()


def closed_loop(clients: int, seconds: float, job: Callable[[int, int], float]) -> dict[str, Any]:
    """``clients`` threads calling ``job(client, i)`` (the seconds one request took) back to back for ``seconds``."""
    done: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def run(client: int) -> None:
        for i in itertools.count():
            if time.monotonic() >= deadline:
                return
            took = job(client, i)
            with lock:
                done.append(took)

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"clients": clients, "images_per_s": round(len(done) / (time.monotonic() - t0), 2), **latency(done)}


def latency(samples: list[float]) -> dict[str, Any]:
    return {"n": len(samples), "p50_ms": round(1000 * (percentile(samples, 0.5) or 0), 1),
            "p99_ms": round(1000 * (percentile(samples, 0.99) or 0), 1)}


def every_2s(seconds: float, query: Callable[[int], float]) -> dict[str, Any]:
    """A search every 2 s for ``seconds``, as people type them: the latencies."""
    took = []
    for i in range(int(seconds / 2)):
        t0 = time.monotonic()
        took.append(query(i))
        time.sleep(max(0.0, 2.0 - (time.monotonic() - t0)))
    return latency(took)


def beside(load: Callable[[], Any], measure: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], Any]:
    """``measure()`` while ``load()`` runs in a thread (started 2 s before, so the backfill is under way)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(load()))
    thread.start()
    time.sleep(2)
    measured = measure()
    thread.join()
    return measured, result[0]


def metric_sum(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def greenserve(args: argparse.Namespace, name: str, weights: Path, photos: dict[str, bytes]) -> dict[str, Any]:
    clip = f"{name}=open_clip:{name}@{weights}"  # the immich way, as deploy/immich serves it: immich's preprocessing
    names = list(photos)
    visual = [multipart({"clip": {"visual": {"modelName": name}}}, "image", photos[n]) for n in names]
    texts = [multipart({"clip": {"textual": {"modelName": name}}}, "text", q.encode()) for q in QUERIES]
    out: dict[str, Any] = {}
    env = {"GREENSERVE_MODELS": clip, **LIMITS, "GREENSERVE_RUNTIMES": args.runtimes}
    if args.torch_threads:
        env["GREENSERVE_TORCH_THREADS"] = str(args.torch_threads)
    with ImageHost(photos) as host, GunicornServer({**env, "GREENSERVE_IMAGE_BASE_URL": host.base_url},
                                                   workers=args.workers, cache="off", ready_timeout_s=600) as srv:
        out["image_tower"] = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["precision"][
            "towers"]["image"]["numerics"]
        conns = [Predict(srv.url) for _ in range(max(args.clients) + 1)]
        for i, body in enumerate(visual[:8]):  # warm: the workers' shapes once
            conns[i % 2].post(body)
        album = {"images": names[:30], "model": name}
        with Load(srv.url, 2, album, duration_s=args.seconds, timeout_s=300) as load:
            _, out["album_cpu"] = cpu_window(srv.worker_pids, load.join)
        ok = [d for d in load.done if d.status == 200]
        out["album_images_per_s"] = round(sum(d.images for d in ok) / args.seconds, 2)

        def backfill(clients: int, seconds: float = args.seconds) -> dict[str, Any]:
            done, cpu = cpu_window(srv.worker_pids, lambda: closed_loop(
                clients, seconds, lambda c, i: conns[c].post(visual[(c * 7 + i) % len(visual)])))
            return {**done, **cpu}

        out["backfill"] = [backfill(c) for c in args.clients]
        search = conns[-1]
        out["search_idle"] = every_2s(args.search_seconds, lambda i: search.post(texts[i % len(texts)]))
        batches0 = metric_sum(srv.url, "greenserve_batch_seconds_count")
        seconds0 = metric_sum(srv.url, "greenserve_batch_seconds_sum")
        during, load8 = beside(lambda: backfill(8, args.search_seconds + 4),
                               lambda: every_2s(args.search_seconds, lambda i: search.post(texts[-1 - i % len(texts)])))
        forward_s = (metric_sum(srv.url, "greenserve_batch_seconds_sum") - seconds0) / max(
            1.0, metric_sum(srv.url, "greenserve_batch_seconds_count") - batches0)
        out["search_beside_8"] = {**during, "backfill_images_per_s": load8["images_per_s"]}
        out["mean_forward_ms"] = round(1000 * forward_s, 1)
        out["one_block_ms"] = round(1000 * forward_s / args.blocks, 1)
    return out


def immich_ort(args: argparse.Namespace, weights: Path, photos: dict[str, bytes]) -> dict[str, Any]:
    """The same weights as immich runs them today (see the module's docstring)."""
    import open_clip
    import torch

    from harness.immich import ImmichClip, export

    arch = args.clip.split(":", 1)[1]
    directory = OUT / "immich-onnx" / bare.slug(args.clip)
    if not (directory / "textual" / "model.onnx").is_file():
        clip = open_clip.create_model(arch, pretrained=None)
        clip.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        export(clip.eval(), directory)
    immich = ImmichClip(directory)
    blobs = list(photos.values())
    pool = ThreadPoolExecutor(os.cpu_count() or 2)  # immich_ml's request threads: one per core

    def image(c: int, i: int) -> float:
        t0 = time.monotonic()
        pool.submit(immich.image, blobs[(c * 7 + i) % len(blobs)]).result()
        return time.monotonic() - t0

    def text(i: int) -> float:
        t0 = time.monotonic()
        pool.submit(immich.text, QUERIES[i % len(QUERIES)]).result()
        return time.monotonic() - t0

    for i in range(4):
        image(0, i)
    out: dict[str, Any] = {"backfill": [closed_loop(c, args.seconds, image) for c in args.clients]}
    out["search_idle"] = every_2s(args.search_seconds, text)
    during, load8 = beside(lambda: closed_loop(8, args.search_seconds + 4, image),
                           lambda: every_2s(args.search_seconds, text))
    out["search_beside_8"] = {**during, "backfill_images_per_s": load8["images_per_s"]}
    pool.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clip", default="open_clip:ViT-B-32")
    parser.add_argument("--runtimes", default="auto", help="GREENSERVE_RUNTIMES: auto (a CLIP stays on torch), openvino, torch")
    parser.add_argument("--tag", default="openai", help="the pretrained tag in immich's model name")
    parser.add_argument("--seconds", type=float, default=20.0, help="each backfill window")
    parser.add_argument("--search-seconds", type=float, default=60.0,
                        help="each search window (30 queries: a p99 of 10 is their worst one)")
    parser.add_argument("--workers", type=int, help="GREENSERVE_WORKERS (torch threads: cores // workers); unset: a "
                        "worker per core")
    parser.add_argument("--torch-threads", type=int, help="GREENSERVE_TORCH_THREADS (unset: cores // workers)")
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--blocks", type=int, default=12, help="residual blocks of the image tower (ViT-B/32: 12)")
    args = parser.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")]
    info = start("bench.immich_bench", args.clip, argv)
    args.workers = args.workers or info["cores"]
    name = f"{args.clip.split(':', 1)[1]}__{args.tag}"
    photos = previews(48)
    weights = bare.save_random_weights(args.clip, OUT / "weights" / f"{bare.slug(args.clip)}-seed0.pt")
    result: dict[str, Any] = {"machine": info, "model": name, "workers": args.workers, "torch_threads": args.torch_threads,
                              "greenserve": greenserve(args, name, weights, photos)}
    result["immich_onnxruntime"] = immich_ort(args, weights, photos)
    g, o = result["greenserve"], result["immich_onnxruntime"]
    rows = [{"clients": b["clients"], "greenserve img/s": b["images_per_s"], "p50/p99 ms": f"{b['p50_ms']}/{b['p99_ms']}",
             "x album": round(b["images_per_s"] / g["album_images_per_s"], 2),
             "CPU % workers / busy": f"{b.get('workers_cpu_pct', '-')} / {b.get('busy_cpu_pct', '-')}",
             "immich ORT img/s": ob["images_per_s"], "ORT p50/p99 ms": f"{ob['p50_ms']}/{ob['p99_ms']}",
             "greenserve / ORT": round(b["images_per_s"] / ob["images_per_s"], 2)}
            for b, ob in zip(g["backfill"], o["backfill"], strict=True)]
    cpu = g.get("album_cpu", {})
    threads = args.torch_threads or "cores // workers"
    print(f"{args.workers} worker(s), torch threads {threads}; album (2 clients x 30 previews): "
          f"{g['album_images_per_s']} img/s (CPU % workers / busy {cpu.get('workers_cpu_pct')} / "
          f"{cpu.get('busy_cpu_pct')}); the image tower serves {g.get('image_tower')}")
    print(rows_table(rows))
    print(rows_table([
        {"search (every 2 s)": who, "idle p50/p99 ms": f"{x['search_idle']['p50_ms']}/{x['search_idle']['p99_ms']}",
         "beside 8 clients p50/p99 ms": f"{x['search_beside_8']['p50_ms']}/{x['search_beside_8']['p99_ms']}",
         "p99 x idle": round(x["search_beside_8"]["p99_ms"] / max(0.1, x["search_idle"]["p99_ms"]), 2),
         "backfill img/s meanwhile": x["search_beside_8"]["backfill_images_per_s"]}
        for who, x in (("greenserve", g), ("immich ORT", o))]))
    print(f"greenserve's mean image forward {g['mean_forward_ms']} ms beside 8 clients: one block "
          f"~{g['one_block_ms']} ms", flush=True)
    write_json(OUT / "immich.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
