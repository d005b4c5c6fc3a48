"""A worker's measured choices, shared with the workers that come after it: shared memory the master
allocates before forking (torch-free, like the load board), so a replacement after a HUP or a respawn
reads what its predecessor measured instead of measuring again.

The one user is the precision trial (``engine.precision``): timed again by every replacement, it took seconds
of CPU from the cores the old workers serve a reload's load on, and two workers timed under that load chose
differently (figures: docs/SCHEDULING.md#hand-over). An entry is one key and
one value; a torn write fails its checksum and reads as nothing. Workers that would measure the same thing
at once (the first start) take turns through ``exclusive``: the second reads what the first measured.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
from collections.abc import Iterator

SIZE = 16384  # bytes: one entry, the key's digest, a length and a checksum included
_HEAD = 32 + 4 + 16  # the key's sha256, the value's length, its blake2b-128


class SharedMemo:
    def __init__(self, size: int = SIZE) -> None:
        self._buf = multiprocessing.RawArray("B", size)
        self._turn = multiprocessing.Lock()  # a POSIX semaphore, shared by the forked workers

    @contextlib.contextmanager
    def exclusive(self, timeout_s: float) -> Iterator[bool]:
        """One worker at a time measures. Waits at most ``timeout_s`` (a worker killed while it held the turn
        never gives it back); yields whether the turn was had."""
        had = self._turn.acquire(timeout=timeout_s)
        try:
            yield had
        finally:
            if had:
                self._turn.release()

    def get(self, key: str) -> bytes | None:
        """The value last put under ``key``, or None (another key, nothing yet, or a torn write)."""
        raw = bytes(self._buf)
        n = int.from_bytes(raw[32:36], "little")
        value = raw[_HEAD:_HEAD + n]
        if raw[:32] != _key(key) or n > len(raw) - _HEAD or raw[36:_HEAD] != _check(key, value):
            return None
        return value

    def put(self, key: str, value: bytes) -> bool:
        """Keep ``value`` under ``key`` (replacing any other entry); False when it does not fit."""
        if len(value) > len(self._buf) - _HEAD:
            return False
        self._buf[:_HEAD + len(value)] = list(_key(key) + len(value).to_bytes(4, "little") +
                                               _check(key, value) + value)
        return True


def _key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _check(key: str, value: bytes) -> bytes:
    return hashlib.blake2b(key.encode() + value, digest_size=16).digest()
