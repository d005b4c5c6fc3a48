"""A short forward that runs between the blocks of a long one, on the same inference thread.

A worker has one inference thread, so an image that arrives while a gathered 30-photo batch runs waits for
all of it however fair its tag; capping every forward at a quantum would cost the batch its efficiency
(docs/SCHEDULING.md, "interject"). Instead, the model's blocks (every module
held in a ``Sequential`` or ``ModuleList``) get a pre-hook; when the batcher has offered a short forward,
the next block's hook runs it first, then the long forward goes on from where it was. Its activations stay
as they were: a hook only runs between two module calls.

    Preemption.install(module)      hook the model's blocks (0 points: offers are always refused)
    Preemption.expect()             in the hub, as a long forward is handed to the inference thread
    Preemption.run(fn, *args)       in the inference thread: that forward, interrupted at its points
    Preemption.offer(fn, *args)     in the hub: run this at the running forward's next point, or None
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import gevent
import torch
from gevent.event import AsyncResult
from gevent.monkey import get_original
from gevent.threadpool import ThreadResult
from torch import nn

T = TypeVar("T")

# the lock is taken by the hub thread and the inference thread: the real one, not gevent's (patched) one
_allocate_lock = get_original("_thread", "allocate_lock")


class Interjection(Generic[T]):
    """One short forward offered to a running one: built in the hub thread, run in the inference thread,
    waited for in a greenlet (``get``)."""

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        self._fn = fn
        self._args = args
        self._done: AsyncResult = AsyncResult()
        # the inference thread wakes the hub through a libev async watcher (``ThreadResult``)
        self._signal = ThreadResult(self._received, gevent.get_hub(), _nothing)

    def run(self) -> None:
        """In the inference thread."""
        try:
            value: Any = self._fn(*self._args)
        except BaseException as exc:  # handed to the waiting greenlet, raised there
            value = _Failed(exc)
        self._signal.set(value)

    def _received(self, signal: ThreadResult) -> None:
        self._done.set(signal.value)  # in the hub; the ThreadResult forgets its value right after

    def get(self, timeout: float | None = None) -> T:
        """In a greenlet: the forward's result, once it ran."""
        value = self._done.get(timeout=timeout)
        if isinstance(value, _Failed):
            raise value.error
        return cast(T, value)


class Preemption:
    """Points between a model's blocks where one offered forward may run (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = _allocate_lock()
        self._open = False  # a long forward that can be interrupted is running
        self._pending: Interjection[Any] | None = None
        self._inside = False  # an interjection runs: its own blocks are not points
        self._spent = 0.0  # seconds in interjections during the running forward (inference thread only)
        self.points = 0

    def install(self, module: nn.Module) -> int:
        """Hook every module held in a ``Sequential`` or ``ModuleList`` under ``module``: a network's blocks,
        and the layers inside them (a ViT-B/32: 12 blocks, 48 points). TorchScript modules take no Python
        hooks: a scripted model has no points, and offers to it are refused."""
        hooked: set[int] = set()
        for container in module.modules():
            if isinstance(container, (nn.Sequential, nn.ModuleList)) and not _scripted(container):
                for child in container.children():
                    if id(child) not in hooked and not _scripted(child):
                        hooked.add(id(child))
                        child.register_forward_pre_hook(self._point)
        self.points += len(hooked)
        return len(hooked)

    def expect(self) -> None:
        """In the hub, as a long forward is handed to the inference thread (``run``): offers are taken from
        now. An offer made before the thread starts it runs at its first point."""
        with self._lock:
            self._open = True

    def run(self, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
        """In the inference thread, after ``expect``: ``fn(*args)``, its result and the seconds spent in
        interjections meanwhile (not the long forward's own time). Offers end with it."""
        self._spent = 0.0
        try:
            value = fn(*args)
        finally:
            with self._lock:
                self._open = False
            self._run_pending()  # offered after the last point: it was promised a run
        return value, self._spent

    def offer(self, fn: Callable[..., T], *args: Any) -> Interjection[T] | None:
        """In the hub: ``fn(*args)`` runs at the running forward's next point (or as it ends); None when no
        forward that takes one is running, or one is already offered."""
        if not self.points:
            return None
        with self._lock:
            if not self._open or self._pending is not None or self._inside:
                return None
            job = self._pending = Interjection(fn, args)
        return job

    def _point(self, _module: nn.Module, _args: Any) -> None:
        if self._pending is not None and not self._inside:
            self._run_pending()

    def _run_pending(self) -> None:
        with self._lock:
            job, self._pending = self._pending, None
        if job is None:
            return
        began = time.perf_counter()
        self._inside = True
        try:
            job.run()
        finally:
            self._inside = False
            self._spent += time.perf_counter() - began


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _nothing() -> None:
    pass


def _scripted(module: nn.Module) -> bool:
    return isinstance(module, torch.jit.ScriptModule)
