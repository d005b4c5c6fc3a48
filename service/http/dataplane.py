"""One inference request, whichever protocol it came in: parse → check → orchestrate → the answer.

``DataPlane`` is built once by ``create_app`` from the worker's parts. The native routes
(``service/http/routes.py``) and every protocol (``service/http/protocols/``) parse their own wire format
into an ``InferenceRequest`` (``parse_body`` takes a large body off the hub) and call ``run`` or
``run_rows``, so the limits, admission (503), deadlines (504), hang-up cancelling and stage metrics are the
same behind each of them. A deadline already passed when the work would start (``X-Request-Timeout: 1e-9``,
OIP's ``timeout`` of 1 µs) is 504 before any work: a request answered at once from a cache may never wait, so
the deadline's timer would not interrupt it. No Flask here: each call takes the request's ``RequestContext``
as an argument (``current`` takes it, and the plane, from Flask).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from service import metrics
from service.balance.gate import Balance
from service.balance.repository import Follower
from service.engine.engine import Engine
from service.engine.model_set import PINNED, TTL, Residency
from service.engine.runner import Runner
from service.engine.scheduling import NOT_READY_RETRY_S
from service.engine.types import ModelInfo
from service.errors import DeadlineExceeded, Overloaded, RequestError
from service.http.connection import cancel_on_hang_up
from service.http.context import Identities, RequestContext
from service.pipeline.orchestrate import Orchestrator, Progress, Rows
from service.pipeline.recall import CacheTally
from service.pipeline.requests import InferenceRequest
from service.settings import Settings

OFFLOAD_BODY_BYTES = 256 * 1024  # bodies above this are parsed in a decode thread, not on the hub
NOTHING_FITS_S = 0.001  # less left than this when the work would start: no fetch, decode or forward can finish
T = TypeVar("T")


@dataclass(frozen=True)
class Served:
    """What the access line says of the work: how many images (or texts), and each stage's time."""

    images: int
    timings_ms: dict[str, float]
    cache: CacheTally | None = None  # what the embedding cache did (the Cache-Status header); None: it is off

    @classmethod
    def sized(cls, req: InferenceRequest) -> Served:
        """Before any work: the access line counts a request's images whether or not it succeeds."""
        return cls(_size(req), {})


@dataclass(frozen=True)
class Answer:
    body: dict[str, Any]  # the native response body
    served: Served


@dataclass(frozen=True)
class DataPlane:
    """The request path every protocol shares, over this worker's parts."""

    settings: Settings
    runner: Runner
    orchestrator: Orchestrator
    balance: Balance
    identities: Identities = Identities()  # who a caller is (``context.caller_of``)
    repository: Follower | None = None  # which configured models the host's workers serve

    @property
    def info(self) -> ModelInfo | None:
        """The default model's description; None while it loads."""
        return self.runner.info

    @property
    def model_name(self) -> str:
        """The default model's name."""
        return self.runner.engine().name

    @property
    def served(self) -> tuple[str, ...]:
        """Every served model's name, the default first: what ``model_names`` resolves a protocol's name against."""
        return tuple(self.runner.engines)

    def infos(self) -> dict[str, ModelInfo | None]:
        """Every served model's description by name (None while it loads), the default first."""
        return {name: engine.info for name, engine in self.runner.engines.items()}

    def states(self) -> dict[str, tuple[str, ModelInfo | None, str]]:
        """Every served model by name: (its configured model, its description once loaded, ready | loading |
        failed)."""
        return {name: (e.spec.model, e.info, _state(e)) for name, e in self.runner.engines.items()}

    def configured(self) -> dict[str, tuple[str, str]]:
        """Every served model's (model, weights) by name, as GREENSERVE_MODELS configures it (known while it loads)."""
        return {name: (e.spec.model, e.spec.weights) for name, e in self.runner.engines.items()}

    def residency(self, model: str) -> dict[str, dict[str, str]]:
        """Each tower of ``model``: how it stays in memory (pinned, lazy, ttl:<s>), and whether it is now."""
        engine = self.runner.engine(model)
        towers = engine.info.towers if engine.info else ()
        return {tower: {"residency": _policy(engine.spec.residency.get(tower)),
                        "state": self.runner.towers.state(engine.name, tower)} for tower in towers}

    def info_of(self, model: str | None = None) -> ModelInfo | None:
        """A served model's description (the default's without a name); None while it loads, or unloaded."""
        engine = self.runner.engine(model)
        return None if engine.withdrawn else engine.info

    def require_info(self, model: str | None = None) -> ModelInfo:
        """A served model's description, or the 503 admission gives while it loads (or is unloaded)."""
        info = self.info_of(model)
        if info is None and self.runner.engine(model).withdrawn:
            raise Overloaded(f"the model {self.runner.engine(model).name!r} is unloaded on this server; load it "
                             "with POST /v2/repository/models/<name>/load", retry_after_s=60, code="model_unavailable")
        if info is None:
            raise Overloaded(f"the model {self.runner.engine(model).name!r} is still loading on this worker; retry "
                             "shortly", retry_after_s=NOT_READY_RETRY_S, code="not_ready")
        return info

    def not_ready_reason(self, model: str | None = None) -> str:
        """Why a model (or, without a name, the worker) is not ready: what /readyz and the protocols'
        readiness routes say."""
        engines = [self.runner.engine(model)] if model is not None else list(self.runner.engines.values())
        failed = [f"{e.name} failed to load: {e.load_error}" for e in engines if e.load_error is not None]
        loading = [e.name for e in engines if not e.ready and e.load_error is None]
        return "; ".join(failed) if failed else f"model loading: {', '.join(loading)}" if loading else "ready"

    def busy(self) -> AbstractContextManager[None]:
        """Around parsing and running: siblings see this worker as busy from here (parsing included)."""
        return self.balance.inference()

    def parse_body(self, raw: bytes, parser: Callable[..., T], *args: Any) -> T:
        """``parser(raw, *args)``: a large body is parsed in a decode thread (JSON, base64 data, binary
        tensors are all O(body) work), so the hub keeps answering; a small one right here."""
        if len(raw) > OFFLOAD_BODY_BYTES:
            return self.runner.offload(parser, raw, *args)
        return parser(raw, *args)

    def run(self, ctx: RequestContext, req: InferenceRequest, task: str, *, timeout_s: float | None = None,
            progress: Progress | None = None) -> Answer:
        """The native response body for ``task``: ``{"model", "data", "errors", "timings_ms", "request_id"}``;
        ``progress`` hears of each image's answer as it is ready (a streamed answer)."""
        check_task(self.info_of(req.model), req, task)
        self._count(ctx, req)
        deadline = self._deadline(ctx, timeout_s)
        req = replace(req, urgency=ctx.urgency)
        tally = self._tally(ctx, req)
        with cancel_on_hang_up(self._client(ctx)):
            body = self.orchestrator.run(req, task, deadline=deadline, request_id=ctx.request_id, caller=ctx.caller,
                                         progress=progress, tally=tally)
        _observe(body["timings_ms"])
        body = {"model": self.runner.engine(req.model).name, **body, "request_id": ctx.request_id}
        return Answer(body, Served(_size(req), body["timings_ms"], tally))

    def run_rows(self, ctx: RequestContext, req: InferenceRequest, tasks: tuple[str, ...], *,
                 timeout_s: float | None = None) -> tuple[Rows, Served]:
        """Each image's raw row (features and logits from one forward), for protocols with their own outputs."""
        for task in tasks:
            check_task(self.info_of(req.model), req, task)
        self._count(ctx, req)
        deadline = self._deadline(ctx, timeout_s)
        req = replace(req, urgency=ctx.urgency)
        req = replace(req, urgency=ctx.urgency)
        tally = self._tally(ctx, req)
        with cancel_on_hang_up(self._client(ctx)):
            rows = self.orchestrator.run_rows(req, deadline=deadline, request_id=ctx.request_id, caller=ctx.caller,
                                              tally=tally)
        _observe(rows.timings_ms)
        return rows, Served(_size(req), rows.timings_ms, tally)

    def _count(self, ctx: RequestContext, req: InferenceRequest) -> None:
        metrics.CALLER_REQUESTS.labels(ctx.caller_source).inc()
        model = self.runner.engine(req.model).name  # a configured name: the label's values are bounded
        metrics.MODEL_REQUESTS.labels(model).inc()
        metrics.MODEL_IMAGES.labels(model).inc(len(req.refs))

    def _deadline(self, ctx: RequestContext, timeout_s: float | None) -> float:
        """The request's deadline, or 504 at once when it has passed (or nearly) before any work starts."""
        deadline = ctx.deadline(self.settings.request_timeout_s, timeout_s)
        if deadline - time.monotonic() < NOTHING_FITS_S:
            raise DeadlineExceeded("the request's deadline passed before its work could start; send a longer "
                                   "X-Request-Timeout (or OIP timeout parameter)")
        return deadline

    def _tally(self, ctx: RequestContext, req: InferenceRequest) -> CacheTally | None:
        """A record of what the cache does for ``req``'s images; None when the cache is off or there are
        none. The request's own ``Cache-Control`` (RFC 9111): ``no-cache`` embeds every image again and
        stores the result, ``no-store`` leaves the cache out of it."""
        if self.orchestrator.cache is None or not req.refs:
            return None
        return CacheTally(read="no-cache" not in ctx.cache_control and "no-store" not in ctx.cache_control,
                          write="no-store" not in ctx.cache_control)

    def _client(self, ctx: RequestContext) -> Any:
        """The client's socket to watch for a hang-up, or None when GREENSERVE_CANCEL_ON_DISCONNECT is off."""
        return ctx.client if self.settings.cancel_on_disconnect else None


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


def _size(req: InferenceRequest) -> int:
    """A request's images, or its texts: what the access line counts."""
    return len(req.refs) or len(req.text.texts)


def _state(engine: Engine) -> str:
    if engine.withdrawn:
        return "unloaded"
    return "ready" if engine.ready else "failed" if engine.load_error else "loading"


def _policy(residency: Residency | None) -> str:
    if residency is None or residency.kind != TTL:
        return residency.kind if residency else PINNED
    return f"ttl:{residency.ttl_s:g}"


def _observe(timings_ms: dict[str, float]) -> None:
    for stage, ms in timings_ms.items():
        metrics.STAGE_SECONDS.labels(stage).observe(ms / 1000)
