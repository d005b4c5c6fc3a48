"""What one worker owns: the model, its one inference thread, the decode threads, the batcher, admission.

    Runner.start()          load + warm up the model in the inference thread (after fork; CUDA only there)
    Runner.admit(n)         reserve n image slots or raise Overloaded (503 + Retry-After) before any work
    Runner.wait_to_fetch()  hold a request's fetches while earlier requests have enough images on the way
    Runner.offload()        run CPU work (decode, preprocess, big JSON) in the decode pool, not on the hub;
                            decodes go in request order, a later request's held back (``_may_decode``)
    Runner.infer()          queue one image for the batcher; wait on the returned result cooperatively

Across workers: a worker whose siblings are all idle (``Siblings``, a view of the balance board) lets
torch use every core.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, Protocol, TypeVar

import gevent
import numpy as np
from gevent.event import AsyncResult, Event
from gevent.threadpool import ThreadPool

from service import metrics
from service.engine.batcher import GATHER_WHILE_DECODING, Batcher
from service.engine.model import ModelInfo
from service.engine.transform import Transform
from service.errors import GreenserveError, Overloaded
from service.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")

NOT_READY_RETRY_S = 5


class Model(Protocol):
    """What the runner needs of a model (the real one is ``service.engine.model.LoadedModel``)."""

    info: ModelInfo

    def forward(self, batch: np.ndarray) -> tuple[Any, Any]: ...

    def warm_up(self) -> None: ...


class Siblings(Protocol):
    """What the runner reads of the other workers on this host (``service.balance.gate.Balance``)."""

    def siblings_idle(self) -> bool: ...


class Runner:
    def __init__(self, settings: Settings, *, model: Model | None = None,
                 loader: Callable[[], Model] | None = None, cores: int | None = None,
                 siblings: Siblings | None = None) -> None:
        self.settings = settings
        self._infer_pool = ThreadPool(1)  # the worker-local lock: one native thread touches the model
        self._decode_pool = ThreadPool(settings.decode_threads_per_worker())
        self._decode_slots = RankedSlots(self._decode_pool.maxsize, ready=self._may_decode)
        # below the hub (HTTP, health checks) come the model, then decode: see ``lower_priority``
        self._inference_nice = settings.compute_nice // 2
        self._loader = loader
        self.model: Model | None = model
        self.load_error: BaseException | None = None
        self._ready = Event()
        self._admitted = 0
        self._siblings = siblings
        self._cores = cores or len(os.sched_getaffinity(0))
        self._threads_now = 0
        self._upstream = 0  # admitted images not yet at the batcher (being fetched or decoded)
        self._admissions: list[Admission] = []  # requests admitted and not finished, in arrival order
        self._settling = Event()  # set (and replaced) whenever upstream images settle or a request ends
        self._offloaded = 0  # tasks waiting for or running in the decode pool
        self.batcher = Batcher(self._forward, self._infer_pool, max_batch=settings.max_batch,
                               max_wait_s=settings.max_batch_wait_ms / 1000,
                               across_requests=settings.batch_across_requests,
                               upstream=lambda: self._upstream, gather=self._gathering,
                               on_take=self._decode_slots.recheck)
        self.batcher.stats.on_batch = metrics.observe_batch
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
        metrics.MODEL_LOAD_SECONDS.set(info.load_seconds)
        log.info("model ready: %s (%s weights) on %s, embedding_dim=%s, %d labels, loaded in %.2fs",
                 info.name, info.weights, info.device, info.embedding_dim, len(info.labels), info.load_seconds)
        self._ready.set()

    def _load_in_thread(self) -> Model:
        assert self._loader is not None
        lower_priority(self._inference_nice)  # before torch starts its threads: they inherit it
        model = self._loader()
        model.warm_up()
        return model

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def transform(self) -> Transform:
        assert self.model is not None
        return self.model.info.transform

    @property
    def labels(self) -> tuple[str, ...]:
        assert self.model is not None
        return self.model.info.labels

    # ------------------------------------------------------------------ load and admission

    @contextlib.contextmanager
    def admit(self, n_images: int, arrived: float | None = None) -> Iterator[Admission]:
        """Reserve ``n_images`` of this worker's queue, or refuse at once with 503 + Retry-After.
        ``arrived`` (monotonic, default now) places the request among the worker's others."""
        if not self.ready:
            metrics.OVERLOADED.labels("not_ready").inc()
            raise Overloaded("the model is still loading on this worker; retry shortly",
                             retry_after_s=NOT_READY_RETRY_S, code="not_ready")
        limit = self.settings.max_queue_images
        if self._admitted and self._admitted + n_images > limit:
            metrics.OVERLOADED.labels("queue_full").inc()
            wait = self._admitted * self.batcher.stats.seconds_per_image
            raise Overloaded(f"this worker has {self._admitted} image(s) queued or running (limit {limit}); "
                             f"retry after ~{wait:.1f}s or spread load over more workers/replicas",
                             retry_after_s=wait)
        admission = Admission(self, n_images, time.monotonic() if arrived is None else arrived)
        self._admitted += n_images
        self._upstream += n_images
        self._admissions.append(admission)
        metrics.QUEUE_IMAGES.inc(n_images)
        try:
            yield admission
        except BaseException:
            admission.cancelled = True
            self.batcher.cancel(admission)  # failed, timed out or its client left: drop its queued images
            raise
        finally:
            self._admitted -= n_images
            self._admissions.remove(admission)
            self._settled(admission.upstream)
            metrics.QUEUE_IMAGES.dec(n_images)

    def _settled(self, n: int) -> None:
        self._upstream -= n
        if n and not self._upstream:
            self.batcher.wake()  # a batch waiting for more images need not wait any longer
        settling, self._settling = self._settling, Event()
        settling.set()

    def wait_to_fetch(self, admission: Admission) -> None:
        """Wait (cooperatively) until this worker's earlier requests have at most ``fetch_concurrency``
        images still to fetch or decode, then let ``admission``'s request fetch its images.

        A worker serves its requests in arrival order (``_may_decode``), so a later request's images
        are only needed when the earlier ones are nearly decoded. Fetching them all at once held every
        queued request's bytes in memory (8 albums on 2 workers: 733 MB) and kept the hub reading
        them when it should answer. The earliest request never waits, and the next one starts fetching
        while the model still has the earlier requests' forwards to run, which hides the image hosts'
        latency.
        """
        ahead = self.settings.fetch_concurrency
        while sum(a.upstream for a in self._admissions if a.arrived < admission.arrived) > ahead:
            self._settling.wait()

    # ------------------------------------------------------------------ work

    def offload(self, fn: Callable[..., T], *args: Any, rank: tuple[float, int] | None = None) -> T:
        """Run CPU-bound ``fn`` in a native decode thread; the calling greenlet waits cooperatively.

        Tasks start in ``rank`` order (the request's arrival, the image's index), unranked ones first: the
        images of the earliest request are decoded first, so it can finish first (decoded in the order
        their bytes came, concurrent requests would all finish late together).

        ``GreenserveError``s (a bad image, say) are carried back and raised here, in the greenlet;
        gevent would otherwise print each one as a crashed task.
        """
        self._offloaded += 1
        try:
            with self._decode_slots.take((float("-inf"), 0) if rank is None else rank):
                outcome = self._decode_pool.apply(_capture_expected, (self.settings.compute_nice, fn, args))
        finally:
            self._offloaded -= 1
        if isinstance(outcome, _Raised):
            raise outcome.error
        return outcome

    def _may_decode(self, rank: tuple[float, int]) -> bool:
        """Whether an image of the request that arrived at ``rank[0]`` may be decoded now: not while the
        model already has ``decode_threads`` images of earlier requests waiting for it.

        A request's images then reach the model after the earlier requests' images, and decoding them
        earlier would only take the cores from the forwards of the earlier requests: with every
        request's decode running at once, all of a worker's requests finish late together, where a
        queue of requests finishes the first one first. The model does not starve: a batch takes the
        waiting images at once, and the later request's decode starts while that batch runs. The
        earliest request is never held back, nor images that trickle in from a slow host (its earlier
        requests' images are not waiting).
        """
        return self.batcher.queued_before(rank[0]) < self._decode_pool.maxsize

    def infer(self, pixels: np.ndarray, deadline: float | None = None, group: Admission | None = None,
              arrived: float | None = None) -> AsyncResult:
        return self.batcher.submit(pixels, deadline, group, arrived)

    def _forward(self, batch: np.ndarray) -> tuple[Any, Any]:
        assert self.model is not None and threading.current_thread() is not threading.main_thread()
        lower_priority(self._inference_nice)
        self._pick_threads()
        return self.model.forward(batch)

    def _pick_threads(self) -> None:
        """In the inference thread, before each batch: every core when alone, else this worker's share."""
        set_threads = getattr(self.model, "set_threads", None)
        if set_threads is None or self.settings.torch_threads or not self.settings.borrow_idle_cores:
            return
        wanted = self._forward_threads()
        if wanted != self._threads_now:
            log.debug("torch threads %d -> %d", self._threads_now, wanted)
            set_threads(wanted)
            self._threads_now = wanted

    def _forward_threads(self) -> int:
        """The torch threads of this worker's next forward: pinned (``GREENSERVE_TORCH_THREADS``), else
        every core while borrowing and no sibling is busy, else its share of the cores."""
        share = self.settings.torch_threads_per_worker(self._cores)
        if self.settings.torch_threads or not self.settings.borrow_idle_cores:
            return share
        return self._cores if self._alone() else share

    def _alone(self) -> bool:
        """No sibling worker is busy (false outside gunicorn, where nothing is known of siblings)."""
        return self._siblings is not None and self._siblings.siblings_idle()

    def _gathering(self) -> int:
        """Whether a batch should keep gathering its request's images (see ``Batcher``): 0 unless this
        worker's next forward runs on every core; ``GATHER_WHILE_DECODING`` while its decode threads are
        busy too (a forward now would stall them and be stalled)."""
        if self._forward_threads() < self._cores:
            return 0
        return GATHER_WHILE_DECODING if self._offloaded else 1


class Admission:
    """A request's reserved images; ``upstream`` of them are still being fetched or decoded."""

    __slots__ = ("upstream", "arrived", "cancelled", "_runner")

    def __init__(self, runner: Runner, n_images: int, arrived: float) -> None:
        self._runner = runner
        self.upstream = n_images
        self.arrived = arrived
        self.cancelled = False

    def settle(self, n: int = 1) -> None:
        """``n`` of the request's images reached the batcher, or failed on the way."""
        self.upstream -= n
        self._runner._settled(n)


class RankedSlots:
    """At most ``n`` holders at a time; waiting greenlets get a slot in rank order, lowest first.

    ``ready(rank)`` (optional) may hold a rank back even with a slot free; it must be monotonic (if it
    holds a rank back, it holds back every later rank too). Call ``recheck()`` when its answer may have
    changed.
    """

    def __init__(self, n: int, ready: Callable[[tuple[float, int]], bool] | None = None) -> None:
        self._free = n
        self._ready = ready
        self._waiting: list[list[Any]] = []  # heap of [rank, seq, event, still waiting]
        self._seq = itertools.count()

    @contextlib.contextmanager
    def take(self, rank: tuple[float, int]) -> Iterator[None]:
        entry = [rank, next(self._seq), Event(), True]
        heapq.heappush(self._waiting, entry)
        self.recheck()
        try:
            entry[2].wait()
        except BaseException:  # killed (deadline): give up the place, or the slot handed over
            entry[3] = False
            if entry[2].is_set():
                self._release()
            raise
        try:
            yield
        finally:
            self._release()

    def recheck(self) -> None:
        """Hand free slots to the best waiters that are ready."""
        while self._free and self._waiting:
            entry = self._waiting[0]
            if not entry[3]:  # killed while waiting
                heapq.heappop(self._waiting)
                continue
            if self._ready is not None and not self._ready(entry[0]):
                return  # held back, and so is every later rank
            heapq.heappop(self._waiting)
            entry[3] = False
            self._free -= 1
            entry[2].set()

    def _release(self) -> None:
        self._free += 1
        self.recheck()


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: GreenserveError) -> None:
        self.error = error


_priority = threading.local()


def lower_priority(nice: int) -> None:
    """Make the calling native thread ``nice`` steps less urgent than the hub thread, once per thread.

    Linux keeps a nice value per thread; threads that torch starts later inherit it. Measured at
    saturation (2 workers, resnet50, 30-photo albums, 2 cores), /healthz p99: 65-99 ms with every thread
    at the hub's priority, 20-33 ms with decode and inference at +10. But +10 on the inference thread
    also cost a lone 1-image request ~10 ms (26-38 ms over bare instead of 16-25), so the inference
    thread gets half the step (decode +10, inference +5: p99 31 ms, 19 ms over bare).
    """
    if not nice or getattr(_priority, "nice", None) is not None or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    _priority.nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    os.setpriority(os.PRIO_PROCESS, tid, _priority.nice)


def _capture_expected(nice: int, fn: Callable[..., T], args: tuple[Any, ...]) -> T | _Raised:
    lower_priority(nice)
    try:
        return fn(*args)
    except GreenserveError as err:
        return _Raised(err)

