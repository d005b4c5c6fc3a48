"""Faults, measured: ``python -m bench.fault_bench [--root CHECKOUT] [--only flood loris hup mixed gone respawn]``.

A real 2-worker greenserve (resnet18, seeded random weights) under a steady load of 4 clients x 10
photos from a local image host, all on 127.0.0.1:

- steady:  the load alone, as the reference for the two below
- flood:   600 idle connections (half a request line each) for 6 s: the steady clients' success and p99,
           /healthz p99, and which workers answer once the flood is gone
- loris:   a slow loris keeping 600 connections open for 6 s, reopening each one dropped
- hup:     SIGHUP to the master under the load: failed requests, max latency, seconds to new workers
- mixed:   8 12-MP photos and 2 URLs on a closed port, partial=false: seconds to the 422 (5 tries)
- gone:    a 40-photo request whose client leaves after 0.5 s: images through the model afterwards
- respawn: kill -9 of a worker under keep-alive load: the split of requests 10-13 s after its respawn
- exits:   50 start/stop cycles (SIGTERM or SIGINT at boot, idle, after a request) and 20 HUPs under a light
           load: workers that aborted (not in the default list: about 12 minutes)

``--root`` runs another checkout's server (an earlier commit) with this harness, for before/after.
Prints the command, the machine and a table; writes bench/out/faults.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from bench import bare
from bench.album import Photo, render
from bench.report import machine
from harness.faults import IdleFlood, SlowLoris, probe, worker_pid_answering
from harness.imagehost import ImageHost
from harness.launch import ROOT, GunicornServer, free_port
from harness.load import Load, load_summary
from harness.stats import percentile

OUT = Path("bench/out")
MODEL = "resnet18"
PHOTOS = [Photo(f"p{i:02d}.jpg", 1024, 768, 1, seed=40 + i) for i in range(10)]
BIG = [Photo(f"big{i}.jpg", 4000, 3000, 1, seed=60 + i) for i in range(8)]  # 12 MP: the mixed case's good images


def metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def under(srv: GunicornServer, names: list[str], fault: Any, seconds: float) -> dict[str, Any]:
    """The steady load (a fresh connection per request, as a new client) and /healthz probes while
    ``fault`` (a context manager) is on."""
    with Load(srv.url, 4, {"images": names}, duration_s=seconds + 30, fresh=True, timeout_s=10) as load:
        time.sleep(2.0)
        start = time.monotonic()
        with fault:
            health, health_failed = probe(srv.url + "/healthz", int(seconds / 0.2), interval_s=0.1, timeout_s=3)
        during = load.since(start)
    time.sleep(0.5)
    after = worker_pid_answering(srv.url, 16)
    s = load_summary(during)
    return {"clients_ok": f"{s['ok']}/{s['requests']}", "clients_p99_s": s["p99_s"],
            "healthz_ok": f"{len(health)}/{len(health) + health_failed}",
            # 30 probes: a p99 would be the single worst one, which is the probe that waited in the kernel's
            # accept queue behind the flood's burst; p50 / p90 / max and the count over 100 ms say more
            "healthz_p50_p90_max_ms": [round((percentile(health, q) or 0.0) * 1000, 1) for q in (0.5, 0.9, 1.0)]
            if health else None,
            "healthz_over_100ms": sum(h > 0.1 for h in health),
            "workers_answering_after": f"{len(after)}/{len(srv.worker_pids())}"}


class _Loris:
    def __init__(self, port: int, n: int) -> None:
        self.loris = SlowLoris(port, n, interval_s=0.5, duration_s=60)

    def __enter__(self) -> None:
        self.loris.start()

    def __exit__(self, *exc: object) -> None:
        self.loris.stop()


def hup(srv: GunicornServer, names: list[str]) -> dict[str, Any]:
    old = srv.worker_pids()
    assert srv.proc is not None
    with Load(srv.url, 4, {"images": names}, duration_s=90) as load:
        time.sleep(3.0)
        sent = time.monotonic()
        os.kill(srv.proc.pid, signal.SIGHUP)
        switched = None
        while time.monotonic() - sent < 60:
            served = {o.pid for o in load.since(time.monotonic() - 1.0) if o.status == 200}
            if served and not served & old:
                switched = time.monotonic() - sent
                break
            time.sleep(0.2)
        time.sleep(3.0)
    s = load_summary(load.done)
    # the same figure for the requests answered before the signal: what the load alone gives on this host
    steady = load_summary([d for d in load.done if d.started + d.seconds < sent])
    worst = max(load.done, key=lambda d: d.seconds)
    return {"requests": s["requests"], "failed": s["failed"], "failures": s["failures"], "max_s": s["max_s"],
            "p50_s": s["p50_s"], "max_over_p50": _ratio(s["max_s"], s["p50_s"]),
            "max_started_after_hup_s": round(worst.started - sent, 1),
            "before_hup_max_over_p50": _ratio(steady["max_s"], steady["p50_s"]),
            "new_workers_serving_after_s": round(switched, 1) if switched else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


ABORTED = ("terminate called", "core dumped")  # one line per aborted worker (the master's "SIGABRT!" is another)
STOPS = [(signal.SIGTERM, "boot"), (signal.SIGINT, "boot"), (signal.SIGTERM, "served"), (signal.SIGINT, "idle")]


def aborts(log: str) -> int:
    return sum(any(a in line for a in ABORTED) for line in log.splitlines())


def exits(env: dict[str, str], root: Path, cycles: int = 50, hups: int = 20) -> dict[str, Any]:
    """Start/stop cycles (SIGTERM or SIGINT while the workers boot, when idle, after a request) and HUPs
    under a light load: workers that aborted ("terminate called without an active exception", SIGABRT)."""
    by_stop: dict[str, int] = {}
    for i in range(cycles):
        sig, when = STOPS[i % len(STOPS)]
        srv = GunicornServer(env, cache="off", workers=2, cwd=root)
        if when == "boot":
            srv.boot()
            time.sleep(0.5 + 2.0 * (i % 5) / 4)  # 0.5-2.5 s: import, the load in its thread, the warm-up
        else:
            srv.start()
            if when == "served":
                requests.post(srv.url + "/v1/embeddings", json={"images": ["p00.jpg", "p01.jpg"]}, timeout=60)
        assert srv.proc is not None
        srv.proc.send_signal(sig)
        srv.proc.wait(60)
        key = f"{sig.name} {when}"
        by_stop[key] = by_stop.get(key, 0) + aborts(srv.log())
    with GunicornServer(env, cache="off", workers=2, cwd=root) as srv, \
            Load(srv.url, 1, {"images": ["p00.jpg"]}, duration_s=hups * 30) as load:
        assert srv.proc is not None
        for _ in range(hups):
            ready = srv.log().count("model ready:")
            os.kill(srv.proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 30
            while srv.log().count("model ready:") < ready + 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(2.0)  # the old workers hand over and exit
        load.stop()
        hup_aborts = aborts(srv.log())
    s = load_summary(load.done)
    return {"cycles": cycles, "aborts_by_stop": by_stop, "hups": hups, "hup_aborts": hup_aborts,
            "hup_requests": s["requests"], "hup_failed": s["failed"]}


def mixed(srv: GunicornServer) -> dict[str, Any]:
    closed = f"http://127.0.0.1:{free_port()}/gone.jpg"
    times = []
    for i in range(5):
        t0 = time.monotonic()
        r = requests.post(srv.url + "/v1/embeddings",
                          json={"images": [p.name for p in BIG] + [closed, f"{closed}?{i}"]}, timeout=60)
        times.append(time.monotonic() - t0)
        assert r.status_code == 422, r.text
    return {"seconds_to_422": [round(t, 2) for t in times], "median_s": round(sorted(times)[2], 2)}


def gone(srv: GunicornServer, names: list[str]) -> dict[str, Any]:
    body = json.dumps({"images": (names * 4)[:40]}).encode()
    before = metric(srv.url, "greenserve_images_total")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)
        at_leave = metric(srv.url, "greenserve_images_total") - before
    time.sleep(15.0)
    total = metric(srv.url, "greenserve_images_total") - before
    return {"images_in_request": 40, "through_model_when_client_left": at_leave,
            "through_model_after": total - at_leave}


def respawn(srv: GunicornServer, names: list[str]) -> dict[str, Any]:
    ready_before = srv.log().count("model ready:")
    with Load(srv.url, 4, {"images": names[:2]}, duration_s=60) as load:
        time.sleep(3.0)
        os.kill(next(iter(srv.worker_pids())), signal.SIGKILL)
        killed = time.monotonic()
        while srv.log().count("model ready:") <= ready_before and time.monotonic() - killed < 30:
            time.sleep(0.1)
        ready = time.monotonic()
        time.sleep(10.0)
        window = time.monotonic()
        time.sleep(3.0)
        split = load_summary(load.since(window))
    lost = [o for o in load.done if o.status != 200]
    return {"respawn_ready_s": round(ready - killed, 1), "split_10_13s_after": sorted(split["by_pid"].values()),
            "failed_requests": len(lost)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout whose server runs (default: this one)")
    parser.add_argument("--only", nargs="+", choices=["steady", "flood", "loris", "hup", "mixed", "gone", "respawn",
                                                      "exits"],
                        default=["steady", "flood", "loris", "hup", "mixed", "gone", "respawn"])
    parser.add_argument("--out", type=Path, default=OUT / "faults.json")
    args = parser.parse_args(argv)
    print("$ python -m bench.fault_bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    cores = len(os.sched_getaffinity(0))
    info = machine(MODEL, cores)
    print(f"{cores} cores ({info['cpu']}), torch {info['torch']}, server from {args.root}")
    weights = bare.save_random_weights(MODEL, Path(tempfile.gettempdir()) / f"greenserve-{MODEL}-faults.pt")
    album = {p.name: render(p) for p in PHOTOS}
    names = list(album)
    album.update({p.name: render(p) for p in BIG})
    doc: dict[str, Any] = {"machine": info, "root": str(args.root)}
    with ImageHost(album) as host:
        env = {"GREENSERVE_MODEL": MODEL, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_LOG_LEVEL": "info",
               "GREENSERVE_IMAGE_BASE_URL": host.base_url, "GREENSERVE_FETCH_ALLOW": "127.0.0.1/32"}
        for section in args.only:
            if section == "exits":
                doc[section] = exits(env, args.root)
                print(f"\n## {section}\n{json.dumps(doc[section])}", flush=True)
                continue
            with GunicornServer(env, cache="off", workers=2, cwd=args.root) as srv:
                if section == "steady":
                    doc[section] = under(srv, names, contextlib.nullcontext(), 6.0)
                elif section == "flood":
                    doc[section] = under(srv, names, IdleFlood(srv.port, 600), 6.0)
                elif section == "loris":
                    doc[section] = under(srv, names, _Loris(srv.port, 600), 6.0)
                elif section == "hup":
                    doc[section] = hup(srv, names)
                elif section == "mixed":
                    doc[section] = mixed(srv)
                elif section == "gone":
                    doc[section] = gone(srv, names)
                elif section == "respawn":
                    doc[section] = respawn(srv, names)
            print(f"\n## {section}\n{json.dumps(doc[section])}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print("\n| scenario | result |\n|---|---|")
    for section in args.only:
        print(f"| {section} | {json.dumps(doc[section])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
