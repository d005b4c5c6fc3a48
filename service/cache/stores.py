"""Where entries live: ``MemoryStore`` (one worker's LRU) here; ``disk_store.DiskStore`` (sqlite in WAL mode,
shared by the host's workers) and ``redis_store.RedisStore`` (the fleet's). Each is a ``Store``: keys to bytes,
many at once, and ``StoreDown`` for any failure, so a request goes on without it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class StoreDown(Exception):
    """The store could not answer (down, slow, full, damaged): this request goes on without it. ``kind`` names
    the failure for a log line once per kind (empty: the store logs it itself); ``action`` says what the store
    did about it; ``left``: the store is gone for this worker, which then caches in its memory only."""

    def __init__(self, message: str, *, kind: str = "", action: str = "", left: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.action = action
        self.left = left


class Store(Protocol):
    name: str

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]: ...  # the keys it has; StoreDown

    # entries evicted; StoreDown. ``first_wins``: a key already there keeps its value (an entry: two forwards of
    # one photo in other batches differ in the last float bits, and every worker must answer the same bits)
    def put_many(self, items: Mapping[str, bytes], ttl_s: float, first_wins: bool = False) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def clear(self) -> int: ...


class MemoryStore:
    """A bounded LRU of one worker (bytes counted, values and keys): in front of any shared store."""

    name = "memory"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evictions = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        found = {}
        for key in keys:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
                found[key] = value
        return found

    def put_many(self, items: Mapping[str, bytes], ttl_s: float = 0.0, first_wins: bool = False) -> int:
        evicted = 0
        for key, value in items.items():
            if first_wins and key in self._items:
                continue
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= len(key) + len(old)
            if len(key) + len(value) > self.max_bytes:
                continue
            self._items[key] = value
            self.bytes += len(key) + len(value)
            while self.bytes > self.max_bytes:
                gone, dropped = self._items.popitem(last=False)
                self.bytes -= len(gone) + len(dropped)
                evicted += 1
        self.evictions += evicted
        return evicted

    def stats(self) -> dict[str, Any]:
        return {"store": self.name, "entries": len(self._items), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "evictions": self.evictions}

    def clear(self) -> int:
        n = len(self._items)
        self._items.clear()
        self.bytes = 0
        return n
