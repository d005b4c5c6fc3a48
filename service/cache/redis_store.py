"""A Redis shared by a fleet of hosts (``GREENSERVE_CACHE=redis://host:6379/0``): an album's keys in one MGET,
its new entries in one pipeline of SETs with a TTL. Its memory cap is Redis's own (``maxmemory`` with an
``allkeys-lru`` policy: docs/OPERATIONS.md).

A Redis that is down, slow or full costs a request at most ``timeout_s`` per call and never fails it
(``StoreDown``): after a failure the store is skipped for ``RETRY_S``, then tried again, so it comes back by
itself. Under gunicorn's gevent worker the client's sockets are gevent's: waiting on Redis only waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from service.cache.stores import StoreDown

log = logging.getLogger(__name__)
PREFIX = "greenserve:"
RETRY_S = 1.0  # how long a failed Redis is skipped before the next request tries it again


class RedisStore:
    name = "redis"

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.client: Any = redis.Redis.from_url(  # Any: its stubs mix in the asyncio client's awaitables
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=0,
            retry_on_timeout=False)
        self._down_until = 0.0

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        values = self._call(lambda: self.client.mget([PREFIX + k for k in keys]))
        return {k: v for k, v in zip(keys, values, strict=True) if v is not None}

    def put_many(self, items: Mapping[str, bytes], ttl_s: float, first_wins: bool = False) -> int:
        if not items:
            return 0

        def write() -> Any:
            pipe = self.client.pipeline(transaction=False)
            for key, value in items.items():
                pipe.set(PREFIX + key, value, ex=int(ttl_s) if ttl_s >= 1 else None, nx=first_wins)
            return pipe.execute()

        self._call(write)
        return 0  # Redis evicts by itself (maxmemory-policy): INFO's evicted_keys counts it

    def stats(self) -> dict[str, Any]:
        memory, keys = self.client.info("memory"), self.client.info("stats")
        entries = sum(1 for _ in self.client.scan_iter(match=PREFIX + "*", count=1000))
        return {"store": self.name, "url": _without_password(self.url), "entries": entries,
                "bytes": memory.get("used_memory"), "max_bytes": memory.get("maxmemory"),
                "policy": memory.get("maxmemory_policy"), "evictions": keys.get("evicted_keys")}

    def clear(self) -> int:
        n = 0
        batch: list[bytes] = []
        for key in self.client.scan_iter(match=PREFIX + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                n += int(self.client.unlink(*batch))
                batch.clear()
        if batch:
            n += int(self.client.unlink(*batch))
        return n

    def _call(self, op: Any) -> Any:
        now = time.monotonic()
        if now < self._down_until:
            raise StoreDown(f"redis skipped for {self._down_until - now:.1f}s more after a failure")
        try:
            return op()
        except (redis.RedisError, OSError) as exc:
            if self._down_until == 0.0 or now - self._down_until > 60:
                log.warning("embedding cache: redis at %s failed (%s); skipping it for %.0fs at a time until it "
                            "answers", _without_password(self.url), exc, RETRY_S)
            self._down_until = time.monotonic() + RETRY_S
            raise StoreDown(f"redis: {exc}") from exc


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"
