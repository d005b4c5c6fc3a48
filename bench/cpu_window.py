"""Where a window's CPU went: a server's workers against the whole machine, in % of all cores.

A bare pipeline pays only for the model's work; a served one shares the cores with its load generator and image
host, and may leave them idle while a batch gathers. ``busy - workers`` is the first, ``100 - busy`` the second.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from bench.gpu_parts import cpu_seconds

T = TypeVar("T")


def machine_cpu() -> tuple[int, int]:
    """Busy and all CPU ticks of every core since boot (``/proc/stat``: idle and iowait are not busy)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def cpu_window(pids: Callable[[], Iterable[int]], run: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """``run()``, with the CPU of the processes ``pids()`` names and the machine's busy CPU meanwhile."""
    (busy0, all0), workers0 = machine_cpu(), cpu_seconds(pids())
    out = run()
    (busy1, all1), workers1 = machine_cpu(), cpu_seconds(pids())
    ticks = max(1, all1 - all0)
    return out, {"workers_cpu_pct": round(100 * (workers1 - workers0) * os.sysconf("SC_CLK_TCK") / ticks, 1),
                 "busy_cpu_pct": round(100 * (busy1 - busy0) / ticks, 1)}
