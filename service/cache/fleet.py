"""The fleet's records, beside its cache entries in the store every instance shares (Redis): a choice each
instance must make alike, kept once under ``p:<sha256 of what it depends on>`` by the first instance to make it,
set-if-absent (``SET NX``), and read by the others. The one user is the precision choice
(``engine.precision_records.FleetStore``): the cache's model id includes the numerics, so instances that chose
differently would never find each other's entries.

Only a Redis cache has one. The disk store is the host's, and its workers already share their choice through
the master's memo (``balance.memo``). A record lives as long as an entry (``GREENSERVE_CACHE_TTL_S``), and
``greenserve cache clear`` removes it with them: the next instance measures again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from service.cache.stores import Store, StoreDown
from service.settings import Settings

# a boot may wait this long for the fleet's record (a request waits GREENSERVE_CACHE_TIMEOUT_MS, 100 ms by
# default: a new connection to a Redis in another zone takes longer, and measuring instead costs seconds)
BOOT_TIMEOUT_S = 1.0
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def record_key(key: str) -> str:
    return "p:" + hashlib.sha256(key.encode()).hexdigest()[:40]


class FleetRecords:
    """Records in ``store`` under ``record_key``; a store that does not answer is ``ConnectionError``."""

    def __init__(self, store: Store, where: str, ttl_s: float, close: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.where = where
        self.ttl_s = ttl_s
        self._close = close

    def get(self, key: str) -> bytes | None:
        name = record_key(key)
        try:
            return self.store.get_many([name]).get(name)
        except StoreDown as exc:
            raise ConnectionError(str(exc)) from exc

    def put_first(self, key: str, value: bytes) -> bytes | None:
        """``value`` under ``key`` unless a record is there already; the record there now."""
        name = record_key(key)
        try:
            self.store.put_many({name: value}, self.ttl_s, first_wins=True)
            return self.store.get_many([name]).get(name)
        except StoreDown as exc:
            raise ConnectionError(str(exc)) from exc

    def close(self) -> None:
        self._close()


def from_settings(settings: Settings) -> FleetRecords | None:
    """The fleet's records where ``GREENSERVE_CACHE`` names a Redis; None for any other cache. Its own client:
    it is used in the inference thread at boot, and a connection is its thread's (gevent's sockets)."""
    if not settings.cache.startswith(REDIS_SCHEMES):
        return None
    from service.cache.redis_store import RedisStore  # only where Redis is used

    store = RedisStore(settings.cache, max(settings.cache_timeout_ms / 1000, BOOT_TIMEOUT_S))
    address = settings.cache.partition("://")[2].rpartition("@")[2]  # never the password
    return FleetRecords(store, f"redis at {address}", settings.cache_ttl_s, close=store.client.close)
