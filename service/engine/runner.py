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
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, cast

import gevent
import numpy as np
from gevent.event import AsyncResult
from gevent.threadpool import ThreadPool
from torch import nn

from service import metrics
from service.engine.batcher import Batcher
from service.engine.cores import CorePlan, Siblings, lower_priority
from service.engine.engine import Engine, Model
from service.engine.forwarding import BatchStats
from service.engine.model_set import Residency, model_set
from service.engine.preemption import Preemption
from service.engine.residency import Tower, Towers
from service.engine.scheduling import Admission, Limits, Scheduler, Signals
from service.engine.scheduling.rules import lane
from service.engine.towers import TowerFile, give_back_freed_memory, reload, tower_files, unload
from service.engine.types import BatchOutputs, EncodedJpeg, ModelInfo, ModelLoadError, Tokens
from service.errors import GreenserveError, Overloaded
from service.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")


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
                 siblings: Siblings | None = None,
                 loaders: Mapping[str, Callable[[], Model]] | None = None) -> None:
        """``loaders``: each served model's loader, by name (``catalog.model_set``); ``model`` or ``loader``
        alone: a set of one (a given model is served under its own name)."""
        self.settings = settings
        self._infer_pool = ThreadPool(1)  # the worker-local lock: one native thread touches the models
        self._decode_pool = ThreadPool(settings.decode_threads_per_worker())
        self._spare_decode = ThreadPool(1)  # a caller's first image while every decode thread is another's
        self._loader_pool = ThreadPool(1)  # towers loaded again and unloaded, beside the inference thread
        self.towers = Towers(self._loader_pool, settings.max_resident_towers)
        self._tower_dir = Path(settings.cache_directory()) / "towers"
        # below the hub (HTTP, health checks) come the model, then decode: see ``cores.lower_priority``
        self._inference_nice = settings.compute_nice // 2
        self.cores = CorePlan(settings, cores or len(os.sched_getaffinity(0)), siblings)
        self._preemption = Preemption() if settings.preempt_forwards else None
        stats = BatchStats(on_batch=metrics.observe_batch, on_interjected=metrics.INTERJECTED.inc)
        self.scheduling = Scheduler(limits(settings, self._decode_pool.maxsize), Signals(
            all_cores=self.cores.all_cores, seconds_per_image=lambda: stats.seconds_per_image,
            preemptible=lambda: self._preemption is not None and self._preemption.points > 0,
            image_costs=lambda: {name: e.image_costs for name, e in self.engines.items() if e.image_costs}))
        self.batcher = Batcher(self._forward, self._infer_pool, self.scheduling.images,
                               self.scheduling.image_rules(), preemption=self._preemption, stats=stats)
        # texts get their own batcher on the same one-thread pool: their forwards take turns with the
        # images' batches and are never mixed into one
        self.text_batcher = Batcher(self._forward_texts, self._infer_pool, self.scheduling.texts,
                                    self.scheduling.text_rules(), offers=self._preemption,
                                    stats=BatchStats(on_batch=metrics.observe_text_batch))
        if loaders is None:
            spec = model_set(settings)[0]
            spec = replace(spec, name=model.info.name) if model is not None and not settings.models else spec
            loaders = {spec.name: loader} if loader is not None else {}
            self.engines = {spec.name: Engine(spec, model)}
        else:
            self.engines = {s.name: Engine(s) for s in model_set(settings)}
        self._loaders = dict(loaders)
        # a load error no retry fixes (the settings name a model or weights that cannot load): the worker
        # ends the server with it (``service.balance.gunicorn_worker``)
        self.fatal_error: ModelLoadError | None = None
        self._loading: gevent.Greenlet | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Begin serving: load the models in the background (one after another, the default first)."""
        self.batcher.start()
        self.text_batcher.start()
        if self._loaders:
            self._loading = gevent.spawn(self._load_all)

    def _load_all(self) -> None:
        for name, engine in self.engines.items():
            if engine.model is None and name in self._loaders:
                self._load(engine, self._loaders[name])

    def _load(self, engine: Engine, loader: Callable[[], Model]) -> None:
        try:
            loaded = self._infer_pool.apply(self._load_in_thread, (loader,))
        except gevent.GreenletExit:  # the worker is exiting (``close``): not a failed load
            raise
        except BaseException as exc:  # logged loudly; /readyz stays 503 and says why
            engine.failed(exc)
            log.critical("model %s failed to load: %s", engine.name, exc, exc_info=True)
            return
        if isinstance(loaded, ModelLoadError):  # one line: its message says what to change
            engine.failed(loaded)
            self.fatal_error = self.fatal_error or loaded
            log.critical("cannot serve %s: %s", engine.name, loaded)
            return
        model, files = loaded
        info = model.info
        metrics.MODEL_LOAD_SECONDS.set(info.load_seconds)
        log.info("model ready: %s (%s weights) on %s in %s, embedding_dim=%s, %d labels, loaded in %.2fs",
                 info.name, info.weights, info.device, info.dtype, info.embedding_dim, len(info.labels),
                 info.load_seconds)
        engine.loaded(model)
        for tower, file in files.items():
            self.towers.add(Tower(engine.name, tower, engine.spec.residency.get(tower, Residency()),
                                  functools.partial(self._reload, file),
                                  functools.partial(unload, file), info.load_seconds, file.nbytes()))
        if engine.withdrawn:  # unloaded through the repository API while it loaded
            self.towers.unload_model(engine.name)

    def _reload(self, file: TowerFile) -> None:
        """In the loader thread, below the hub like the model: ``towers.reload``."""
        lower_priority(self._inference_nice)
        reload(file)

    def _load_in_thread(self, loader: Callable[[], Model]) -> tuple[Model, dict[str, TowerFile]] | ModelLoadError:
        lower_priority(self._inference_nice)  # before torch starts its threads: they inherit it
        try:
            model = loader()
        except ModelLoadError as exc:  # returned: raised, gevent would print its traceback, burying the message
            return exc
        module = getattr(model, "module", None)  # ``LoadedModel.module``; test doubles have none
        if self._preemption is not None and isinstance(module, nn.Module) and getattr(model, "runs_module", True):
            log.debug("%d preemption points in the model", self._preemption.install(module))
        files = tower_files(model, self._tower_dir)
        if files and str(getattr(model, "device", "cpu")) == "cpu":  # a GPU's copy is the device's memory
            for file in files.values():
                file.rebase()
            cast(Any, model).forget_casts()  # the originals the casts kept would hold the old memory
            give_back_freed_memory()
        model.warm_up()
        return model, files

    def close(self, timeout_s: float) -> bool:
        """At the worker's exit: batch nothing more and end the native threads, waiting up to ``timeout_s``
        for a model load or forward in progress. False: one is still in torch, and the process must exit
        without the interpreter's finalization. Finalization ends a daemon thread that takes the GIL back
        with ``pthread_exit``, whose unwinding through torch's GIL-release destructor (noexcept) is
        ``std::terminate``: "terminate called without an active exception" and SIGABRT (pytorch#38228)."""
        self.batcher.stop()
        self.text_batcher.stop()
        self.towers.stop()
        if self._loading is not None:
            self._loading.kill()  # a load not begun never starts; one in its thread goes on (waited for below)
        pools = (self._infer_pool, self._decode_pool, self._spare_decode, self._loader_pool)
        with gevent.Timeout(timeout_s, False):
            while any(pool.size or len(pool) for pool in pools):  # again if a greenlet queued more meanwhile
                for pool in pools:
                    pool.kill()  # each thread ends after its task; waits for them
            return True
        return False

    def engine(self, name: str | None = None) -> Engine:
        """A served model's engine; KeyError for a name not served. Without a name, the default: the first
        configured model not unloaded through the repository API (unloading the default makes the next one
        the default: a model switch without an outage, docs/MODELS.md)."""
        if name is not None:
            return self.engines[name]
        engines = list(self.engines.values())
        return next((e for e in engines if not e.withdrawn), engines[0])

    def serve(self, name: str, want: bool) -> None:
        """Serve a configured model again, or unload it (the repository API): its towers out of memory, its
        requests refused with 503 until it is served again. Idempotent: a change under way goes on."""
        engine = self.engines[name]
        if not want and not engine.withdrawn:
            engine.withdrawn = True
            self.towers.unload_model(name)
        elif want and engine.withdrawn and not self.towers.changing(name):
            self.towers.load_model(name, done=lambda: setattr(engine, "withdrawn", False))

    def serving(self, name: str) -> bool:
        """Whether this worker serves ``name`` now (an unload under way still counts: its memory is still held)."""
        engine = self.engines[name]
        return engine.ready and (not engine.withdrawn or self.towers.changing(name))

    @property
    def ready(self) -> bool:
        """Every served model is loaded."""
        return all(engine.ready for engine in self.engines.values())

    @property
    def info(self) -> ModelInfo | None:
        """The default model's facts, or None while it loads (or after it failed)."""
        return self.engine().info

    @property
    def load_error(self) -> BaseException | None:
        return next((e.load_error for e in self.engines.values() if e.load_error is not None), None)

    @property
    def model(self) -> Model | None:
        return self.engine().model

    @model.setter
    def model(self, value: Model | None) -> None:  # tests: as before the model has loaded
        self.engine().model = value

    # ------------------------------------------------------------------ work

    @contextlib.contextmanager
    def admit(self, n_images: int, *, coming: int | None = None, arrived: float | None = None,
              caller: str = "", streamed: bool = False, model: str | None = None, towers: tuple[str, ...] = (),
              deadline: float | None = None, urgency: int = 3) -> Iterator[Admission]:
        """Reserve queue slots for a request to ``model`` (the default without one) once the ``towers`` it needs
        are in memory (``residency``): 503 while it loads, or when a tower cannot be back by ``deadline``."""
        engine = self.engine(model)
        if engine.withdrawn:
            raise Overloaded(f"the model {engine.name!r} is unloaded on this server; load it with POST "
                             f"/v2/repository/models/{engine.name}/load", retry_after_s=60, code="model_unavailable")
        if engine.ready:
            self.towers.ensure(engine.name, towers, deadline or time.monotonic() + self.settings.request_timeout_s)
        with self.towers.using(engine.name, towers), \
                self.scheduling.admit(n_images, coming=coming, arrived=arrived, caller=caller, ready=engine.ready,
                                      streamed=streamed, model=engine.name, lane=lane(urgency)) as admission:
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

    def tokenize(self, texts: Sequence[str], model: str | None = None) -> Tokens:
        """Token ids (a decode thread); the caller submits them at once, without yielding to the hub."""
        self.scheduling.texts_coming += len(texts)
        try:
            return self.offload(self.engine(model).text_model().tokenize, list(texts))
        finally:
            self.scheduling.texts_coming -= len(texts)

    def infer_text(self, ids: np.ndarray, deadline: float | None, admission: Admission) -> AsyncResult:
        return self.text_batcher.submit(ids, deadline, admission)

    def _forward_texts(self, model: str, ids: np.ndarray) -> tuple[Any, None]:
        assert threading.current_thread() is not threading.main_thread()
        text_model = self.engines[model].text_model()
        lower_priority(self._inference_nice)
        self.cores.apply(text_model)
        return text_model.encode_text(ids), None

    def _forward(self, model: str, batch: np.ndarray | list[np.ndarray | EncodedJpeg]) -> tuple[Any, Any] | BatchOutputs:
        engine = self.engines[model]
        lower_priority(self._inference_nice)
        self.cores.apply(engine.model)
        return engine.forward(batch)


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
