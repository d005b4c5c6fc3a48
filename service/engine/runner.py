"""What one worker owns: the model, its one inference thread, the decode threads, the two batchers.

    Runner.start()      load + warm up the model in the inference thread (after fork; CUDA only there)
    Runner.admit(n)     reserve n images of this worker's queue, or 503/429 + Retry-After (``scheduling``)
    Runner.offload()    CPU work (a big JSON body, a text) in a decode thread, before any image
    Runner.decode()     an image's decode in a decode thread, in its request's order (``scheduling``)
    Runner.infer()      queue one image for the batcher; wait on the returned result cooperatively
    Runner.tokenize()   texts → token ids in a decode thread (models with a text tower)
    Runner.infer_text() queue one text for the text batcher: same inference thread, never in an image batch

The order in which work moves through a worker is ``scheduling``'s; how many cores the forward uses is
``cores.CorePlan``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, cast

import gevent
import numpy as np
from gevent.event import AsyncResult, Event
from gevent.threadpool import ThreadPool
from torch import nn

from service import metrics
from service.engine.batcher import Batcher
from service.engine.cores import CorePlan, Siblings, lower_priority
from service.engine.forwarding import BatchStats
from service.engine.preemption import Preemption
from service.engine.scheduling import Admission, Limits, Scheduler, Signals
from service.engine.types import BatchOutputs, EncodedJpeg, ModelInfo, ModelLoadError, Tokens
from service.errors import GreenserveError
from service.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")


class Model(Protocol):
    """What the runner needs of a model (the real one is ``service.engine.model.LoadedModel``)."""

    info: ModelInfo

    def forward(self, batch: np.ndarray) -> tuple[Any, Any]: ...

    def warm_up(self) -> None: ...


class DeviceDecodingModel(Model, Protocol):
    """A model that decodes JPEGs on its device (``info.jpeg_decode == "device"``)."""

    def forward_items(self, items: Sequence[np.ndarray | EncodedJpeg]) -> tuple[Any, Any, dict[int, Exception]]: ...


class TextModel(Model, Protocol):
    """A model with a text tower (``info.towers`` has "text")."""

    def tokenize(self, texts: Sequence[str]) -> Tokens: ...

    def encode_text(self, ids: np.ndarray) -> Any: ...


def limits(settings: Settings, decode_threads: int) -> Limits:
    """The settings the scheduling rules read."""
    return Limits(max_queue=settings.max_queue_images, share=settings.caller_share(),
                  fetch_ahead=settings.fetch_concurrency, decode_threads=decode_threads, max_batch=settings.max_batch,
                  max_text_batch=settings.max_text_batch, max_wait_s=settings.max_batch_wait_ms / 1000,
                  quantum_s=settings.fair_quantum_ms / 1000, across_requests=settings.batch_across_requests,
                  interject=settings.preempt_forwards)


class Runner:
    def __init__(self, settings: Settings, *, model: Model | None = None,
                 loader: Callable[[], Model] | None = None, cores: int | None = None,
                 siblings: Siblings | None = None) -> None:
        self.settings = settings
        self._infer_pool = ThreadPool(1)  # the worker-local lock: one native thread touches the model
        self._decode_pool = ThreadPool(settings.decode_threads_per_worker())
        self._spare_decode = ThreadPool(1)  # a caller's first image while every decode thread is another's
        # below the hub (HTTP, health checks) come the model, then decode: see ``cores.lower_priority``
        self._inference_nice = settings.compute_nice // 2
        self.cores = CorePlan(settings, cores or len(os.sched_getaffinity(0)), siblings)
        self._preemption = Preemption() if settings.preempt_forwards else None
        stats = BatchStats(on_batch=metrics.observe_batch, on_interjected=metrics.INTERJECTED.inc)
        preemption = self._preemption
        self.scheduling = Scheduler(limits(settings, self._decode_pool.maxsize), Signals(
            all_cores=self.cores.all_cores, seconds_per_image=lambda: stats.seconds_per_image,
            preemptible=lambda: preemption is not None and preemption.points > 0))
        self.batcher = Batcher(self._forward, self._infer_pool, self.scheduling.images,
                               self.scheduling.image_rules(), preemption=self._preemption, stats=stats)
        # texts get their own batcher on the same one-thread pool: their forwards take turns with the
        # images' batches and are never mixed into one
        self.text_batcher = Batcher(self._forward_texts, self._infer_pool, self.scheduling.texts,
                                    self.scheduling.text_rules(), stats=BatchStats(on_batch=metrics.observe_text_batch))
        self._loader = loader
        self.model: Model | None = model
        self.load_error: BaseException | None = None
        # a load error no retry fixes (the settings name a model or weights that cannot load): the worker
        # ends the server with it (``service.balance.gunicorn_worker``)
        self.fatal_error: ModelLoadError | None = None
        self._ready = Event()
        self._loading: gevent.Greenlet | None = None
        if model is not None:
            self._ready.set()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Begin serving: load the model in the background unless one was given."""
        self.batcher.start()
        self.text_batcher.start()
        if self.model is None and self._loader is not None:
            self._loading = gevent.spawn(self._load)

    def _load(self) -> None:
        try:
            loaded = self._infer_pool.apply(self._load_in_thread)
        except gevent.GreenletExit:  # the worker is exiting (``close``): not a failed load
            raise
        except BaseException as exc:  # logged loudly; /readyz stays 503 and says why
            self.load_error = exc
            log.critical("model failed to load: %s", exc, exc_info=True)
            return
        if isinstance(loaded, ModelLoadError):  # one line: its message says what to change
            self.load_error = self.fatal_error = loaded
            log.critical("cannot serve: %s", loaded)
            return
        self.model = loaded
        info = self.model.info
        metrics.MODEL_LOAD_SECONDS.set(info.load_seconds)
        log.info("model ready: %s (%s weights) on %s in %s, embedding_dim=%s, %d labels, loaded in %.2fs",
                 info.name, info.weights, info.device, info.dtype, info.embedding_dim, len(info.labels),
                 info.load_seconds)
        self._ready.set()

    def _load_in_thread(self) -> Model | ModelLoadError:
        assert self._loader is not None
        lower_priority(self._inference_nice)  # before torch starts its threads: they inherit it
        try:
            model = self._loader()
        except ModelLoadError as exc:  # returned: raised, gevent would print its traceback, burying the message
            return exc
        module = getattr(model, "module", None)  # ``LoadedModel.module``; test doubles have none
        if self._preemption is not None and isinstance(module, nn.Module):
            log.debug("%d preemption points in the model", self._preemption.install(module))
        model.warm_up()
        return model

    def close(self, timeout_s: float) -> bool:
        """At the worker's exit: batch nothing more and end the native threads, waiting up to ``timeout_s``
        for a model load or forward in progress. False: one is still in torch, and the process must exit
        without the interpreter's finalization. Finalization ends a daemon thread that takes the GIL back
        with ``pthread_exit``, whose unwinding through torch's GIL-release destructor (noexcept) is
        ``std::terminate``: "terminate called without an active exception" and SIGABRT (pytorch#38228)."""
        self.batcher.stop()
        self.text_batcher.stop()
        if self._loading is not None:
            self._loading.kill()  # a load not begun never starts; one in its thread goes on (waited for below)
        pools = (self._infer_pool, self._decode_pool, self._spare_decode)
        with gevent.Timeout(timeout_s, False):
            while any(pool.size or len(pool) for pool in pools):  # again if a greenlet queued more meanwhile
                for pool in pools:
                    pool.kill()  # each thread ends after its task; waits for them
            return True
        return False

    @property
    def ready(self) -> bool:
        return bool(self._ready.is_set())

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model's facts, or None while it loads (or after it failed)."""
        return self.model.info if self.model is not None else None

    # ------------------------------------------------------------------ work

    @contextlib.contextmanager
    def admit(self, n_images: int, *, coming: int | None = None, arrived: float | None = None,
              caller: str = "", streamed: bool = False) -> Iterator[Admission]:
        with self.scheduling.admit(n_images, coming=coming, arrived=arrived, caller=caller, ready=self.ready,
                                   streamed=streamed) as admission:
            yield admission

    def wait_to_fetch(self, admission: Admission) -> None:
        """Until this request's turn to fetch comes (``rules.may_fetch``)."""
        self.scheduling.wait_to_fetch(admission)

    def admitted(self) -> int:
        """Images admitted and not yet answered, on this worker."""
        return self.scheduling.admitted()

    def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-bound ``fn`` in a native decode thread, before any image waiting for one; the calling
        greenlet waits cooperatively.

        ``GreenserveError``s (a bad image, say) are carried back and raised here, in the greenlet;
        gevent would otherwise print each one as a crashed task.
        """
        return self._in_decode_thread(None, 0, fn, args)

    def decode(self, fn: Callable[..., T], *args: Any, admission: Admission, index: int) -> T:
        """``offload`` for image ``index`` of a request: in the worker's request order, on the spare thread
        when the scheduling says so (``rules.decode_turn``)."""
        return self._in_decode_thread(admission, index, fn, args)

    def _in_decode_thread(self, admission: Admission | None, index: int, fn: Callable[..., T],
                          args: tuple[Any, ...]) -> T:
        with self.scheduling.decode_slot(admission, index) as spare:
            if spare:  # at the model's priority
                outcome = self._spare_decode.apply(_capture_expected, (self._inference_nice, fn, args))
            else:
                outcome = self._decode_pool.apply(_capture_expected, (self.settings.compute_nice, fn, args))
        if isinstance(outcome, _Raised):
            try:
                raise outcome.error
            finally:  # the error's traceback holds this frame: through ``outcome`` it would be a cycle, and
                outcome = None  # the failed body and its parsed document would wait for the cyclic GC
        return cast(T, outcome)

    def infer(self, pixels: np.ndarray | EncodedJpeg, deadline: float | None, admission: Admission) -> AsyncResult:
        return self.batcher.submit(pixels, deadline, admission)

    def tokenize(self, texts: Sequence[str]) -> Tokens:
        """Token ids (a decode thread); the caller submits them at once, without yielding to the hub."""
        self.scheduling.texts_coming += len(texts)
        try:
            return self.offload(self._text_model().tokenize, list(texts))
        finally:
            self.scheduling.texts_coming -= len(texts)

    def infer_text(self, ids: np.ndarray, deadline: float | None, admission: Admission) -> AsyncResult:
        return self.text_batcher.submit(ids, deadline, admission)

    def _text_model(self) -> TextModel:
        # requests for text reach here only admitted (the model is loaded) and checked by the api, which
        # refuses them with text_not_supported when the model has no text tower
        assert self.info is not None and "text" in self.info.towers
        return cast(TextModel, self.model)

    def _forward_texts(self, ids: np.ndarray) -> tuple[Any, None]:
        assert threading.current_thread() is not threading.main_thread()
        model = self._text_model()
        lower_priority(self._inference_nice)
        self.cores.apply(model)
        return model.encode_text(ids), None

    def _forward(self, batch: np.ndarray | list[np.ndarray | EncodedJpeg]) -> tuple[Any, Any] | BatchOutputs:
        assert self.model is not None and threading.current_thread() is not threading.main_thread()
        lower_priority(self._inference_nice)
        self.cores.apply(self.model)
        if isinstance(batch, np.ndarray):
            return self.model.forward(batch)
        return BatchOutputs(*cast(DeviceDecodingModel, self.model).forward_items(batch))  # JPEGs for the device


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: GreenserveError) -> None:
        self.error = error


def _capture_expected(nice: int, fn: Callable[..., T], args: tuple[Any, ...]) -> T | _Raised:
    lower_priority(nice)
    try:
        return fn(*args)
    except GreenserveError as err:
        return _Raised(err)
