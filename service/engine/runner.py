"""What one worker owns: the model, its one inference thread, the decode threads, the batcher, admission.

    Runner.start()   load + warm up the model in the inference thread (after fork; CUDA only there)
    Runner.admit(n)  reserve n image slots or raise Overloaded (503 + Retry-After) before any work
    Runner.offload() run CPU work (decode, preprocess, big JSON) in the decode pool, not on the hub
    Runner.infer()   queue one image for the batcher; wait on the returned result cooperatively
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator, Protocol, TypeVar

import gevent
import numpy as np
from gevent.event import AsyncResult, Event
from gevent.threadpool import ThreadPool

from service.engine.batcher import Batcher
from service.engine.model import ModelInfo
from service.errors import GreenserveError, Overloaded
from service.engine.transform import Transform
from service.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")

NOT_READY_RETRY_S = 5


class Model(Protocol):
    """What the runner needs of a model (the real one is ``service.engine.model.LoadedModel``)."""

    info: ModelInfo

    def forward(self, batch: np.ndarray) -> tuple[Any, Any]: ...

    def warm_up(self) -> None: ...


class Runner:
    def __init__(self, settings: Settings, *, model: Model | None = None,
                 loader: Callable[[], Model] | None = None) -> None:
        self.settings = settings
        self._infer_pool = ThreadPool(1)  # the worker-local lock: one native thread touches the model
        self._decode_pool = ThreadPool(settings.decode_threads_per_worker())
        self._loader = loader
        self.model: Model | None = model
        self.load_error: BaseException | None = None
        self._ready = Event()
        self._admitted = 0
        self.batcher = Batcher(self._forward, self._infer_pool, max_batch=settings.max_batch,
                               max_wait_s=settings.max_batch_wait_ms / 1000)
        if model is not None:
            self._ready.set()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Begin serving: load the model in the background unless one was given."""
        self.batcher.start()
        if self.model is None and self._loader is not None:
            gevent.spawn(self._load)

    def _load(self) -> None:
        try:
            self.model = self._infer_pool.apply(self._load_in_thread)
        except BaseException as exc:  # logged loudly; /readyz stays 503 and says why
            self.load_error = exc
            log.critical("model failed to load: %s", exc, exc_info=True)
            return
        info = self.model.info
        log.info("model ready: %s (%s weights) on %s, embedding_dim=%s, %d labels, loaded in %.2fs",
                 info.name, info.weights, info.device, info.embedding_dim, len(info.labels), info.load_seconds)
        self._ready.set()

    def _load_in_thread(self) -> Model:
        assert self._loader is not None
        model = self._loader()
        model.warm_up()
        return model

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    @property
    def transform(self) -> Transform:
        assert self.model is not None
        return self.model.info.transform

    @property
    def labels(self) -> tuple[str, ...]:
        assert self.model is not None
        return self.model.info.labels

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def close(self) -> None:
        self.batcher.stop()
        self._infer_pool.kill()
        self._decode_pool.kill()

    # ------------------------------------------------------------------ admission

    @property
    def admitted_images(self) -> int:
        return self._admitted

    @contextlib.contextmanager
    def admit(self, n_images: int) -> Iterator[None]:
        """Reserve ``n_images`` of this worker's queue, or refuse at once with 503 + Retry-After."""
        if not self.ready:
            raise Overloaded("the model is still loading on this worker; retry shortly",
                             retry_after_s=NOT_READY_RETRY_S, code="not_ready")
        limit = self.settings.max_queue_images
        if self._admitted and self._admitted + n_images > limit:
            wait = self._admitted * self.batcher.stats.seconds_per_image
            raise Overloaded(f"this worker has {self._admitted} image(s) queued or running (limit {limit}); "
                             f"retry after ~{wait:.1f}s or spread load over more workers/replicas",
                             retry_after_s=wait)
        self._admitted += n_images
        try:
            yield
        finally:
            self._admitted -= n_images

    # ------------------------------------------------------------------ work

    def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-bound ``fn`` in a native decode thread; the calling greenlet waits cooperatively.

        ``GreenserveError``s (a bad image, say) are carried back and raised here, in the greenlet;
        gevent would otherwise print each one as a crashed task.
        """
        outcome = self._decode_pool.apply(_capture_expected, (fn, args))
        if isinstance(outcome, _Raised):
            raise outcome.error
        return outcome

    def infer(self, pixels: np.ndarray, deadline: float | None = None) -> AsyncResult:
        return self.batcher.submit(pixels, deadline)

    def _forward(self, batch: np.ndarray) -> tuple[Any, Any]:
        assert self.model is not None and threading.current_thread() is not threading.main_thread()
        return self.model.forward(batch)


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: GreenserveError) -> None:
        self.error = error


def _capture_expected(fn: Callable[..., T], args: tuple[Any, ...]) -> T | _Raised:
    try:
        return fn(*args)
    except GreenserveError as err:
        return _Raised(err)
