"""Prometheus metrics, aggregated over all gunicorn workers (prometheus-client multiprocess mode).

gunicorn.conf.py points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory in the master before it forks,
marks each dead worker's files in ``child_exit`` and removes the directory on exit; any worker's
``/metrics`` then reports the sum over live and past workers. Without that variable (unit tests, one
process) the default registry is used. Import this module only in workers: metric objects made before
the variable is set would not be shared.
"""

from __future__ import annotations

import os
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

ENV = "PROMETHEUS_MULTIPROC_DIR"
# Seconds; from a 1-image request on a GPU to a 64-image resnet50 batch on 2 CPU cores.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)

REQUESTS = Counter("greenserve_requests_total", "HTTP requests by route and status", ["route", "status"])
STAGE_SECONDS = Histogram("greenserve_stage_seconds", "Per-request wall time of each pipeline stage",
                          ["stage"], buckets=LATENCY_BUCKETS)
IMAGES = Counter("greenserve_images_total", "Images through the model")
IMAGE_ERRORS = Counter("greenserve_image_errors_total", "Unusable images by error code", ["code"])
ERRORS = Counter("greenserve_errors_total", "Error responses by code", ["code"])
BATCH_SIZE = Histogram("greenserve_batch_size", "Images per forward pass",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
BATCH_SECONDS = Histogram("greenserve_batch_seconds", "Forward pass time per batch", buckets=LATENCY_BUCKETS)
QUEUE_IMAGES = Gauge("greenserve_queue_images", "Images admitted (queued or running), summed over live workers",
                     multiprocess_mode="livesum")
MODEL_LOAD_SECONDS = Gauge("greenserve_model_load_seconds", "Model load + warm-up time of each live worker",
                           multiprocess_mode="liveall")
TEXTS = Counter("greenserve_texts_total", "Texts through the text tower")
TEXT_CACHE = Counter("greenserve_text_cache_total", "Label and query embeddings looked up in the worker's cache",
                     ["result"])
OVERLOADED = Counter("greenserve_rejected_total", "Requests refused before any work (503)", ["reason"])
OVER_SHARE = Counter("greenserve_over_share_total", "Requests refused because their caller had its share of a "
                     "worker's queue (429)")
CALLER_REQUESTS = Counter("greenserve_caller_requests_total", "Requests by how their caller was told apart (the "
                          "caller class: token, header, forwarded, address), never by caller", ["source"])
CALLERS_TRACKED = Gauge("greenserve_callers_tracked", "Callers a worker keeps anything of (admitted work, or among the "
                        "last few admitted): bounded whatever the number of callers", multiprocess_mode="livesum")
MODEL_REQUESTS = Counter("greenserve_model_requests_total", "Requests by served model (GREENSERVE_MODELS' names)",
                         ["model"])
MODEL_IMAGES = Counter("greenserve_model_images_total", "Images asked of each served model", ["model"])
IMMICH_REQUESTS = Counter("greenserve_immich_requests_total", "immich's POST /predict by task (clip-visual, clip-textual, "
                          "facial-recognition, ocr, other, invalid) and status class (2xx, 4xx, 5xx)", ["task", "status"])
IMMICH_SECONDS = Histogram("greenserve_immich_request_seconds", "immich's POST /predict, parsing to answer (a forward "
                           "to GREENSERVE_IMMICH_UPSTREAM included), by task", ["task"], buckets=LATENCY_BUCKETS)
TOWER_BYTES = Gauge("greenserve_tower_resident_bytes", "What each tower holds in memory, summed over live workers "
                    "(mapped pages of its file count where they are touched)", ["model", "tower"],
                    multiprocess_mode="livesum")
TOWER_LOADS = Counter("greenserve_tower_loads_total", "Towers loaded again after an unload (or first loaded, lazy)",
                      ["model", "tower"])
TOWER_UNLOADS = Counter("greenserve_tower_unloads_total", "Towers unloaded (lazy at start, or idle past their TTL)",
                        ["model", "tower"])
INTERJECTED = Counter("greenserve_interjected_images_total", "Images of one caller run between the blocks of a "
                      "forward of another's, instead of after it")
LAST_FORWARD = Gauge("greenserve_last_forward_timestamp_seconds", "When a worker last ran an image batch (Unix "
                     "time; OIP statistics' last_inference)", multiprocess_mode="max")
CACHE_LOOKUPS = Counter("greenserve_cache_lookups_total", "Images looked up in the embedding cache: hit (no decode, "
                        "no forward), miss, or bypass (cache-control no-store, or the store did not answer)",
                        ["result"])
CACHE_REVALIDATIONS = Counter("greenserve_cache_revalidations_total", "Conditional re-fetches of image URLs: "
                              "not_modified (304), modified (200), fresh (inside max-age: not asked)", ["outcome"])
CACHE_WRITTEN_BYTES = Counter("greenserve_cache_written_bytes_total", "Bytes of entries written, by store", ["store"])
CACHE_BYTES = Gauge("greenserve_cache_memory_bytes", "Bytes in the workers' in-memory caches, summed over live "
                    "workers", multiprocess_mode="livesum")
CACHE_EVICTIONS = Counter("greenserve_cache_evictions_total", "Entries evicted for the size cap, by store", ["store"])
CACHE_STORE_ERRORS = Counter("greenserve_cache_store_errors_total", "Cache calls that failed or timed out (the "
                             "request went on without that store), by store", ["store"])

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def exposition() -> tuple[bytes, str]:
    """The text for ``GET /metrics``: all workers' metrics when running under gunicorn."""
    return generate_latest(_registry()), CONTENT_TYPE_LATEST


def samples() -> Samples:
    """Every sample summed over the workers, by (sample name, sorted labels): for routes that report
    metrics in their own shape (OIP statistics)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in _registry().collect() for s in metric.samples}


def _registry() -> CollectorRegistry:
    if os.environ.get(ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return registry
    from prometheus_client import REGISTRY

    return REGISTRY


def observe_batch(size: int, seconds: float) -> None:
    LAST_FORWARD.set(time.time())
    IMAGES.inc(size)
    BATCH_SIZE.observe(size)
    BATCH_SECONDS.observe(seconds)


def observe_text_batch(size: int, seconds: float) -> None:
    TEXTS.inc(size)
