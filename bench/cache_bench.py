"""The embedding cache: ``python -m bench.cache_bench [--model M] [--repeats 3] [--stores]``.

The 30-photo phone album (``bench.album``) on the local image host, CLIP ViT-B/32 by default (seeded random
weights, float32), one worker. Servers, each started once: the cache off; the disk store (sqlite) and Redis
(a local ``redis-server``) with no memory tier in front, so each warm answer comes from that store; and the
default (disk behind a memory tier). For each, the same album as:

- cold         photos the cache has never seen (each repeat's bytes differ by a trailing byte, which JPEG
               decoders ignore): fetch + decode + forward + store
- revalidated  the album again: 30 conditional GETs answered 304, no download, no decode, no forward
- fresh        the album served with Cache-Control max-age: no request to the image host at all
- content      the album from a host that sends no validators: downloaded again, hashed, found by content

Medians of ``--repeats``; ratios against the cold album of the same server, in the same run. ``--stores``
adds the stores alone: an album's 30 lookups and 30 writes in sqlite (WAL), LMDB and Redis.

Prints the command, the machine and a table; writes bench/out/cache.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from bench import bare
from bench.album import DEFAULT_DIR, ensure_album, load_album
from bench.report import rows_table, start, write_json
from harness.imagehost import ImageHost
from harness.launch import GunicornServer, free_port

OUT = Path(__file__).resolve().parent / "out"
KINDS = ("cold", "revalidated", "fresh", "content")
QUERY = {"revalidated": "", "fresh": "?cache_control=max-age%3D3600", "content": "?validators=0"}


def album_once(srv: GunicornServer, names: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = requests.post(srv.url + "/v1/embeddings", json={"images": names}, timeout=300)
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    return took, r.headers.get("Cache-Status", "")


def measure(srv: GunicornServer, host: ImageHost, blobs: dict[str, bytes], label: str, repeats: int,
            cached: bool) -> dict[str, Any]:
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    status: dict[str, str] = {}
    for rep in range(repeats):
        # new bytes (a trailing byte after the JPEG's end) under new names: nothing of it is cached
        names = [f"{label}-{rep}-{name}" for name in blobs]
        for new, data in zip(names, blobs.values(), strict=True):
            host.blobs[new] = data + bytes([rep + 1]) + label.encode()
        for kind in KINDS:
            query = QUERY.get(kind, "")
            if kind != "cold" and cached:
                album_once(srv, [n + query for n in names])  # the first sight of these URLs: store / remember
            took, status[kind] = album_once(srv, [n + query for n in names])
            times[kind].append(took)
            if kind == "cold" and not cached:
                break
    out = {k: round(statistics.median(v) * 1000, 1) for k, v in times.items() if v}
    print(f"   {label}: {json.dumps(out)} {json.dumps(status)}", flush=True)
    return {"ms": out, "cache_status": status}


def redis_server(port: int) -> subprocess.Popen[bytes] | None:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(binary).exists():
        return None
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    time.sleep(0.5)
    return proc


def stores_alone(redis_url: str | None, repeats: int = 200, value_bytes: int = 2200) -> list[dict[str, Any]]:
    """An album's 30 lookups and 30 writes (CLIP ViT-B/32 entries: 512 float32 and their header)."""
    import lmdb

    from service.cache.disk_store import DiskStore
    from service.cache.redis_store import RedisStore

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        disk = DiskStore(tmp + "/sqlite", 1 << 30)
        env = lmdb.open(tmp + "/lmdb", map_size=1 << 30)

        def lmdb_put(items: dict[str, bytes]) -> None:
            with env.begin(write=True) as txn:
                for k, v in items.items():
                    txn.put(k.encode(), v)

        def lmdb_get(keys: list[str]) -> dict[str, bytes]:
            with env.begin() as txn:
                return {k: bytes(v) for k in keys if (v := txn.get(k.encode())) is not None}

        stores: dict[str, tuple[Any, Any]] = {"sqlite (WAL)": (lambda i: disk.put_many(i, 0), disk.get_many),
                                              "lmdb": (lmdb_put, lmdb_get)}
        if redis_url:
            red = RedisStore(redis_url, 1.0)
            stores["redis (local)"] = (lambda i: red.put_many(i, 3600), red.get_many)
        for name, (put, get) in stores.items():
            puts, gets = [], []
            for r in range(repeats):
                items = {f"e:{name}:{r}:{i}": bytes([i]) * value_bytes for i in range(30)}
                t0 = time.perf_counter()
                put(items)
                t1 = time.perf_counter()
                assert len(get(list(items))) == 30
                gets.append(time.perf_counter() - t1)
                puts.append(t1 - t0)
            rows.append({"store": name, "30 writes (median ms)": round(statistics.median(puts) * 1000, 3),
                         "30 lookups (median ms)": round(statistics.median(gets) * 1000, 3)})
        env.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="open_clip:ViT-B-32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stores", action="store_true", help="also time the stores alone (sqlite, LMDB, Redis)")
    args = parser.parse_args(argv)
    info = start("bench.cache_bench", args.model, argv)
    blobs = load_album(ensure_album(DEFAULT_DIR))
    weights = bare.save_random_weights(args.model, OUT / "weights" / f"{bare.slug(args.model)}-seed0.pt")
    port = free_port()
    redis_proc = redis_server(port)
    redis_url = f"redis://127.0.0.1:{port}/0" if redis_proc else None
    results: dict[str, Any] = {}
    try:
        with ImageHost(blobs) as host:
            env = {"GREENSERVE_MODEL": args.model, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_DTYPE": "float32",
                   "GREENSERVE_IMAGE_BASE_URL": host.base_url, "GREENSERVE_MAX_IMAGE_PIXELS": "50000000",
                   "GREENSERVE_MAX_BODY_BYTES": str(256 * 1024 * 1024)}
            configs = {"off": ({}, "off"), "disk, no memory tier": ({"GREENSERVE_CACHE_MEMORY_MB": "0"}, "fresh"),
                       "disk + memory (default)": ({}, "fresh")}
            if redis_url:
                configs["redis, no memory tier"] = ({"GREENSERVE_CACHE": redis_url, "GREENSERVE_CACHE_MEMORY_MB": "0"},
                                                    "fresh")
            for slot, (label, (extra, cache)) in enumerate(configs.items()):
                with GunicornServer({**env, **extra}, cache=cache, workers=1, ready_timeout_s=300) as srv:
                    album_once(srv, [f"{n}?warm={slot}" for n in list(blobs)[:4]])  # shapes once
                    results[label] = measure(srv, host, blobs, f"s{slot}", args.repeats, cached=cache != "off")
        stores = stores_alone(redis_url) if args.stores else []
    finally:
        if redis_proc:
            redis_proc.kill()
    print(rows_table(_table(results)), flush=True)
    if stores:
        print(rows_table(stores), flush=True)
    write_json(OUT / "cache.json", {"machine": info, "servers": results, "stores": stores})
    return 0


def _table(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, result in results.items():
        ms = result["ms"]
        row: dict[str, Any] = {"server": label}
        for kind in KINDS:
            if kind in ms:
                row[f"{kind} ms"] = ms[kind]
                row[f"cold / {kind}"] = "" if kind == "cold" else f"{ms['cold'] / ms[kind]:.1f}x"
            else:
                row[f"{kind} ms"] = row[f"cold / {kind}"] = "-"
        rows.append(row)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
