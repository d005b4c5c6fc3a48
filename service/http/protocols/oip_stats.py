"""OIP statistics in Triton's shape (``GET /v2/models[/<m>[/versions/<v>]]/stats``), read from the metrics
every worker already keeps, so ``tritonclient``'s ``get_inference_statistics`` and Triton's
``perf_analyzer`` show the server side of a run.

How greenserve's figures map onto Triton's, summed over the workers and over every protocol (one model
serves them all):

    success          requests answered with their results; ns: their time in the pipeline ("total")
    fail             inference requests answered 4xx/5xx; ns: not timed (0)
    queue            images' wait for a batch slot ("queue")
    compute_input    fetch + decode of the request's images
    compute_infer    the forward passes the request waited on ("inference")
    compute_output   the rest of the pipeline's time: the answer's rows (total - the three above)
    inference_count  images through the model; execution_count: forward passes (batches)
    cache_hit/miss   0: there is no response cache
"""

from __future__ import annotations

from typing import Any

from service.metrics import Samples

INFER_ROUTES = ("/infer", ":predict", "/embeddings", "/classify", "/rank")  # and TorchServe's /predictions/...
_NS = 1e9


def model_stats(samples: Samples, name: str, version: str) -> dict[str, Any]:
    """One model's ``model_stats`` entry."""
    def stage(which: str) -> tuple[int, int]:
        labels = (("stage", which),)
        return (int(samples.get(("greenserve_stage_seconds_count", labels), 0)),
                int(samples.get(("greenserve_stage_seconds_sum", labels), 0) * _NS))

    total, queue, infer = stage("total"), stage("queue"), stage("inference")
    fetch, decode = stage("fetch"), stage("decode")
    inputs = (max(fetch[0], decode[0]), fetch[1] + decode[1])
    output_ns = max(0, total[1] - queue[1] - inputs[1] - infer[1])
    last = samples.get(("greenserve_last_forward_timestamp_seconds", ()), 0.0)
    return {
        "name": name, "version": version, "last_inference": int(last * 1000),
        "inference_count": int(samples.get(("greenserve_images_total", ()), 0)),
        "execution_count": int(samples.get(("greenserve_batch_size_count", ()), 0)),
        "inference_stats": {"success": _d(*total), "fail": _d(_failed(samples), 0), "queue": _d(*queue),
                            "compute_input": _d(*inputs), "compute_infer": _d(*infer),
                            "compute_output": _d(total[0], output_ns), "cache_hit": _d(0, 0),
                            "cache_miss": _d(0, 0)},
        "response_stats": {}, "batch_stats": [], "memory_usage": []}


def _failed(samples: Samples) -> int:
    count = 0.0
    for (sample, labels), value in samples.items():
        if sample != "greenserve_requests_total":
            continue
        tags = dict(labels)
        if tags.get("route", "").endswith(INFER_ROUTES) or tags.get("route", "").startswith("/predictions"):
            if tags.get("status", "200")[0] in "45":
                count += value
    return int(count)


def _d(count: int, ns: int) -> dict[str, int]:
    return {"count": count, "ns": ns}
