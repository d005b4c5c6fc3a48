"""What each protocol costs on top of the model: ``python -m bench.protocol_bench [--model resnet50] [--reps 5]``.

A real 2-worker greenserve and a local image host; one 30-photo album (bench/album.py) per call, sent
one call at a time in each of the ways a client can send it, the ways interleaved round by round so the
host's drift spreads over all of them:

- native urls        ``{"images": [names]}``: the image host serves them (the album pattern; the baseline)
- native data: URLs  the photos inline, base64 in JSON
- native multipart   the photos as form files
- OIP binary         tritonclient, BYTES [30, 1] binary tensor, EMBEDDING + PROBABILITIES (classification 5)
- OIP JSON base64    the photos base64 in an OIP JSON tensor (KServe / TorchServe-on-KServe style)
- OpenAI SDK urls    ``embeddings.create(input=urls)``, base64 float32 answer
- KServe v1 b64      ``{"instances": [{"b64": ...}]}``
- TorchServe raw x30 30 ``PUT /predictions/<m>`` of one photo each, 30 at once (one image per call is
                     TorchServe's shape)

The album's photos are 12 MP phone JPEGs (88 MB together), so the body cap is raised to 256 MB here.
Reports the mean time per album, its ratio to native urls, and the bytes the client sent. Prints the
command, the machine and a table; writes bench/out/protocols.json.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import requests
import tritonclient.http as httpclient

from bench import bare
from bench.album import ensure_album, load_album
from bench.report import rows_table as table
from bench.report import start
from harness.imagehost import ImageHost
from harness.launch import GunicornServer

OUT = Path("bench/out")
Call = Callable[[], int]  # sends one album; returns the bytes it sent
BODY_CAP = 256 * 1024 * 1024


def modes(url: str, model: str, album: dict[str, bytes], host: ImageHost) -> dict[str, Call]:
    names = list(album)
    b64 = [base64.b64encode(b).decode() for b in album.values()]
    s = requests.Session()
    s.trust_env = False

    def post(path: str, **kw: Any) -> int:
        r = s.post(url + path, timeout=300, **kw)
        r.raise_for_status()
        return len(r.request.body or b"")

    def oip_binary() -> int:
        batch = np.array([[b] for b in album.values()], dtype=np.object_)
        image = httpclient.InferInput("IMAGE", list(batch.shape), "BYTES")
        image.set_data_from_numpy(batch, binary_data=True)
        outputs = [httpclient.InferRequestedOutput("EMBEDDING", binary_data=True),
                   httpclient.InferRequestedOutput("PROBABILITIES", binary_data=True, class_count=5)]
        with httpclient.InferenceServerClient(url=url.removeprefix("http://"), network_timeout=300) as c:
            c.infer(model, [image], outputs=outputs)
        return sum(len(b) + 4 for b in album.values())

    def openai_urls() -> int:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            c.embeddings.create(model=model, input=[host.url(n) for n in names])
        return sum(len(host.url(n)) for n in names)

    def torchserve() -> int:
        with ThreadPoolExecutor(len(album)) as pool:
            list(pool.map(lambda b: requests.put(f"{url}/predictions/{model}", data=b, timeout=300).raise_for_status(),
                          album.values()))
        return sum(map(len, album.values()))

    oip_json = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [len(b64)], "data": b64}]}
    return {
        "native urls": lambda: post("/v1/embeddings", json={"images": names}),
        "native data: URLs": lambda: post("/v1/embeddings",
                                          json={"images": ["data:image/jpeg;base64," + x for x in b64]}),
        "native multipart": lambda: post("/v1/embeddings", files=[("images", (n, b)) for n, b in album.items()]),
        "OIP binary": oip_binary,
        "OIP JSON base64": lambda: post(f"/v2/models/{model}/infer", json=oip_json),
        "OpenAI SDK urls": openai_urls,
        "KServe v1 b64": lambda: post(f"/v1/models/{model}-embedding:predict",
                                      json={"instances": [{"b64": x} for x in b64]}),
        "TorchServe raw x30": torchserve,
    }


def run(calls: dict[str, Call], reps: int) -> list[dict[str, Any]]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    sent: dict[str, int] = {}
    for name, call in calls.items():  # one untimed pass: connections, caches, first-call costs
        sent[name] = call()
    for _ in range(reps):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    base = statistics.mean(times["native urls"])
    return [{"mode": name, "mean_s": round(statistics.mean(t), 3), "x native urls": round(statistics.mean(t) / base, 2),
             "min_s": round(min(t), 3), "client_sent_MB": round(sent[name] / 1e6, 2)} for name, t in times.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    info = start("bench.protocol_bench", args.model, argv)
    cores = info["cores"]
    weights = bare.save_random_weights(args.model, Path(tempfile.gettempdir()) / f"{bare.slug(args.model)}-seed0.pt")
    album = load_album(ensure_album())
    with ImageHost(album) as host:
        env = {"GREENSERVE_MODEL": args.model, "GREENSERVE_WEIGHTS": str(weights), "GREENSERVE_LOG_LEVEL": "info",
               "GREENSERVE_IMAGE_BASE_URL": host.base_url,
               # 30 12-MP photos are 88 MB as files, 117 MB as base64: over the default 64 MB body cap
               "GREENSERVE_MAX_BODY_BYTES": str(BODY_CAP)}
        with GunicornServer(env, cache="off", workers=cores, ready_timeout_s=300) as srv:
            rows = run(modes(srv.url, args.model, album, host), args.reps)
    print(table(rows))
    OUT.mkdir(exist_ok=True)
    (OUT / "protocols.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
