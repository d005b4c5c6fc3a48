"""A replacement worker boots at a lower CPU priority, and takes its own back once its model is ready.

After a HUP or a respawn, the new worker imports torch and loads its model on the cores its serving siblings
use, and slowed every request served meanwhile (docs/SCHEDULING.md#hand-over). Booting at ``BOOT_NICE``
leaves those cores to the siblings that serve; the boot takes longer, and
the old workers serve until it is done (``gunicorn_worker``).

Linux nice values are per thread, so both steps renice every thread of the process, each by the boot's
step: threads the worker set below its hub (``engine.cores.lower_priority``: the model +5, decode +10) keep
their distance from it. Going back up needs ``CAP_SYS_NICE`` or an
``RLIMIT_NICE`` that allows it (systemd's ``LimitNICE=``); without either, the worker boots at its normal
priority, as it never could take it back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys

log = logging.getLogger(__name__)

BOOT_NICE = 10  # added to the worker's nice value while it boots beside serving siblings
CAP_SYS_NICE = 23  # linux/capability.h


class BootPriority:
    """One worker's boot priority: ``lower`` in the worker before torch loads, ``restore`` when it serves."""

    def __init__(self) -> None:
        self._normal: int | None = None  # the hub's nice value to go back to; None while not lowered
        self._by = 0

    def lower(self, by: int = BOOT_NICE) -> bool:
        """Boot at ``by`` more nice, where the process may take it back; True if it did."""
        if not sys.platform.startswith("linux"):
            return False
        normal = os.getpriority(os.PRIO_PROCESS, 0)
        if not may_raise_to(normal):
            log.info("this worker boots at its normal priority: raising it back needs CAP_SYS_NICE or "
                     "RLIMIT_NICE (LimitNICE=) of at least %d", 20 - normal)
            return False
        self._normal, self._by = normal, by
        _renice_all(by)
        return True

    def restore(self) -> None:
        """Every thread back to the normal priority (idempotent)."""
        if self._normal is None:
            return
        _renice_all(-self._by, floor=self._normal)
        self._normal = None

    @property
    def lowered(self) -> bool:
        return self._normal is not None


def may_raise_to(nice: int) -> bool:
    """Whether this process may lower a thread's nice value to ``nice`` (setpriority(2): RLIMIT_NICE is
    ``20 - nice``, or the capability)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or soft >= 20 - nice:
        return True
    return _capable(CAP_SYS_NICE)


def _capable(cap: int) -> bool:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> cap & 1)
    except OSError:
        pass
    return False


def _renice_all(step: int, floor: int = -20) -> None:
    """Every thread's nice value moved by ``step``, within [floor, 19]. (A thread started during the boot
    at 19 by the cap comes back a little above its intended value.)"""
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            nice = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(floor, min(19, nice + step)))
