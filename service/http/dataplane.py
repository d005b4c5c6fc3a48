"""One inference request, whichever protocol it came in: parse → check → orchestrate → the answer.

The native routes (``service/http/routes.py``) and every protocol (``service/http/protocols/``) parse their own wire
format into an ``InferenceRequest`` and call ``run`` or ``run_rows`` here, so the limits, admission (503),
deadlines (504), hang-up cancelling and stage metrics are the same behind each of them. No Flask here: the
request's ``RequestContext`` and the app's ``Parts`` come as arguments (``current`` takes them from Flask).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from service import metrics
from service.balance.gate import Balance
from service.engine.runner import Runner
from service.engine.scheduling import NOT_READY_RETRY_S
from service.engine.types import ModelInfo
from service.errors import NotFound, Overloaded, RequestError
from service.http.connection import cancel_on_hang_up
from service.http.context import RequestContext
from service.pipeline.orchestrate import Orchestrator, Progress, Rows
from service.pipeline.recall import CacheTally
from service.pipeline.requests import InferenceRequest
from service.settings import Settings

OFFLOAD_BODY_BYTES = 256 * 1024  # bodies above this are parsed in a decode thread, not on the hub
T = TypeVar("T")
EMBEDDING_SUFFIX = "-embedding"  # KServe v1 / TorchServe name the embedding "model" beside the classifier


@dataclass(frozen=True)
class Parts:
    settings: Settings
    runner: Runner
    orchestrator: Orchestrator
    balance: Balance


@dataclass(frozen=True)
class Served:
    """What the access line says of the work: how many images (or texts), and each stage's time."""

    images: int
    timings_ms: dict[str, float]
    cache: CacheTally | None = None  # what the embedding cache did (the Cache-Status header); None: it is off


@dataclass(frozen=True)
class Answer:
    body: dict[str, Any]  # the native response body
    served: Served


def run(p: Parts, ctx: RequestContext, req: InferenceRequest, task: str, *,
        timeout_s: float | None = None, progress: Progress | None = None) -> Answer:
    """The native response body for ``task``: ``{"model", "data", "errors", "timings_ms", "request_id"}``;
    ``progress`` hears of each image's answer as it is ready (a streamed answer)."""
    check_task(p.runner.info, req, task)
    metrics.CALLER_REQUESTS.labels(ctx.caller_source).inc()
    tally = tally_for(p, ctx, req)
    with cancel_on_hang_up(client(p.settings, ctx)):
        body = p.orchestrator.run(req, task, deadline=ctx.deadline(p.settings.request_timeout_s, timeout_s),
                                  request_id=ctx.request_id, caller=ctx.caller, progress=progress, tally=tally)
    _observe(body["timings_ms"])
    body = {"model": p.runner.info.name if p.runner.info else "", **body, "request_id": ctx.request_id}
    return Answer(body, Served(size(req), body["timings_ms"], tally))


def run_rows(p: Parts, ctx: RequestContext, req: InferenceRequest, tasks: tuple[str, ...], *,
             timeout_s: float | None = None) -> tuple[Rows, Served]:
    """Each image's raw row (features and logits from one forward), for protocols with their own outputs."""
    for task in tasks:
        check_task(p.runner.info, req, task)
    metrics.CALLER_REQUESTS.labels(ctx.caller_source).inc()
    tally = tally_for(p, ctx, req)
    with cancel_on_hang_up(client(p.settings, ctx)):
        rows = p.orchestrator.run_rows(req, deadline=ctx.deadline(p.settings.request_timeout_s, timeout_s),
                                       request_id=ctx.request_id, caller=ctx.caller, tally=tally)
    _observe(rows.timings_ms)
    return rows, Served(size(req), rows.timings_ms, tally)


def tally_for(p: Parts, ctx: RequestContext, req: InferenceRequest) -> CacheTally | None:
    """A record of what the cache does for ``req``'s images; None when the cache is off or there are none.
    The request's own ``Cache-Control`` (RFC 9111): ``no-cache`` embeds every image again and stores the
    result, ``no-store`` leaves the cache out of it."""
    if p.orchestrator.cache is None or not req.refs:
        return None
    return CacheTally(read="no-cache" not in ctx.cache_control and "no-store" not in ctx.cache_control,
                      write="no-store" not in ctx.cache_control)


def size(req: InferenceRequest) -> int:
    """A request's images, or its texts: what the access line counts, whether or not it succeeds."""
    return len(req.refs) or len(req.text.texts)


def parse_body(p: Parts, raw: bytes, parse: Callable[..., T], *args: Any) -> T:
    """``parse(raw, *args)``: a large body is parsed in a decode thread (JSON, base64 data, binary tensors
    are all O(body) work), so the hub keeps answering; a small one right here."""
    if len(raw) > OFFLOAD_BODY_BYTES:
        return p.runner.offload(parse, raw, *args)
    return parse(raw, *args)


def check_task(info: ModelInfo | None, req: InferenceRequest, task: str) -> None:
    """What the loaded model cannot do is refused before any work (while it loads, admission says 503)."""
    if info is None:
        return
    if task not in info.tasks:
        raise RequestError(f"the loaded model does not provide {task}; it provides {', '.join(info.tasks)}",
                           code="task_not_supported")
    if (req.text.texts or req.text.prompts) and "text" not in info.towers:
        raise RequestError(f"{info.name} has no text tower, so it cannot embed texts or labels; serve an "
                           "open_clip model (GREENSERVE_MODEL=open_clip:ViT-B-32) for text", code="text_not_supported"
                           if req.text.texts else "labels_not_supported")
    if task == "classify" and not info.labels and not req.text.labels:
        raise RequestError(f'{info.name} has no fixed classes: send the candidate "labels" (and optionally a '
                           f'"template" such as "a photo of a {{}}.")', code="labels_required")
    if task == "classify" and info.labels and req.text.labels:
        raise RequestError(f"{info.name} classifies into its own {len(info.labels)} labels; drop \"labels\" or "
                           "serve an open_clip model for zero-shot labels", code="labels_not_supported")


def require_info(p: Parts) -> ModelInfo:
    """The loaded model's description, or the 503 admission gives while it loads."""
    if p.runner.info is None:
        raise Overloaded("the model is still loading on this worker; retry shortly", retry_after_s=NOT_READY_RETRY_S,
                         code="not_ready")
    return p.runner.info


def not_ready_reason(runner: Runner) -> str:
    """Why this worker is not ready: what /readyz and the protocols' readiness routes say."""
    return f"model failed to load: {runner.load_error}" if runner.load_error else "model loading"


def model_name(p: Parts) -> str:
    """The served model's name (``GREENSERVE_MODEL`` until it has loaded)."""
    return p.runner.info.name if p.runner.info else p.settings.model


def resolve_model(p: Parts, asked: str) -> str:
    """``"classify"`` for the model's own name, ``"embeddings"`` for ``<name>-embedding``, else 404."""
    return task_for_model(model_name(p), asked)


def task_for_model(name: str, asked: str) -> str:
    """``resolve_model`` for a served ``name`` known without the app (a parser running in a decode thread)."""
    if asked == name:
        return "classify"
    if asked == name + EMBEDDING_SUFFIX:
        return "embeddings"
    raise NotFound(f"no model named {asked!r}; this server serves {name!r} (classes) and "
                   f"{name + EMBEDDING_SUFFIX!r} (embeddings)", code="model_not_found")


def client(settings: Settings, ctx: RequestContext) -> Any:
    """The client's socket to watch for a hang-up, or None when GREENSERVE_CANCEL_ON_DISCONNECT is off."""
    return ctx.client if settings.cancel_on_disconnect else None


def _observe(timings_ms: dict[str, float]) -> None:
    for stage, ms in timings_ms.items():
        metrics.STAGE_SECONDS.labels(stage).observe(ms / 1000)
