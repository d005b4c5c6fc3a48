"""CLIP's own benchmarks: what speeds a ViT up on this CPU, and text embeddings per second through the server.

``python -m bench.clip_bench [--model open_clip:ViT-B-32] [--only speed shapes text]``

- speed: the model alone, in this process (torch on every core), timed in alternation, each variant against
  the serving default at the same batch: image batch size 1/8/32; channels_last; the attention fast path
  (``nn.MultiheadAttention``'s fused SDPA kernel) off; bf16 autocast and cast once at 1/8/32; texts trimmed to the batch's longest
  (the default) vs the full 77-token context. Outputs are compared with the default's (cosine).
- shapes: what a batch size not run before costs (first call against a repeat), float32 and bf16 cast once,
  to decide whether the batcher should round sizes up to a few buckets.
- text: a real ``gunicorn -k gevent`` (default workers) serving the model; one-text requests one after
  another (an album search's query) against the bare one-text forward; then texts/s and request latency
  for 1, 16 and 256 texts per request, closed loop with 4 clients, against the text tower alone (bare:
  batches of 64, every core) on the same texts.

Prints the command, the machine and a table per section; writes bench/out/clip.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import requests

from bench import bare
from bench.keepalive import KeepAlive
from bench.report import rows_table as table
from bench.report import start
from harness.launch import GunicornServer

OUT = Path("bench/out")
ONE_TEXT_REQUESTS = 60  # one-text requests (and bare forwards), one after another; the first 5 not counted
ROUNDS = 3  # default, variant, default, variant ...: medians compared
WORDS = ("photo dog cat beach mountain sunset city street car child birthday cake snow forest river "
         "friends dinner concert garden flowers bicycle train airport museum painting night lights").split()


def captions(n: int, seed: int = 0) -> list[str]:
    """Album-search-like queries, 4 to 12 words (8 to 16 tokens), all different."""
    rng = np.random.default_rng(seed)
    return [f"a {' '.join(rng.choice(WORDS, rng.integers(3, 11)))} {i}" for i in range(n)]


def timed(fn: Callable[[], Any], reps: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def _cos(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def speed(model_name: str, weights: Path, cores: int) -> list[dict[str, Any]]:
    import torch

    from service.engine.casting import FLOAT32, Numerics
    from service.engine.loading import load_model

    torch.set_num_threads(cores)
    model = load_model(model_name, str(weights))
    model.warm_up()
    crop = model.info.transform.crop_size
    rows = []

    def images(batch: int, label: str, setup: Callable[[], None], undo: Callable[[], None]) -> None:
        pixels = np.random.default_rng(0).integers(0, 255, (batch, crop, crop, 3), dtype=np.uint8)
        base = model.forward(pixels)[0]
        reps = max(2, 32 // batch)
        defaults, variants = [], []
        for _ in range(ROUNDS):  # alternated: this machine's drift and neighbours land on both alike
            defaults.append(timed(lambda: model.forward(pixels), reps))
            setup()
            try:
                out = model.forward(pixels)[0]
                variants.append(timed(lambda: model.forward(pixels), reps))
            finally:
                undo()
        default, t_variant = statistics.median(defaults), statistics.median(variants)
        rows.append({"what": label, "batch": batch, "default_per_s": round(batch / default, 2),
                     "variant_per_s": round(batch / t_variant, 2), "ratio": round(default / t_variant, 3),
                     "min_cosine": round(_cos(base, out), 6)})
        print(json.dumps(rows[-1]), flush=True)

    nothing = lambda: None  # noqa: E731
    for batch in (1, 8, 32):
        images(batch, "batch size (variant = default)", nothing, nothing)
    images(32, "channels_last input", lambda: setattr(model, "channels_last", True),
           lambda: setattr(model, "channels_last", False))
    images(32, "attention fast path off", lambda: torch.backends.mha.set_fastpath_enabled(False),
           lambda: torch.backends.mha.set_fastpath_enabled(True))
    images(8, "channels_last input", lambda: setattr(model, "channels_last", True),
           lambda: setattr(model, "channels_last", False))
    for numerics in (Numerics(torch.bfloat16, cast=False), Numerics(torch.bfloat16, cast=True)):
        for batch in (1, 8, 32):
            images(batch, numerics.name, functools.partial(model.set_numerics, "image", numerics),
                   functools.partial(model.set_numerics, "image", FLOAT32))
    rows.append(_text_trim(model, reps=2))
    print(json.dumps(rows[-1]), flush=True)
    return rows


def shapes(model_name: str, weights: Path, cores: int) -> list[dict[str, Any]]:
    """What a batch size the tower has not run yet costs, in float32 and bf16 cast once: every size 1-32 in a
    shuffled order, its first call then a repeat; bucketing sizes would pay only if first calls cost more
    than the padding a bucket adds (to the next power of two: about a quarter more images on average)."""
    import torch

    from service.engine.casting import FLOAT32, Numerics
    from service.engine.loading import load_model

    torch.set_num_threads(cores)
    model = load_model(model_name, str(weights))
    crop = model.info.transform.crop_size
    pixels = np.random.default_rng(0).integers(0, 255, (32, crop, crop, 3), dtype=np.uint8)
    order = np.random.default_rng(1).permutation(np.arange(1, 33))
    rows = []
    for numerics in (FLOAT32, Numerics(torch.bfloat16, cast=True)):
        model.set_numerics("image", numerics)
        model.forward(pixels[:1])
        first, repeat = [], []
        for n in order[:12]:  # 12 sizes: enough to see a per-shape cost, bounded in time
            first.append(_once(model, pixels[:n]))
            repeat.append(_once(model, pixels[:n]))
        extra = [(f - r) * 1000 for f, r in zip(first, repeat, strict=True)]
        rows.append({"numerics": numerics.name, "sizes": len(first), "first call ms (mean)":
                     round(statistics.mean(first) * 1000, 1), "repeat ms (mean)": round(statistics.mean(repeat) * 1000, 1),
                     "first - repeat ms (median)": round(statistics.median(extra), 1),
                     "first / repeat": round(sum(first) / sum(repeat), 3)})
        print(json.dumps(rows[-1]), flush=True)
    model.set_numerics("image", FLOAT32)
    return rows


def _once(model: Any, pixels: np.ndarray) -> float:
    t0 = time.perf_counter()
    model.forward(pixels)
    return time.perf_counter() - t0


def _text_trim(model: Any, reps: int) -> dict[str, Any]:
    """The served text forward (trimmed to the longest text) vs open_clip's encode_text at 77 tokens."""
    import torch

    ids = model.tokenize(captions(64)).ids
    clip = model.module.clip
    trimmed = lambda: model.encode_text(ids)  # noqa: E731

    def full() -> Any:
        with torch.inference_mode():
            return clip.encode_text(torch.from_numpy(ids))

    trims, fulls = [], []
    for _ in range(ROUNDS):
        trims.append(timed(trimmed, reps))
        fulls.append(timed(full, reps))
    t_trim, t_full = statistics.median(trims), statistics.median(fulls)
    return {"what": "texts trimmed to the longest (variant: full 77 tokens)", "batch": 64,
            "default_per_s": round(64 / t_trim, 1), "variant_per_s": round(64 / t_full, 1),
            "ratio": round(t_trim / t_full, 3), "min_cosine": round(_cos(trimmed(), full()), 6)}


def bare_texts(model_name: str, weights: Path, cores: int, texts: list[str],
               queries: list[str]) -> tuple[float, float]:
    """The text tower alone on every core: texts/s for ``texts`` in batches of 64, and the median ms of
    one-text forwards of ``queries`` (one query at a time, as an album search sends it)."""
    import torch

    from service.engine.loading import load_model

    torch.set_num_threads(cores)
    model = load_model(model_name, str(weights))
    model.warm_up()
    ids = model.tokenize(texts).ids

    def once() -> None:
        for i in range(0, len(ids), 64):
            model.encode_text(ids[i:i + 64])

    singles = []
    for query in queries:
        one = model.tokenize([query]).ids
        t0 = time.perf_counter()
        model.encode_text(one)
        singles.append((time.perf_counter() - t0) * 1000)
    return len(texts) / timed(once, 4), statistics.median(singles[5:])


def one_text_latency(port: int, queries: list[str]) -> dict[str, float]:
    """One-text requests one after another on a keep-alive connection: the server's p50 and p90 in ms."""
    client = KeepAlive(port)
    ms = [client.post_ms("/v1/embeddings", json.dumps({"texts": [query]}).encode()) for query in queries]
    client.close()
    ms = sorted(ms[5:])  # the first few warm the connection and the text batcher's shapes
    return {"p50_ms": round(statistics.median(ms), 1), "p90_ms": round(ms[int(0.9 * len(ms))], 1)}


def served_texts(url: str, per_request: int, clients: int, seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    stop = time.monotonic() + seconds
    done = [0]
    refused: list[int] = []  # 503s (retried after Retry-After): the run reports them

    def client(k: int) -> None:
        i = 0
        with requests.Session() as s:
            while time.monotonic() < stop:
                body = {"texts": captions(per_request, seed=1000 * k + i)}
                t0 = time.perf_counter()
                r = s.post(url + "/v1/embeddings", json=body, timeout=300)
                if r.status_code == 503:
                    refused.append(r.status_code)
                    time.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)
                done[0] += per_request
                i += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return {"texts_per_request": per_request, "clients": clients, "requests": len(latencies),
            "refused_503": len(refused), "texts_per_s": round(done[0] / elapsed, 1),
            "p50_ms": round(statistics.median(latencies) * 1000, 1),
            "max_ms": round(max(latencies) * 1000, 1)}


def text(model_name: str, weights: Path, cores: int) -> dict[str, Any]:
    queries = captions(ONE_TEXT_REQUESTS, seed=7)  # the same queries, bare and served
    yardstick, bare_one_ms = bare_texts(model_name, weights, cores, captions(256, seed=5), queries)
    env = {"GREENSERVE_MODEL": model_name, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_LOG_LEVEL": "info"}
    rows = []
    with GunicornServer(env, cache="off", workers=cores, ready_timeout_s=300) as srv:
        one = one_text_latency(srv.port, queries)
        print(json.dumps({"one text at a time": one, "bare one-text forward p50 ms": round(bare_one_ms, 1)}))
        for per_request in (1, 16, 256):
            rows.append(served_texts(srv.url, per_request, clients=4, seconds=12))
            rows[-1]["vs_bare"] = round(rows[-1]["texts_per_s"] / yardstick, 2)
            print(json.dumps(rows[-1]), flush=True)
    return {"bare_texts_per_s": round(yardstick, 1), "bare_one_text_ms": round(bare_one_ms, 1),
            "one_text_at_a_time": one, "served": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="open_clip:ViT-B-32")
    parser.add_argument("--only", nargs="+", choices=("speed", "shapes", "text"), default=["speed", "shapes", "text"])
    args = parser.parse_args(argv)
    info = start("bench.clip_bench", args.model, argv)
    cores = info["cores"]
    weights = bare.save_random_weights(args.model, Path(tempfile.gettempdir()) / f"{bare.slug(args.model)}-seed0.pt")
    doc: dict[str, Any] = {"machine": info}
    if "speed" in args.only:
        doc["speed"] = speed(args.model, weights, cores)
        print(table(doc["speed"]))
    if "shapes" in args.only:
        doc["shapes"] = shapes(args.model, weights, cores)
        print(table(doc["shapes"]))
    if "text" in args.only:
        doc["text"] = text(args.model, weights, cores)
        t = doc["text"]
        print(f"bare text tower: {t['bare_texts_per_s']} texts/s; one text: bare forward p50 "
              f"{t['bare_one_text_ms']} ms, served p50 {t['one_text_at_a_time']['p50_ms']} ms (one client)")
        print(table(doc["text"]["served"]))
    OUT.mkdir(exist_ok=True)
    (OUT / "clip.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
