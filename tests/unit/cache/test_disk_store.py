"""The disk store: its cap holds the file and its WAL together, every sqlite error is a miss logged once, a
damaged file is emptied in place for every worker, and one that is not a database is set aside at boot."""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from harness.faults import damage_page
from service.cache.disk_store import ASIDE, DB_NAME, DiskStore
from service.cache.stores import MemoryStore, StoreDown
from service.cache.tiers import EmbeddingCache

VALUE = 6200  # a resnet18 entry: 512 features and 1,000 logits, packed
MB = 1024 * 1024


def fill(store: DiskStore, n: int, start: int = 0) -> list[str]:
    """``n`` entries of VALUE bytes written 30 at a time (an album a request): their keys."""
    keys = [f"e:{i:05d}" for i in range(start, start + n)]
    for i in range(0, n, 30):
        store.put_many({k: os.urandom(VALUE) for k in keys[i:i + 30]}, ttl_s=0, first_wins=True)
    return keys


def on_disk(store: DiskStore) -> int:
    """The file's and its WAL's sizes together."""
    return sum(os.path.getsize(store.path + s) for s in ("", "-wal") if os.path.exists(store.path + s))


def test_the_file_and_its_wal_stay_within_the_cap(tmp_path: Path) -> None:
    store = DiskStore(str(tmp_path), max_bytes=MB)
    sibling = DiskStore(str(tmp_path), max_bytes=MB)  # another worker, reading (and touching) what was written
    peak = 0
    for start in range(0, 600, 30):
        keys = fill(store, 30, start)
        peak = max(peak, on_disk(store))
        sibling.get_many(keys)
        peak = max(peak, on_disk(store))
    assert peak <= MB, peak
    assert 0 < store.stats()["entries"] < 600 and store.get_many(["e:00599"])  # evicted, the newest kept


def test_a_damaged_page_is_a_miss_and_the_file_is_emptied_for_every_worker(tmp_path: Path) -> None:
    one = DiskStore(str(tmp_path), max_bytes=8 * MB)
    keys = fill(one, 120)
    damage_page(one.path)
    two = DiskStore(str(tmp_path), max_bytes=8 * MB)  # a worker that reads the damaged page
    with pytest.raises(StoreDown) as down:
        two.get_many(keys)
    assert "emptied" in down.value.action and not down.value.left
    assert two.get_many(keys) == {} and one.get_many(keys) == {}  # both go on, with the empty store
    one.put_many({"k": b"v"}, ttl_s=0)
    assert two.get_many(["k"]) == {"k": b"v"}


def test_a_truncated_file_is_a_miss_and_is_emptied(tmp_path: Path) -> None:
    one = DiskStore(str(tmp_path), max_bytes=8 * MB)
    keys = fill(one, 120)
    damage_page(one.path)  # checkpointed, so the file holds every page
    os.truncate(one.path, os.path.getsize(one.path) // 2)
    two = DiskStore(str(tmp_path), max_bytes=8 * MB)
    with pytest.raises(StoreDown):
        two.get_many(keys)
    assert two.get_many(keys) == {}
    two.put_many({"k": b"v"}, ttl_s=0)
    assert one.get_many(["k"]) == {"k": b"v"}


def test_a_file_that_is_not_a_database_is_set_aside_at_boot(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / DB_NAME).write_bytes(b"not a database " * 1000)
    store = DiskStore(str(tmp_path), max_bytes=MB)
    store.put_many({"k": b"v"}, ttl_s=0)
    assert store.get_many(["k"]) == {"k": b"v"}
    assert (tmp_path / (DB_NAME + ASIDE)).read_bytes().startswith(b"not a database")
    assert "set it aside" in caplog.text


def test_every_store_failure_is_a_miss_logged_once_per_kind(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(str(tmp_path), max_bytes=MB, timeout_s=0.05)
    cache = EmbeddingCache(MemoryStore(MB), store, ttl_s=60)
    holder = sqlite3.connect(store.path)
    holder.execute("BEGIN EXCLUSIVE")  # another worker's write, held past the timeout
    with caplog.at_level(logging.DEBUG, logger="service.cache.tiers"):
        assert cache.put_many({"e:a": b"v"}) is False and cache.put_many({"e:b": b"v"}) is False
    holder.rollback()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "SQLITE_BUSY" in warnings[0], warnings
    assert cache.put_many({"e:c": b"v"}) is True


class LeftStore:
    """A store that failed for good for this worker (a file that cannot even be emptied)."""

    name = "disk"

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        raise StoreDown("file is not a database", kind="SQLITE_NOTADB", action="caching in memory only", left=True)

    def put_many(self, items: Mapping[str, bytes], ttl_s: float, first_wins: bool = False) -> int:
        raise AssertionError("a store left is not called again")

    def stats(self) -> dict[str, Any]:
        return {}

    def clear(self) -> int:
        return 0


def test_a_store_left_for_good_leaves_the_worker_its_memory(caplog: pytest.LogCaptureFixture) -> None:
    cache = EmbeddingCache(MemoryStore(MB), LeftStore(), ttl_s=60)
    assert cache.get_many(["e:a"]) == ({}, False)
    assert cache.shared is None and "caching in memory only" in caplog.text
    assert cache.put_many({"e:a": b"v"}) is True and cache.get_many(["e:a"]) == ({"e:a": b"v"}, True)
