"""The one percentile the tests and benchmarks use: nearest rank (no interpolation), so a reported p99 is a
latency that was seen."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q`` (0..1) nearest-rank percentile of ``values``, None for none: ``percentile(ms, 0.99)``."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]
