"""The fleet's records in the shared store (``cache.fleet``): set-if-absent under a digest of what they depend on,
a store that does not answer a ConnectionError, and only a Redis cache has them."""

from __future__ import annotations

import time

import pytest

from harness.launch import free_port
from service.cache import fleet
from service.cache.redis_store import RedisStore
from service.cache.stores import MemoryStore
from service.settings import Settings


def test_a_record_is_set_if_absent_and_read_back_under_a_digest_of_its_key() -> None:
    store = MemoryStore(1 << 20)
    records = fleet.FleetRecords(store, "memory", ttl_s=60)
    assert records.get('{"model": "resnet50"}') is None
    assert records.put_first('{"model": "resnet50"}', b"first") == b"first"
    assert records.put_first('{"model": "resnet50"}', b"second") == b"first"  # the first record stays
    assert records.get('{"model": "resnet50"}') == b"first"
    (name,) = store.get_many([fleet.record_key('{"model": "resnet50"}')])
    assert name.startswith("p:") and "resnet50" not in name  # apart from entries (e:) and URL records (u:)


def test_a_redis_that_does_not_answer_is_a_connection_error_within_its_timeout() -> None:
    records = fleet.from_settings(Settings(cache=f"redis://127.0.0.1:{free_port()}/0"))
    assert records is not None
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        records.get("k")
    with pytest.raises(ConnectionError):
        records.put_first("k", b"v")
    assert time.monotonic() - started < 2 * fleet.BOOT_TIMEOUT_S + 1
    records.close()


def test_only_a_redis_cache_has_fleet_records_and_its_address_is_said_without_the_password() -> None:
    assert fleet.from_settings(Settings(cache="disk")) is None  # the host's: the memo covers its workers
    assert fleet.from_settings(Settings(cache="memory")) is None and fleet.from_settings(Settings(cache="off")) is None
    records = fleet.from_settings(Settings(cache="redis://:s3cret@cache.internal:6379/2", cache_timeout_ms=100))
    assert records is not None and records.where == "redis at cache.internal:6379/2"
    assert isinstance(records.store, RedisStore)
    assert records.store.client.connection_pool.connection_kwargs["socket_timeout"] == fleet.BOOT_TIMEOUT_S
    records.close()  # nothing was opened: nothing to wait for
