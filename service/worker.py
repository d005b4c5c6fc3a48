"""Facts about the current gunicorn worker process, recorded by ``gunicorn.conf.py``'s ``post_fork``.

Kept torch-free: the master imports this module before it forks.
"""

from __future__ import annotations

_ordinal = 0


def set_ordinal(age: int) -> None:
    """gunicorn's ``worker.age`` grows by one per spawned worker: good enough to spread over GPUs."""
    global _ordinal
    _ordinal = age


def ordinal() -> int:
    return _ordinal
