"""Streamed answers and fair sharing: ``python -m bench.stream_bench [--model M] [--rounds 3] [--seconds 30] [--root R]...``.

The 30-photo phone album (``bench.album``) on the local image host, CLIP ViT-B/32 by default (seeded random
weights, float32), one greenserve per checkout (``--root``, repeatable: an earlier commit's worktree, then
this one) plus one of this checkout with a per-caller cap (GREENSERVE_MAX_CALLER_IMAGES=60). Each round,
servers in rotating order:

- alone     one photo (the album's first) alone, 3 times: the latency a caller sees on an idle server
- stream    the album streamed (Accept: application/x-ndjson): its first line's time and its total, beside
            the same album not streamed, ``--pairs`` of each in turn, and the forwards each took (from
            /metrics; servers that do not stream: skipped).
            The pairs alternate which goes first (stream-plain, plain-stream, ...): an album right
            after the idle "alone" requests, or after the other kind, ran at a different speed. Each pair's
            streamed / plain ratio is kept; the table shows their median, per round and over all rounds
            (one 30-image forward varies by +-5% from album to album, the bound is 2%)
- idle      a "search" caller (X-Client-ID) sending that photo one request after another: p50 / p99
- shared    the same while a "backfill" caller keeps 4 x 30-photo albums in flight (4 clients, closed
            loop): the search caller's p50 / p99, and both callers' statuses
- capped    on the capped server: the same; the backfill gets 429 over_share at its cap, search is served

Prints the command, the machine and a table of ratios measured in the same round (and pooled over the
rounds: "all"); writes
bench/out/stream.json.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import bare
from bench.album import DEFAULT_DIR, ensure_album, load_album
from bench.report import rows_table, start, write_json
from harness.imagehost import ImageHost
from harness.launch import ROOT, GunicornServer
from harness.load import Load, post_once
from harness.stats import percentile

OUT = ROOT / "bench" / "out"
# the callers are told apart by their X-Client-ID: every client here comes from 127.0.0.1
LIMITS = {"GREENSERVE_MAX_QUEUE_IMAGES": "512", "GREENSERVE_REQUEST_TIMEOUT_S": "300", "GREENSERVE_DTYPE": "float32",
          "GREENSERVE_FETCH_TIMEOUT_S": "60", "GREENSERVE_CALLER_FROM": "token,header,address"}
CAP = 60
PAIRS = 6  # streamed and plain albums per server and round, in both orders alike


def stream_once(port: int, body: dict[str, Any]) -> tuple[float, float] | None:
    """(first line, last line) seconds after sending, or None when the server answers JSON instead."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/embeddings", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Accept": "application/x-ndjson"})
    resp = conn.getresponse()
    if not (resp.getheader("Content-Type") or "").startswith("application/x-ndjson"):
        resp.read()
        conn.close()
        return None
    first = None
    while resp.readline():
        first = first or time.perf_counter() - t0
    total = time.perf_counter() - t0
    conn.close()
    assert resp.status == 200 and first is not None
    return first, total


def plain_once(port: int, body: dict[str, Any]) -> float:
    done = post_once(f"http://127.0.0.1:{port}", body, timeout_s=300)
    assert done.status == 200, done
    return done.seconds


def search_loop(port: int, photo: str, seconds: float) -> dict[str, Any]:
    load = Load(f"http://127.0.0.1:{port}", 1, {"images": [photo]}, duration_s=seconds, timeout_s=300,
                headers={"X-Client-ID": "search"}).start().join()
    ok = sorted(d.seconds for d in load.done if d.status == 200)
    return {"requests": len(load.done), "statuses": dict(Counter(str(d.status) for d in load.done)),
            "p50_ms": round(statistics.median(ok) * 1000, 1) if ok else None,
            "p99_ms": round((percentile(ok, 0.99) or 0.0) * 1000, 1) if ok else None}


def shared(port: int, names: list[str], seconds: float) -> dict[str, Any]:
    """The search loop while the backfill caller keeps 4 albums in flight (after 3 s to fill the queue)."""
    backfill = Load(f"http://127.0.0.1:{port}", 4, {"images": names}, duration_s=seconds + 3, timeout_s=300,
                    headers={"X-Client-ID": "backfill"}, retry_after=True).start()
    time.sleep(3.0)
    search = search_loop(port, names[0], seconds)
    backfill.stop()
    statuses = Counter(f"{d.status} {d.code}".strip() for d in backfill.done)
    return {**search, "backfill": dict(statuses)}


def forwards(port: int) -> int:
    """The image forwards the server has run (``greenserve_batch_size_count``)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("greenserve_batch_size_count"))


def pairs(port: int, names: list[str], n: int) -> dict[str, Any]:
    """``n`` streamed albums and ``n`` plain ones, in turn and in both orders, so the host's drift lands on
    both alike: each pair's times (ms), forwards and streamed / plain ratio. Empty when the server does not
    stream."""
    firsts: list[float] = []
    streams: list[float] = []
    plains: list[float] = []
    n_forwards: dict[str, list[int]] = {"stream": [], "plain": []}

    def plain() -> None:
        before = forwards(port)
        plains.append(plain_once(port, {"images": names}))
        n_forwards["plain"].append(forwards(port) - before)

    for pair in range(n):
        if pair % 2:
            plain()
        before = forwards(port)
        streamed = stream_once(port, {"images": names})
        if streamed is None:
            return {}
        n_forwards["stream"].append(forwards(port) - before)
        firsts.append(streamed[0])
        streams.append(streamed[1])
        if not pair % 2:
            plain()
    return {"stream_first_ms": [round(f * 1000, 1) for f in firsts],
            "stream_total_ms": [round(t * 1000, 1) for t in streams],
            "plain_total_ms": [round(t * 1000, 1) for t in plains],
            "ratios": [round(t / p, 4) for t, p in zip(streams, plains, strict=True)],
            "stream_forwards": n_forwards["stream"], "plain_forwards": n_forwards["plain"]}


def one_round(srv: GunicornServer, names: list[str], seconds: float, capped: bool, n_pairs: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    if not capped:
        row["alone_ms"] = round(statistics.median(plain_once(srv.port, {"images": names[:1]}) for _ in range(3)) * 1000, 1)
        row.update(pairs(srv.port, names, n_pairs))
        row["idle"] = search_loop(srv.port, names[0], seconds / 3)
    row["shared"] = shared(srv.port, names, seconds)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="open_clip:ViT-B-32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0, help="the shared window, per server and round")
    parser.add_argument("--root", type=Path, action="append", help="a checkout whose greenserve runs (repeatable)")
    parser.add_argument("--pairs", type=int, default=PAIRS, help="streamed and plain albums per server and round")
    args = parser.parse_args(argv)
    roots = args.root or [ROOT]
    info = start("bench.stream_bench", args.model, argv)
    blobs = load_album(ensure_album(DEFAULT_DIR))
    names = list(blobs)
    weights = bare.save_random_weights(args.model, OUT / "weights" / f"{bare.slug(args.model)}-seed0.pt")
    rounds: list[dict[str, Any]] = []
    with ImageHost(blobs) as host, contextlib.ExitStack() as stack:
        env = {"GREENSERVE_MODEL": args.model, "GREENSERVE_WEIGHTS": str(weights),
               "GREENSERVE_IMAGE_BASE_URL": host.base_url, **LIMITS}
        servers = {f"greenserve ({root.resolve().name})": (False, stack.enter_context(
            GunicornServer(env, cache="off", workers=1, ready_timeout_s=300, cwd=root))) for root in roots}
        servers[f"capped at {CAP} ({ROOT.name})"] = (True, stack.enter_context(GunicornServer(
            {**env, "GREENSERVE_MAX_CALLER_IMAGES": str(CAP)}, cache="off", workers=1, ready_timeout_s=300)))
        for _, srv in servers.values():
            plain_once(srv.port, {"images": names})  # warm: the album's shapes once
        labels = list(servers)
        for r in range(args.rounds):
            row: dict[str, Any] = {"round": r + 1}
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                capped, srv = servers[label]
                row[label] = one_round(srv, names, args.seconds, capped, args.pairs)
                print(f"   round {r + 1} {label}: {json.dumps(row[label])}", flush=True)
            rounds.append(row)
    print(rows_table(_table(rounds, labels) + _pooled(rounds, labels)), flush=True)
    write_json(OUT / "stream.json", {"machine": info, "rounds": rounds})
    return 0


def _table(rounds: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    rows = []
    for row in rounds:
        for label in labels:
            s = row[label]
            out: dict[str, Any] = {"round": row["round"], "server": label}
            if "alone_ms" in s:
                out.update(_stream_columns(s.get("stream_first_ms", []), [s["alone_ms"]], s.get("ratios", []),
                                           (s.get("stream_forwards", []), s.get("plain_forwards", []))))
                out["search p99 idle (ms)"] = s["idle"]["p99_ms"]
            else:
                out.update(_stream_columns([], [], [], ([], [])))
                out["search p99 idle (ms)"] = "-"
            sh = s["shared"]
            out["search p99 shared (ms)"] = sh["p99_ms"]
            out["shared / idle p99"] = (f"{sh['p99_ms'] / s['idle']['p99_ms']:.2f}"
                                        if "idle" in s and sh["p99_ms"] else "-")
            out["search statuses"] = json.dumps(sh["statuses"])
            out["backfill statuses"] = json.dumps(sh["backfill"])
            rows.append(out)
    return rows


def _stream_columns(firsts: list[float], alones: list[float], ratios: list[float],
                    n_forwards: tuple[list[int], list[int]]) -> dict[str, str]:
    """The first line's median less one photo alone's, the median of the pairs' streamed / plain, and the
    forwards an album took (mean, streamed / plain)."""
    if not ratios:
        return {"first line - alone (ms)": "-", "streamed / plain total": "-", "forwards streamed / plain": "-"}
    return {"first line - alone (ms)": f"{statistics.median(firsts) - statistics.median(alones):.0f}",
            "streamed / plain total": f"{statistics.median(ratios):.3f} ({len(ratios)} pairs)",
            "forwards streamed / plain": f"{statistics.mean(n_forwards[0]):.1f} / {statistics.mean(n_forwards[1]):.1f}"}


def _pooled(rounds: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """One row a streaming server: every round's pairs together (each round's "alone" median pooled too)."""
    rows = []
    for label in labels:
        done = [row[label] for row in rounds if row[label].get("ratios")]
        if done:
            rows.append({"round": "all", "server": label, **_stream_columns(
                [f for s in done for f in s["stream_first_ms"]], [s["alone_ms"] for s in done],
                [r for s in done for r in s["ratios"]],
                ([k for s in done for k in s["stream_forwards"]], [k for s in done for k in s["plain_forwards"]]))})
    return rows


if __name__ == "__main__":
    sys.exit(main())
