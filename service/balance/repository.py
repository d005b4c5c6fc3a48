"""Which of the configured models the host's workers serve now: the model-repository API's load and unload,
agreed in shared memory the master allocates before forking. Torch-free: the master imports it.

    want        the worker that gets the API call writes the wanted state of model i (serve, or unloaded)
    follow      every worker reads the wanted states every ``FOLLOW_S`` and applies them to its engines (through
                the callbacks the app wires in), then reports on its slot what it serves and which change it
                has seen (each ``want`` is numbered)
    agreed      the call returns once every live worker has seen the change and reports the wanted state (or
                503 past its timeout): a report from before the change counts for nothing, so a worker that
                became ready just before an unload cannot agree with it before it has withdrawn the model

A worker started later (a respawn, a HUP's new generation) reads the same wanted states before it serves: the
board lives in the master for the server's life. Models are named by their place in GREENSERVE_MODELS, the
same in every worker of a master.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable, Sequence

import gevent

log = logging.getLogger(__name__)
MAX_MODELS = 64
FOLLOW_S = 0.1


class SharedRepository:
    def __init__(self, slots: int) -> None:
        # 1: served (the start), 0: unloaded through the API; single-byte writes only
        self._wanted = multiprocessing.RawArray("b", [1] * MAX_MODELS)
        self._serving = multiprocessing.RawArray("b", slots * MAX_MODELS)  # per worker slot: 1 serves model i
        # the number of the last change, and per slot the last one its worker had read when it reported (two
        # changes at once in two workers may share a number: each waits for reports made after both)
        self._change = multiprocessing.RawValue("q", 0)
        self._seen = multiprocessing.RawArray("q", slots)

    def want(self, index: int, serve: bool) -> int:
        """Record the wanted state of model ``index``; the change's number."""
        self._wanted[index] = int(serve)
        self._change.value += 1
        return int(self._change.value)

    def wanted(self, index: int) -> bool:
        return bool(self._wanted[index])

    def change(self) -> int:
        return int(self._change.value)

    def report(self, slot: int, index: int, serving: bool) -> None:
        self._serving[slot * MAX_MODELS + index] = int(serving)

    def seen(self, slot: int, change: int) -> None:
        self._seen[slot] = change

    def agreed(self, index: int, serve: bool, change: int, slots: Sequence[int]) -> bool:
        return all(self._seen[slot] >= change and bool(self._serving[slot * MAX_MODELS + index]) == serve
                   for slot in slots)


class Follower:
    """One worker following the repository: ``apply(name, serve)`` starts serving or unloading a model (or
    does nothing when that is under way or done), ``serving(name)`` says whether it serves it now (its towers
    in place), ``live()`` every live worker's slot."""

    def __init__(self, repository: SharedRepository, slot: int, models: Sequence[str],
                 apply: Callable[[str, bool], None], serving: Callable[[str], bool],
                 live: Callable[[], list[int]]) -> None:
        if len(models) > MAX_MODELS:
            raise ValueError(f"{len(models)} models; the repository holds {MAX_MODELS}")
        self._repository, self._slot, self._models = repository, slot, list(models)
        self._apply, self._serving, self._live = apply, serving, live
        self._loop: gevent.Greenlet | None = None

    def start(self) -> None:
        self.follow()
        self._loop = gevent.spawn(self._follow_forever)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.kill()

    def follow(self) -> None:
        # applied on every tick, not only when ``serving`` differs: a worker still loading serves nothing, so
        # it agrees with an unload at once, and must withdraw the model before it becomes ready (``apply`` is
        # idempotent)
        change = self._repository.change()  # read first: the states read after it are at least this new
        for index, name in enumerate(self._models):
            self._apply(name, self._repository.wanted(index))
            self._repository.report(self._slot, index, self._serving(name))
        self._repository.seen(self._slot, change)

    def set(self, name: str, serve: bool, timeout_s: float) -> bool:
        """Make every worker serve ``name`` (or unload it); whether they all did within ``timeout_s``."""
        index = self._models.index(name)
        change = self._repository.want(index, serve)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.follow()
            if self._repository.agreed(index, serve, change, [self._slot, *self._live()]):
                log.info("model %s %s on every worker", name, "served" if serve else "unloaded")
                return True
            gevent.sleep(FOLLOW_S)
        return False

    def _follow_forever(self) -> None:
        while True:
            gevent.sleep(FOLLOW_S)
            self.follow()
