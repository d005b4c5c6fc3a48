"""The engine passes' probes, each a ratio to a baseline measured in the same run.

``python -m bench.probes.engine_bench [--model resnet50] [--only overhead batching borrow overload]``

- overhead: one 1-image request at concurrency 1, greenserve (2 workers, defaults) vs the bare pipeline
  (same decode + model, no server, 1 process x all threads) on the same 640x480 photo, timed in
  alternation, with http.client (the overhead figure) and with requests (beside it);
- batching: 32 concurrent clients of 1 image each (the same small photo) (k6, open loop capped at 32 in flight): images/s with
  micro-batching across requests vs one request per forward;
- borrow: one 30-photo request alone (N=1): 2 workers borrowing idle cores (default) vs 2 workers on their
  share vs 1 worker x 2 threads, and the bare pipeline as 1 process x 2 threads;
- balance: pairs of simultaneous 30-photo requests on 2 workers, with and without the accept gate: how
  often both land on the same worker, and their latency;
- overload: 30-photo requests arriving at 2x the measured capacity: how fast the excess gets 503 +
  Retry-After, the admitted requests' latency vs at capacity, and that every admitted request succeeds.

Prints the command, the machine, one table per section; writes bench/out/engine.json. Each section answered one
pass's before/after (docs/history/BENCHMARKS-to-277ee8b.md has every run); the rules they decided are in
docs/SCHEDULING.md.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from bench import bare
from bench.album import Photo, ensure_album, load_album, render
from bench.k6 import run_open
from bench.report import machine
from harness.imagehost import ImageHost
from harness.launch import GunicornServer

OUT = Path("bench/out")


def server_env(model: str, weights: Path, host: ImageHost, **extra: str) -> dict[str, str]:
    return {"GREENSERVE_MODEL": model, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_IMAGE_BASE_URL": host.base_url,
            "GREENSERVE_LOG_LEVEL": "info", **extra}


def small_photo_album() -> tuple[Path, str, bytes]:
    """A one-photo album of a 640x480 JPEG: 1-image requests where the model, not the image host, is the work."""
    photo = Photo("small.jpg", 640, 480, 1, seed=7)
    directory = OUT / "album-small"
    directory.mkdir(parents=True, exist_ok=True)
    data = render(photo)
    (directory / photo.name).write_bytes(data)
    (directory / "manifest.json").write_text(json.dumps({"photos": [{"name": photo.name}]}))
    return directory, photo.name, data


def overhead(model: str, weights: Path, host: ImageHost, cores: int, rounds: int = 8) -> dict[str, Any]:
    """One 1-image request at concurrency 1 (one request after another) against the bare pipeline's
    batch of one, in blocks that alternate (6 bare batches, then 6 requests of each kind with each client,
    ``rounds`` times) so the machine's drift hits both alike; medians.

    The first of each block is timed apart and left out of the medians. On this project's host the
    first forward after a pause is slower, bare or server (after 1 s idle: +65 to +145 ms), and
    each side pauses while the other is timed. Those firsts are reported as ``*_first_ms``.

    Two kinds of request: the photo inline (a data: URL, like the bare run, which has the bytes in
    memory) and by URL from the local image host (adds the fetch). Two clients on keep-alive
    connections: the standard library's http.client, the least client work (the overhead figure), and
    a ``requests.Session`` as many callers use (it costs the caller 2-4 ms more per request here;
    reported beside). ``app_ms`` is the server's own Server-Timing: the rest is HTTP and the client."""
    directory, name, data = small_photo_album()
    host.blobs[name] = data
    bodies = {"inline": {"images": ["data:image/jpeg;base64," + base64.b64encode(data).decode()]},
              "url": {"images": [name]}}
    block = 6
    bare_s: list[float] = []
    bare_first: list[float] = []
    timed: dict[tuple[str, str], list[tuple[float, float]]] = {}
    firsts: dict[tuple[str, str], list[float]] = {}
    with GunicornServer(server_env(model, weights, host), cache="off", workers=cores) as srv, \
            bare.BareProcess(model, weights, directory, threads=cores, reps=1) as b:
        clients = {"http.client": _HttpClient("127.0.0.1", srv.port), "requests": _RequestsClient(srv.url)}
        for client in clients.values():
            for body in bodies.values():
                for _ in range(3):
                    client.embeddings(body)
        for _ in range(rounds):
            runs = [b.seconds_per_batch() for _ in range(block)]
            bare_first.append(runs[0])
            bare_s.extend(runs[1:])
            for kind, body in bodies.items():
                for label, client in clients.items():
                    for i in range(block):
                        t0 = time.perf_counter()
                        app_ms = client.embeddings(body)
                        elapsed = time.perf_counter() - t0
                        if i == 0:
                            firsts.setdefault((kind, label), []).append(elapsed)
                        else:
                            timed.setdefault((kind, label), []).append((elapsed, app_ms))
    bare_ms = statistics.median(bare_s) * 1000
    out: dict[str, Any] = {"bare_ms": round(bare_ms, 1), "bare_runs": len(bare_s),
                           "bare_first_ms": round(statistics.median(bare_first) * 1000, 1)}
    for kind in bodies:
        lat_ms = statistics.median(s for s, _ in timed[kind, "http.client"]) * 1000
        req_ms = statistics.median(s for s, _ in timed[kind, "requests"]) * 1000
        out[kind] = {"greenserve_ms": round(lat_ms, 1), "overhead_ms": round(lat_ms - bare_ms, 1),
                     "app_ms": round(statistics.median(a for _, a in timed[kind, "http.client"]), 1),
                     "requests_client_ms": round(req_ms, 1), "requests_overhead_ms": round(req_ms - bare_ms, 1),
                     "first_ms": round(statistics.median(firsts[kind, "http.client"]) * 1000, 1),
                     "requests": sum(len(v) for (k, _), v in timed.items() if k == kind)}
    return out


class _HttpClient:
    """One keep-alive http.client connection: POST /v1/embeddings, the answer read whole."""

    def __init__(self, host: str, port: int) -> None:
        self.conn = http.client.HTTPConnection(host, port, timeout=120)

    def embeddings(self, body: dict[str, Any]) -> float:
        self.conn.request("POST", "/v1/embeddings", body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from the server")
        return float(resp.getheader("Server-Timing", "").partition("dur=")[2])


class _RequestsClient:
    def __init__(self, base_url: str) -> None:
        self.url = base_url + "/v1/embeddings"
        self.session = requests.Session()

    def embeddings(self, body: dict[str, Any]) -> float:
        r = self.session.post(self.url, json=body, timeout=120)
        r.raise_for_status()
        return float(r.headers["Server-Timing"].partition("dur=")[2])


def batching(model: str, weights: Path, host: ImageHost, cores: int) -> dict[str, Any]:
    _, name, data = small_photo_album()
    host.blobs[name] = data
    rows = {}
    for label, extra in (("batched", {}), ("one request per forward",
                                         {"GREENSERVE_BATCH_ACROSS_REQUESTS": "false",
                                          "GREENSERVE_MAX_BATCH_WAIT_MS": "0"})):
        with GunicornServer(server_env(model, weights, host, **extra), cache="off", workers=cores) as srv:
            r = run_open(srv.url, [name], rate_per_min=12000, duration_s=20, max_inflight=32)
        rows[label] = {"images_per_s": r.images_per_s, "mean_ms": r.latency.mean if r.latency else None,
                       "errors": r.errors, "healthz_p99_ms": r.health.p99 if r.health else None}
    rows["ratio"] = round(rows["batched"]["images_per_s"] / max(rows["one request per forward"]["images_per_s"], 1e-9), 2)
    return rows


def borrow(model: str, weights: Path, album_dir: Path, names: list[str], host: ImageHost, cores: int,
           reps: int = 3) -> dict[str, Any]:
    """A lone 30-photo request (median of ``reps`` one after another) on the default layout (one worker per
    core, borrowing idle cores), without borrowing, and on one worker with every core; and the bare
    pipeline as 1 process x all threads."""
    b = bare.measure(model, weights, album_dir, processes=1, threads=cores, reps=reps)
    rows: dict[str, Any] = {f"bare 1x{cores} s": b["seconds_per_batch"]}
    layouts = ((f"greenserve {cores}x1 borrowing (default)", cores, {}),
               (f"greenserve {cores}x1 share only", cores, {"GREENSERVE_BORROW_IDLE_CORES": "false"}),
               (f"greenserve 1x{cores}", 1, {"GREENSERVE_TORCH_THREADS": str(cores)}))
    for label, workers, extra in layouts:
        with GunicornServer(server_env(model, weights, host, **extra), cache="off", workers=workers) as srv:
            session = requests.Session()
            session.post(srv.url + "/v1/embeddings", json={"images": names[:4]}, timeout=300).raise_for_status()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                session.post(srv.url + "/v1/embeddings", json={"images": names}, timeout=300).raise_for_status()
                times.append(time.perf_counter() - t0)
        rows[label + " s"] = round(statistics.median(times), 3)
    return rows


def balance(model: str, weights: Path, names: list[str], host: ImageHost, cores: int, rounds: int = 8) -> dict[str, Any]:
    """Pairs of simultaneous 30-photo requests on 2 workers: how often both land on one worker."""
    rows = {}
    for label, gate in (("accept gate (default)", "true"), ("no gate", "false")):
        with GunicornServer(server_env(model, weights, host, GREENSERVE_ACCEPT_GATE=gate), cache="off", workers=cores) as srv:
            same, latencies = 0, []

            def one(out: list) -> None:
                t0 = time.perf_counter()
                r = requests.post(srv.url + "/v1/embeddings", json={"images": names}, timeout=300)
                out.append((r.headers["X-Worker-PID"], time.perf_counter() - t0))

            for _ in range(rounds):
                out: list = []
                pair = [threading.Thread(target=one, args=(out,)) for _ in range(2)]
                for t in pair:
                    t.start()
                for t in pair:
                    t.join()
                same += out[0][0] == out[1][0]
                latencies += [s for _, s in out]
        rows[label] = {"rounds": rounds, "both_on_one_worker": same, "mean_latency_s": round(statistics.mean(latencies), 2),
                       "max_latency_s": round(max(latencies), 2)}
    return rows


def overload(model: str, weights: Path, names: list[str], host: ImageHost, cores: int) -> dict[str, Any]:
    """Open loop at 2x capacity with Python threads (k6 only times successes; here 503s are the point)."""
    queue_images = str(2 * len(names))  # per worker: the running request and one waiting
    with GunicornServer(server_env(model, weights, host, GREENSERVE_MAX_QUEUE_IMAGES=queue_images), cache="off",
                        workers=cores) as srv:
        cap = run_open(srv.url, names, rate_per_min=600, duration_s=30, max_inflight=cores * 2)
        capacity_rps = cap.images_per_s / len(names)
        rate = 2 * capacity_rps
        results: list[tuple[int, float, str | None, float]] = []
        lock = threading.Lock()

        def one() -> None:
            t0 = time.perf_counter()
            r = requests.post(srv.url + "/v1/embeddings", json={"images": names}, timeout=300)
            elapsed = time.perf_counter() - t0
            app = float(r.headers.get("Server-Timing", "app;dur=nan").partition("dur=")[2])
            with lock:
                results.append((r.status_code, elapsed, r.headers.get("Retry-After"), app))

        threads = []
        start = time.perf_counter()
        for i in range(int(rate * 30)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            threads.append(threading.Thread(target=one))
            threads[-1].start()
        for t in threads:
            t.join(300)
    ok = sorted(s for code, s, _, _ in results if code == 200)
    refused = sorted(s for code, s, _, _ in results if code == 503)
    refused_app = sorted(app for code, _, _, app in results if code == 503)
    other = [code for code, _, _, _ in results if code not in (200, 503)]
    return {"capacity_img_s": cap.images_per_s, "at_capacity_mean_s": round((cap.latency.mean if cap.latency else 0) / 1000, 2),
            "offered_req_s": round(rate, 2), "sent": len(results), "ok": len(ok), "refused_503": len(refused),
            "other_status": other, "retry_after_present": all(ra for c, _, ra, _ in results if c == 503),
            "refusal_p50_ms": round(refused[len(refused) // 2] * 1000, 1) if refused else None,
            "refusal_max_ms": round(refused[-1] * 1000, 1) if refused else None,
            "refusal_server_max_ms": round(refused_app[-1], 1) if refused_app else None,
            "admitted_mean_s": round(statistics.mean(ok), 2) if ok else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--only", nargs="+", default=["overhead", "batching", "borrow", "balance", "overload"])
    args = parser.parse_args(argv)
    print("$ python -m bench.probes.engine_bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    cores = len(os.sched_getaffinity(0))
    info = machine(args.model, cores)
    print(f"{cores} cores ({info['cpu']}), torch {info['torch']}, model {args.model}, load avg {info['loadavg_at_start']}")
    weights = bare.save_random_weights(args.model, Path(tempfile.gettempdir()) / f"greenserve-{args.model}-cl.pt")
    album_dir = ensure_album(OUT / "album")
    album = load_album(album_dir)
    names = list(album)
    doc: dict[str, Any] = {"machine": info}
    with ImageHost(album) as host:
        for section in args.only:
            if section == "overhead":
                doc[section] = overhead(args.model, weights, host, cores)
            elif section == "batching":
                doc[section] = batching(args.model, weights, host, cores)
            elif section == "borrow":
                doc[section] = borrow(args.model, weights, album_dir, names, host, cores)
            elif section == "balance":
                doc[section] = balance(args.model, weights, names, host, cores)
            elif section == "overload":
                doc[section] = overload(args.model, weights, names, host, cores)
            print(f"\n## {section}\n{json.dumps(doc[section], indent=1)}", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "engine.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
