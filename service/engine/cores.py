"""How many cores a worker's forward uses, and how urgent its native threads are.

    CorePlan      torch threads for the next forward: pinned (GREENSERVE_TORCH_THREADS), every core while
                    no sibling worker is busy (GREENSERVE_BORROW_IDLE_CORES), else this worker's share
    lower_priority  a native thread runs some nice steps below the hub: the hub answers HTTP and health
                    checks first on saturated cores, then the model, then decode (figures: docs/SCHEDULING.md)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Protocol

from service.settings import Settings

log = logging.getLogger(__name__)


class Siblings(Protocol):
    """What a worker reads of the other workers on its host (``service.balance.gate.Balance``)."""

    def siblings_idle(self) -> bool: ...


class CorePlan:
    def __init__(self, settings: Settings, cores: int, siblings: Siblings | None = None) -> None:
        self.cores = cores
        self._share = settings.torch_threads_per_worker(cores)
        self._borrow = settings.borrow_idle_cores and not settings.torch_threads
        self._siblings = siblings
        self._now = 0

    def forward_threads(self) -> int:
        if self._borrow and self._siblings is not None and self._siblings.siblings_idle():
            return self.cores
        return self._share

    def all_cores(self) -> bool:
        """Whether the next forward runs on every core (then nothing else should compete for them)."""
        return self.forward_threads() >= self.cores

    def apply(self, model: Any) -> None:
        """In the inference thread, before each batch: set the model's threads if the plan changed."""
        set_threads = getattr(model, "set_threads", None)  # optional: TorchScript and fakes may lack it
        if set_threads is None or not self._borrow:
            return
        wanted = self.forward_threads()
        if wanted != self._now:
            log.debug("torch threads %d -> %d", self._now, wanted)
            set_threads(wanted)
            self._now = wanted


_priority = threading.local()


def lower_priority(nice: int) -> None:
    """Make the calling native thread ``nice`` steps less urgent than the hub thread, once per thread.
    Linux keeps a nice value per thread; threads that torch starts later inherit it."""
    if not nice or getattr(_priority, "nice", None) is not None or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    _priority.nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    os.setpriority(os.PRIO_PROCESS, tid, _priority.nice)
