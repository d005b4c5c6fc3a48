"""What a hostile body costs the worker that gets it: ``python -m bench.hostile_bench [--model resnet18] [--reps 2]``.

One worker at the default limits (64 MiB bodies, 64 images, a 30 s body deadline). For each attack, sent
``--reps`` times one after another (and for at least 2 s): its answer (status and code), the seconds to answer, the hub's
``/healthz`` latency meanwhile (one keep-alive client every 20 ms) and the worker's peak resident memory
over its idle level (``/proc/<pid>/status`` sampled every 5 ms). The first row is no attack at all, the
yardstick for the probe; the last ones are the largest bodies the limits let through, parsed whole.

Prints the command, the machine and a table; writes bench/out/hostile.json.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench import bare
from bench.album import Photo, render
from bench.report import rows_table, start, write_json
from harness.launch import ROOT, GunicornServer
from harness.stats import percentile

OUT = ROOT / "bench" / "out"
MB = 1 << 20
JSON = {"Content-Type": "application/json"}
MIN_S = 2.0  # each attack is repeated for at least this long, so the probe has samples


def attacks(model: str) -> dict[str, Callable[[int], tuple[int, str]]]:
    """name → a function that sends the attack to the port and returns (status, code)."""
    photo = "data:image/jpeg;base64," + base64.b64encode(render(Photo("a.jpg", 640, 480, 1, seed=1))).decode()
    oip = f"/v2/models/{model}/infer"
    oip_one = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [photo]}]}
    bodies: dict[str, tuple[str, bytes]] = {
        "none (healthz alone)": ("", b""),
        "60 MB: 20 million []": ("/v1/embeddings", b'{"images":["x"],"x":[' + b",".join([b"[]"] * (20 << 20)) + b"]}"),
        "60 MB: 15 million one-letter strings": ("/v1/embeddings", b'{"images":["x"],"x":[' + b",".join(
            [b'"a"'] * 15_000_000) + b"]}"),
        "60 MB: 30 million digits": ("/v1/embeddings", b'{"images":["x"],"x":[' + b",".join([b"1"] * 30_000_000) + b"]}"),
        "100,000-deep JSON": ("/v1/embeddings", b"[" * 100_000 + b"]" * 100_000),
        "OIP: one output asked 40,000 times": (oip, json.dumps({**oip_one, "outputs": [{"name": "EMBEDDING"}] * 40_000})
                                               .encode()),
        "largest allowed: 249,000 strings": ("/v1/embeddings", b'{"images":["x"],"x":[' + b",".join(
            [b'"a"'] * 249_000) + b"]}"),
        "largest allowed: one 63 MB string": ("/v1/embeddings", b'{"images":["x"],"x":"' + b"a" * (63 * MB) + b'"}'),
        "allowed: 16 MiB of data: URLs (JSON)": ("/v1/embeddings", _data_urls(16 * MB)),
        "allowed: 32 MiB of data: URLs (JSON)": ("/v1/embeddings", _data_urls(32 * MB)),
        "largest allowed: 63 MiB of data: URLs (JSON)": ("/v1/embeddings", _data_urls(63 * MB)),
        "63 MiB of data: URLs, every / escaped (PHP)": ("/v1/embeddings", _data_urls(50 * MB, "AAA/").replace(
            b"/", b"\\/")),
        "63 MiB of strings just under 64 KiB": ("/v1/embeddings", json.dumps(
            {"images": ["x"], "x": ["a" * (64 * 1024 - 1)] * 1000}).encode()),
        "one 63 MB string with one escape": ("/v1/embeddings", b'{"images":["x"],"x":"' + b"a" * (32 * MB) + b"\\n"
                                            + b"a" * (31 * MB) + b'"}'),
        "largest allowed: 64 images, both outputs (OIP)": (oip, json.dumps(
            {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [64], "data": [photo] * 64}]}).encode()),
    }
    out: dict[str, Callable[[int], tuple[int, str]]] = {
        name: (lambda port, p=path, b=body: _post(port, p, b)) for name, (path, body) in bodies.items()}
    out["none (healthz alone)"] = lambda port: (time.sleep(1.0), (200, ""))[1]
    out["50 stalled bodies at once (30 s deadline)"] = _stalled
    return out


def _data_urls(size: int, fill: str = "A") -> bytes:
    """Images as data: URLs in one JSON body of about ``size`` bytes: junk base64 (fast to refuse, 422
    not_an_image), so the row is the body's reading and parsing."""
    per = 15 * MB
    n, last = divmod(size, per)
    urls = ["data:image/jpeg;base64," + fill * (per // len(fill)) for _ in range(n)] + (
        ["data:image/jpeg;base64," + fill * (last // len(fill))] if last > 1024 else [])
    return json.dumps({"images": urls}).encode()


def _post(port: int, path: str, body: bytes) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers=JSON)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        doc = json.loads(data)
        err = doc.get("error")
        code = err.get("code") if isinstance(err, dict) else doc.get("code", "")
    except ValueError:
        code = "?"
    return resp.status, f"{code or ''} ({len(data) / MB:.1f} MB answer)" if resp.status == 200 else code


def _stalled(port: int) -> tuple[int, str]:
    socks = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(50)]
    for s in socks:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nabc")
    first = b""
    while b"body_timeout" not in first and (piece := socks[0].recv(4096)):  # the head, then the body
        first += piece
    for s in socks:
        s.close()
    return int(first.split()[1]), "body_timeout" if b"body_timeout" in first else first[:40].decode("latin-1").split("\r\n")[0]


class Watch:
    """The hub's /healthz latency and the worker's resident memory while something else runs."""

    def __init__(self, port: int, pid: int) -> None:
        self.port, self.pid = port, pid
        self.stop = threading.Event()
        self.health_ms: list[float] = []
        self.rss_peak = 0

    def __enter__(self) -> Watch:
        self.threads = [threading.Thread(target=self._probe), threading.Thread(target=self._rss)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def _probe(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self.stop.wait(0.02):
            t0 = time.perf_counter()
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            self.health_ms.append((time.perf_counter() - t0) * 1000)
        conn.close()

    def _rss(self) -> None:
        while not self.stop.wait(0.005):
            self.rss_peak = max(self.rss_peak, rss_bytes(self.pid))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)
    info = start("bench.hostile_bench", args.model, argv)
    weights = bare.save_random_weights(args.model, OUT / "weights" / f"{bare.slug(args.model)}-seed0.pt")
    rows = []
    env = {"GREENSERVE_MODEL": args.model, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_DTYPE": "float32"}
    with GunicornServer(env, cache="off", workers=1) as srv:
        (pid,) = srv.worker_pids()
        for name, attack in attacks(args.model).items():
            idle = rss_bytes(pid)
            with Watch(srv.port, pid) as watch:
                t0 = time.perf_counter()
                answers = []
                while len(answers) < args.reps or time.perf_counter() - t0 < MIN_S:  # enough probes
                    answers.append(attack(srv.port))
                took = (time.perf_counter() - t0) / len(answers)
            ms = sorted(watch.health_ms)
            rows.append({"attack": name, "answer": ", ".join(sorted({f"{s} {c}" for s, c in answers})),
                         "s per attack": round(took, 2), "healthz p50 ms": round(statistics.median(ms), 1),
                         "p99 ms": round(percentile(ms, 0.99) or 0.0, 1), "max ms": round(ms[-1], 1),
                         "probes": len(ms), "peak RSS over idle MB": round((watch.rss_peak - idle) / MB),
                         "same worker": srv.worker_pids() == {pid}})
            print(f"   {json.dumps(rows[-1])}", flush=True)
    print(rows_table(rows), flush=True)
    write_json(OUT / "hostile.json", {"machine": info, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
