"""``EmbeddingCache``: a worker's memory LRU in front of the shared store (disk or Redis), as the pipeline sees
it: many keys at once, hashing and sqlite off the hub, and a store that fails costing only its lookups.

Calls come from the worker's greenlets. The memory tier is touched only there (no lock needed); sqlite runs in
the cache's own thread, since a query blocks its thread; Redis runs in the greenlet (gevent's sockets).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from gevent.threadpool import ThreadPool

from service import metrics
from service.cache.disk_store import DiskStore
from service.cache.entries import content_id
from service.cache.stores import MemoryStore, Store, StoreDown
from service.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")
MB = 1024 * 1024
HASH_ON_HUB_BYTES = 64 * 1024  # a thumbnail is hashed on the hub, a photo in a thread (docs/SCHEDULING.md#hub-turns)


class EmbeddingCache:
    def __init__(self, memory: MemoryStore, shared: Store | None, *, ttl_s: float, threads: int = 2) -> None:
        self.memory = memory
        self.shared = shared
        self.ttl_s = ttl_s
        self._pool = ThreadPool(threads)
        self._blocking = isinstance(shared, DiskStore)
        self._warned: set[str] = set()  # the kinds of store failure this worker has logged at warning

    def digest(self, data: bytes) -> str:
        """The content id of ``data``, hashed where it does not hold the hub up."""
        if len(data) <= HASH_ON_HUB_BYTES:
            return content_id(data)
        return self._in_thread(content_id, data)

    def digest_many(self, datas: Sequence[bytes]) -> list[str]:
        """Content ids of an album's uploads, hashed together in one thread call."""
        if sum(len(d) for d in datas) <= HASH_ON_HUB_BYTES:
            return _digests(datas)
        return self._in_thread(_digests, datas)

    def get_many(self, keys: Sequence[str]) -> tuple[dict[str, bytes], bool]:
        """The values found (memory first, then the shared store in one call), and whether every store
        answered: False means a key not found may still be there (a bypass, not a miss)."""
        found = self.memory.get_many(keys)
        rest = [k for k in keys if k not in found]
        if not rest or self.shared is None:
            return found, True
        try:
            shared = self._shared(self.shared.get_many, rest)
        except StoreDown as exc:
            self._failed(exc)
            return found, False
        self.memory.put_many(shared)
        found.update(shared)
        return found, True

    def put_many(self, items: Mapping[str, bytes]) -> bool:
        """Written to the shared store, entries first-wins (``Store.put_many``); False when it did not take
        them. With a shared store, memory learns entries only by reading them back, so it holds the bits every
        worker answers; without one, memory is the store."""
        if not items:
            return True
        outputs = {k: v for k, v in items.items() if k.startswith("e:")}
        records = {k: v for k, v in items.items() if k not in outputs}
        if self.shared is None:
            self._evicted(self.memory.name, self.memory.put_many(outputs, first_wins=True))
        self._evicted(self.memory.name, self.memory.put_many(records))
        metrics.CACHE_BYTES.set(self.memory.bytes)
        if self.shared is None:
            return True
        try:
            for part, first in ((outputs, True), (records, False)):
                if part:
                    self._evicted(self.shared.name, self._shared(self.shared.put_many, part, self.ttl_s, first))
        except StoreDown as exc:
            self._failed(exc)
            return False
        metrics.CACHE_WRITTEN_BYTES.labels(self.shared.name).inc(sum(len(k) + len(v) for k, v in items.items()))
        return True

    def _shared(self, fn: Callable[..., T], *args: Any) -> T:
        if not self._blocking:
            return fn(*args)
        # StoreDown comes back as a value and is raised here: raised in the pool's thread, gevent prints it
        # with a traceback, and a store that fails is a miss, logged once (``_failed``)
        outcome: T | StoreDown = self._in_thread(_outcome, fn, *args)
        if isinstance(outcome, StoreDown):
            raise outcome
        return outcome

    def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return self._pool.apply(fn, args)  # type: ignore[no-any-return]

    def _failed(self, exc: StoreDown) -> None:
        """A store that failed: this request went on without it (a miss). Logged at warning once per kind of
        failure, and whenever the store did something about it; counted every time."""
        assert self.shared is not None
        name = self.shared.name
        metrics.CACHE_STORE_ERRORS.labels(name).inc()
        if exc.left:  # gone for this worker: its memory is the store from now on
            self.shared, self._blocking = None, False
        if exc.action or exc.kind and exc.kind not in self._warned:
            self._warned.add(exc.kind)
            log.warning("embedding cache: the %s store failed (%s); the request went on without it; %s", name, exc,
                        exc.action or f"more {exc.kind} failures are counted in greenserve_cache_store_errors_total")
        else:
            log.debug("embedding cache: %s", exc)

    @staticmethod
    def _evicted(store: str, n: int) -> None:
        if n:
            metrics.CACHE_EVICTIONS.labels(store).inc(n)


def _outcome(fn: Callable[..., T], *args: Any) -> T | StoreDown:
    try:
        return fn(*args)
    except StoreDown as exc:
        return exc


def _digests(datas: Sequence[bytes]) -> list[str]:
    return [content_id(d) for d in datas]


def shared_store(settings: Settings) -> Store | None:
    """The store shared beyond one worker that ``GREENSERVE_CACHE`` names (None for off and memory)."""
    timeout_s = settings.cache_timeout_ms / 1000
    if settings.cache == "disk":
        try:
            return DiskStore(settings.cache_directory(), settings.cache_disk_mb * MB, timeout_s)
        except (OSError, sqlite3.Error) as exc:  # a read-only home, say: serve on, with each worker's memory
            log.warning("embedding cache: no disk store at %s (%s); set GREENSERVE_CACHE_DIR to a writable "
                        "directory. Caching in each worker's memory only", settings.cache_directory(), exc)
            return None
    if settings.cache.startswith(("redis://", "rediss://", "unix://")):
        from service.cache.redis_store import RedisStore  # only where Redis is used

        return RedisStore(settings.cache, timeout_s)
    return None


def from_settings(settings: Settings) -> EmbeddingCache | None:
    """The worker's cache as configured; None when ``GREENSERVE_CACHE=off``."""
    if settings.cache == "off":
        return None
    return EmbeddingCache(MemoryStore(settings.cache_memory_mb * MB), shared_store(settings),
                          ttl_s=settings.cache_ttl_s)
