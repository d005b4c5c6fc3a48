"""FastAPI apps with greenserve's request shape, decode and model: only the serving design differs.

    naive     fetch with httpx.AsyncClient, then decode + forward inline in ``async def``: the event
              loop is blocked for the whole compute of a request (the widely shared experiment)
    executor  the proposed fix: decode + forward + JSON encode in ``asyncio.to_thread`` (the loop's
              default executor, min(32, cores + 4) threads): requests run at once and share the cores
    locked    the fair twin of greenserve's worker: decode in a 2-thread pool, forward in a 1-thread
              executor (one inference at a time per process, FIFO), JSON encode in the decode pool

Every design fetches with the same per-request concurrency as greenserve (16), resolves relative names
against the same base URL, cuts batches at greenserve's ``max_batch`` (32) and answers greenserve's
``{"model", "data": [{"index", "image", "embedding"}], "errors", "timings_ms"}``.

Run by uvicorn (``bench.asyncio_designs.server``) with ``--factory bench.asyncio_designs.app:create_app``;
configured by ``BENCH_ASYNCIO_*`` variables so that ``uvicorn --workers N`` can rebuild it in each process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from service.engine.loading import load_model
from service.engine.model import LoadedModel
from service.pipeline import postprocess
from service.pipeline.decode import configure_pillow
from service.pipeline.prepare import decode_and_crop

log = logging.getLogger("bench.asyncio")

DESIGNS = ("naive", "executor", "locked")
READY_LINE = "asyncio design ready:"  # printed once per process when the model is loaded and warm
FETCH_CONCURRENCY = 16  # greenserve's GREENSERVE_FETCH_CONCURRENCY default
MAX_BATCH = 32  # greenserve's GREENSERVE_MAX_BATCH default
DECODE_THREADS = 2  # greenserve's decode pool size
FETCH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class AppConfig:
    design: str
    model: str
    weights: str  # a state-dict path: every design loads the same file
    image_base_url: str
    torch_threads: int
    channels_last: bool = True
    max_pixels: int = 40_000_000

    @classmethod
    def from_env(cls) -> AppConfig:
        env = os.environ
        design = env["BENCH_ASYNCIO_DESIGN"]
        if design not in DESIGNS:
            raise ValueError(f"BENCH_ASYNCIO_DESIGN={design!r} is not one of {', '.join(DESIGNS)}")
        return cls(design=design, model=env["BENCH_ASYNCIO_MODEL"], weights=env["BENCH_ASYNCIO_WEIGHTS"],
                   image_base_url=env["BENCH_ASYNCIO_IMAGE_BASE_URL"],
                   torch_threads=int(env.get("BENCH_ASYNCIO_TORCH_THREADS", "1")),
                   channels_last=env.get("BENCH_ASYNCIO_CHANNELS_LAST", "true") == "true",
                   max_pixels=int(env.get("BENCH_ASYNCIO_MAX_PIXELS", "40000000")))

    def to_env(self) -> dict[str, str]:
        return {"BENCH_ASYNCIO_DESIGN": self.design, "BENCH_ASYNCIO_MODEL": self.model,
                "BENCH_ASYNCIO_WEIGHTS": self.weights, "BENCH_ASYNCIO_IMAGE_BASE_URL": self.image_base_url,
                "BENCH_ASYNCIO_TORCH_THREADS": str(self.torch_threads),
                "BENCH_ASYNCIO_CHANNELS_LAST": str(self.channels_last).lower(),
                "BENCH_ASYNCIO_MAX_PIXELS": str(self.max_pixels)}


class FetchFailed(Exception):
    """An image could not be fetched: the request fails with 422 like greenserve's ``partial: false``."""


@dataclass
class _State:
    config: AppConfig
    model: LoadedModel
    client: httpx.AsyncClient
    decode_pool: ThreadPoolExecutor
    infer_pool: ThreadPoolExecutor  # one thread: the worker-local lock of the ``locked`` design


def create_app(config: AppConfig | None = None) -> FastAPI:
    """The app for ``config.design`` (default: from the environment). The model loads in the lifespan."""
    config = config or AppConfig.from_env()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import torch

        torch.set_num_threads(config.torch_threads)  # before the first op: this process's share of the cores
        configure_pillow(config.max_pixels)
        model = load_model(config.model, config.weights, channels_last=config.channels_last)
        model.warm_up()
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=FETCH_TIMEOUT_S, trust_env=False) as client:
            app.state.s = _State(config, model, client, ThreadPoolExecutor(DECODE_THREADS, "decode"),
                                 ThreadPoolExecutor(1, "infer"))
            print(f"{READY_LINE} {config.design} {config.model} pid={os.getpid()} "
                  f"threads={torch.get_num_threads()}", flush=True)
            yield
            app.state.s.decode_pool.shutdown(wait=False, cancel_futures=True)
            app.state.s.infer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(lifespan=lifespan)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "pid": os.getpid()}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        s: _State = request.app.state.s
        started = time.monotonic()
        doc = json.loads(await request.body())
        names = [str(n) for n in doc["images"]]
        normalize = bool(doc.get("normalize", True))
        try:
            blobs = await _fetch_all(s.client, [_resolve(s.config.image_base_url, n) for n in names])
        except FetchFailed as exc:
            return JSONResponse({"error": {"code": "fetch_failed", "message": str(exc), "details": []}}, 422)
        job = _Job(names, blobs, normalize, started, time.monotonic())
        return Response(await _DESIGN_RUNNERS[s.config.design](s, job), media_type="application/json")

    return app


# ---------------------------------------------------------------------- the three designs


@dataclass(frozen=True)
class _Job:
    names: list[str]
    blobs: list[bytes]
    normalize: bool
    started: float
    fetched: float


async def _naive(s: _State, job: _Job) -> bytes:
    crops = [_crop(s, b) for b in job.blobs]  # blocks the loop: nothing else is served meanwhile
    return _encode(s, job, _forward_all(s.model, crops))


async def _executor(s: _State, job: _Job) -> bytes:
    def work() -> bytes:
        return _encode(s, job, _forward_all(s.model, [_crop(s, b) for b in job.blobs]))

    return await asyncio.to_thread(work)


async def _locked(s: _State, job: _Job) -> bytes:
    loop = asyncio.get_running_loop()
    crops = await asyncio.gather(*(loop.run_in_executor(s.decode_pool, _crop, s, b) for b in job.blobs))
    feats = await loop.run_in_executor(s.infer_pool, _forward_all, s.model, list(crops))
    return await loop.run_in_executor(s.decode_pool, _encode, s, job, feats)


_DESIGN_RUNNERS: dict[str, Callable[[_State, _Job], Awaitable[bytes]]] = {
    "naive": _naive, "executor": _executor, "locked": _locked}


# ---------------------------------------------------------------------- shared stages


async def _fetch_all(client: httpx.AsyncClient, urls: Sequence[str]) -> list[bytes]:
    """All images, in order, at most ``FETCH_CONCURRENCY`` at a time (greenserve's bound per request)."""
    gate = asyncio.Semaphore(FETCH_CONCURRENCY)

    async def one(url: str) -> bytes:
        async with gate:
            try:
                r = await client.get(url)
            except httpx.HTTPError as exc:
                raise FetchFailed(f"could not fetch {url}: {exc}") from exc
            if r.status_code != 200:
                raise FetchFailed(f"the image host answered HTTP {r.status_code} for {url}")
            return r.content

    return list(await asyncio.gather(*(one(u) for u in urls)))


def _resolve(base: str, name: str) -> str:
    if name.startswith(("http://", "https://")):
        return name
    return urljoin(base if base.endswith("/") else base + "/", name.lstrip("/"))


def _crop(s: _State, data: bytes) -> np.ndarray:
    return decode_and_crop(data, s.model.info.transform, s.config.max_pixels)


def _forward_all(model: LoadedModel, crops: list[np.ndarray]) -> np.ndarray:
    """Embeddings of ``crops`` in batches of at most ``MAX_BATCH``, like greenserve's batcher."""
    out = []
    for i in range(0, len(crops), MAX_BATCH):
        feats, _ = model.forward(np.stack(crops[i:i + MAX_BATCH]))
        assert feats is not None, "the model has no embedding output"
        out.append(feats.numpy())
    return np.concatenate(out)


def _encode(s: _State, job: _Job, feats: np.ndarray) -> bytes:
    """The JSON response: ~1 MB for 30 resnet50 embeddings, so where it runs matters (loop or thread)."""
    data = [{"index": i, "image": n, "embedding": postprocess.embedding(feats[i], normalize=job.normalize).tolist()}
            for i, n in enumerate(job.names)]
    timings = {"fetch": _ms(job.fetched - job.started), "total": _ms(time.monotonic() - job.started)}
    return json.dumps({"model": s.config.model, "data": data, "errors": [], "timings_ms": timings}).encode()


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)
