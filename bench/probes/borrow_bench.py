"""Borrowing idle cores at 1 and 2 concurrent clients: ``python -m bench.probes.borrow_bench [--root CHECKOUT ...]``.

Two workers of resnet18 (default; ``--model``), one 1920x1080 JPEG per request as a data: URL, closed loop
over keep-alive connections (``harness.load``). For every checkout given (``--root``, default this one) and
``GREENSERVE_BORROW_IDLE_CORES`` true and false, all servers up at once, then rounds that alternate
server and client count (1, 2) so the shared host's drift lands on all alike: requests/s, p50, p99 and
requests over 150 ms per round. ``--root`` twice (an earlier commit's checkout and this one) gives the
before/after in one run.

Prints the command, the machine and a table; writes bench/out/borrow.json. It answered whether borrowing pays at
1 and 2 clients, and since then whether a change slowed the one-image request path (docs/history/).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import bare
from bench.album import Photo, render
from bench.report import rows_table, start
from harness.launch import ROOT, GunicornServer
from harness.load import Load
from harness.stats import percentile

OUT = ROOT / "bench" / "out"
SLOW_MS = 150.0


def closed_loop(port: int, body: dict[str, Any], clients: int, seconds: float) -> dict[str, Any]:
    """``clients`` clients, each one request after another for ``seconds``."""
    load = Load(f"http://127.0.0.1:{port}", clients, body, duration_s=seconds).start().join()
    failed = [d for d in load.done if d.status != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    ms = sorted(d.seconds * 1000 for d in load.done)
    p99 = percentile(ms, 0.99) or 0.0
    return {"requests_per_s": round(len(ms) / seconds, 1), "p50_ms": round(statistics.median(ms), 1),
            "p99_ms": round(p99, 1), "over_150ms": sum(x > SLOW_MS for x in ms), "requests": len(ms)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--root", type=Path, action="append", help="a checkout whose server runs (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="per round, server and client count")
    args = parser.parse_args(argv)
    roots = args.root or [ROOT]
    info = start("bench.probes.borrow_bench", args.model, argv)
    weights = bare.save_random_weights(args.model, OUT / "weights" / f"{bare.slug(args.model)}-seed0.pt")
    photo = render(Photo("hd.jpg", 1920, 1080, 1, seed=3))
    body = {"images": ["data:image/jpeg;base64," + base64.b64encode(photo).decode()]}
    results: dict[str, dict[int, list[dict[str, Any]]]] = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        for root in roots:
            for borrow in ("true", "false"):
                env = {"GREENSERVE_MODEL": args.model, "GREENSERVE_WEIGHTS": str(weights),
                       "GREENSERVE_DTYPE": "float32", "GREENSERVE_BORROW_IDLE_CORES": borrow}
                label = f"{root.name} borrow={borrow}"
                servers[label] = stack.enter_context(GunicornServer(env, cache="off", workers=2, cwd=root))
        for srv in servers.values():
            closed_loop(srv.port, body, 2, 2.0)  # warm: both workers, every shape
        for r in range(args.rounds):
            for clients in (1, 2):
                labels = list(servers)
                for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                    row = closed_loop(servers[label].port, body, clients, args.seconds)
                    results.setdefault(label, {}).setdefault(clients, []).append(row)
                    print(f"   round {r + 1} {label:28s} {clients} client(s): {json.dumps(row)}", flush=True)
    rows = []
    for label, by_clients in results.items():
        for clients, runs in sorted(by_clients.items()):
            rows.append({"server": label, "clients": clients,
                         "req/s per round": ", ".join(f"{x['requests_per_s']:.1f}" for x in runs),
                         "p50 ms": ", ".join(f"{x['p50_ms']:.0f}" for x in runs),
                         "p99 ms": ", ".join(f"{x['p99_ms']:.0f}" for x in runs),
                         f"> {SLOW_MS:.0f} ms": ", ".join(str(x["over_150ms"]) for x in runs)})
    print(rows_table(rows), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "borrow.json"
    path.write_text(json.dumps({"machine": info, "roots": [str(r) for r in roots], "results": results}, indent=1))
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
