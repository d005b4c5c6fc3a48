"""The embedding cache's parts: entries that never unpack wrong, the memory and disk stores' caps, a Redis
that is down costing a bounded wait and coming back, and the app answering a repeated image from the cache."""

from __future__ import annotations

import base64
import json
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from harness import images
from harness.fakes import FakeFetcher, FakeModel
from harness.launch import free_port
from service.app import create_app
from service.cache import entries
from service.cache.disk_store import DiskStore
from service.cache.entries import Outputs, UrlRecord
from service.cache.redis_store import RedisStore
from service.cache.stores import MemoryStore, StoreDown
from service.cache.tiers import EmbeddingCache
from service.pipeline.recall import CacheTally
from service.settings import Settings, SettingsError

KEY = entries.entry_key("m" * 32, "c" * 64)


def outputs(seed: int = 0) -> Outputs:
    rng = np.random.default_rng(seed)
    return Outputs(rng.standard_normal(512).astype(np.float32), rng.standard_normal(1000).astype(np.float32))


def test_an_entry_unpacks_to_exactly_what_was_packed() -> None:
    packed = outputs()
    back = entries.unpack(KEY, entries.pack(KEY, packed))
    assert back is not None and back.features is not None and back.logits is not None
    assert back.features.dtype == np.float32 and np.array_equal(back.features, packed.features)
    assert np.array_equal(back.logits, packed.logits)
    assert not back.features.flags.writeable  # no answer can change a stored vector
    only = entries.unpack(KEY, entries.pack(KEY, Outputs(packed.features, None)))
    assert only is not None and only.logits is None


@pytest.mark.parametrize("damage", ["truncated", "flipped", "other key", "empty", "garbage", "longer"])
def test_a_damaged_or_misplaced_entry_is_a_miss(damage: str) -> None:
    blob = entries.pack(KEY, outputs())
    bad = {"truncated": blob[:-100], "flipped": blob[:50] + bytes([blob[50] ^ 1]) + blob[51:], "empty": b"",
           "other key": entries.pack(entries.entry_key("m" * 32, "d" * 64), outputs()),
           "garbage": b"GSE\x01" + b"\x00" * 40, "longer": blob + b"\x00"}[damage]
    assert entries.unpack(KEY, bad) is None


def test_a_url_record_round_trips_and_is_keyed_by_a_digest_of_the_url() -> None:
    url = "http://images.example/a.jpg?X-Amz-Signature=secret"
    key = entries.url_key(url)
    assert "secret" not in key and "images.example" not in key
    record = UrlRecord("a" * 64, '"v1"', "Tue, 01 Dec 2026 10:00:00 GMT", 123.0, "c" * 40)
    assert entries.unpack_url(key, entries.pack_url(key, record)) == record
    assert entries.unpack_url(entries.url_key(url + "x"), entries.pack_url(key, record)) is None
    assert entries.unpack_url(key, b"{not json") is None


def test_a_url_record_without_its_redirect_chain_is_not_trusted() -> None:
    """Records from before the chain was kept may hold a redirect target's validators: the next fetch downloads."""
    key = entries.url_key("http://images.example/latest.jpg")
    old = {"key": key, "content": "a" * 64, "etag": '"v1"', "lm": "", "fresh_until": 0.0}
    assert entries.unpack_url(key, json.dumps(old).encode()) is None


def test_the_memory_store_evicts_the_least_recently_used_within_its_cap() -> None:
    store = MemoryStore(max_bytes=3 * 1010)
    store.put_many({f"k{i}": b"x" * 1000 for i in range(3)})
    store.get_many(["k0"])  # k0 used: k1 is now the oldest
    assert store.put_many({"k3": b"x" * 1000}) == 1
    assert set(store.get_many(["k0", "k1", "k2", "k3"])) == {"k0", "k2", "k3"} and store.bytes <= store.max_bytes


def test_the_disk_store_is_shared_capped_and_expires(tmp_path: Path) -> None:
    one, two = DiskStore(str(tmp_path), max_bytes=50_000), DiskStore(str(tmp_path), max_bytes=50_000)
    one.put_many({f"k{i:02d}": bytes([i]) * 1000 for i in range(60)}, ttl_s=0)
    assert two.get_many(["k59"]) == {"k59": bytes([59]) * 1000}  # another worker's connection sees it
    assert one.stats()["bytes"] <= 50_000 and "k00" not in two.get_many(["k00"])  # oldest evicted first
    one.put_many({"short": b"v"}, ttl_s=0.05)
    time.sleep(0.1)
    assert one.get_many(["short"]) == {}
    assert one.clear() > 0 and two.stats()["entries"] == 0


def test_a_locked_disk_store_is_store_down_after_its_timeout(tmp_path: Path) -> None:
    store = DiskStore(str(tmp_path), max_bytes=1 << 20, timeout_s=0.05)
    holder = sqlite3.connect(str(tmp_path / "embeddings.sqlite3"))
    holder.execute("BEGIN EXCLUSIVE")
    t0 = time.monotonic()
    with pytest.raises(StoreDown):
        store.put_many({"k": b"v"}, ttl_s=0)
    assert time.monotonic() - t0 < 1.0
    holder.rollback()
    store.put_many({"k": b"v"}, ttl_s=0)


def test_a_worker_that_boots_while_another_holds_the_lock_still_gets_the_store(tmp_path: Path) -> None:
    """A host's workers boot together, and the first to open a new file holds its lock while it sets it up:
    the other waits for it (it once came up without the store, and answered every lookup with a miss)."""
    holder = sqlite3.connect(str(tmp_path / "embeddings.sqlite3"), check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(0.3, holder.rollback)
    release.start()
    store = DiskStore(str(tmp_path), max_bytes=1 << 20, timeout_s=0.05)
    release.join()
    store.put_many({"k": b"v"}, ttl_s=0)
    assert store.get_many(["k"]) == {"k": b"v"}


def test_a_hit_is_answered_while_another_worker_holds_the_write_lock(tmp_path: Path) -> None:
    """A hit also marks its rows used (a write); blocked, it costs the LRU order, not the hit."""
    store = DiskStore(str(tmp_path), max_bytes=1 << 20, timeout_s=0.05)
    store.put_many({"k": b"v"}, ttl_s=0)
    writer = sqlite3.connect(str(tmp_path / "embeddings.sqlite3"))
    writer.execute("BEGIN IMMEDIATE")  # another worker's write in progress: WAL readers go on
    t0 = time.monotonic()
    assert store.get_many(["k", "absent"]) == {"k": b"v"}
    assert time.monotonic() - t0 < 1.0
    writer.rollback()


def test_a_redis_that_is_down_costs_a_bounded_wait_then_is_skipped() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(StoreDown):
        store.get_many(["a"])
    with pytest.raises(StoreDown, match="skipped"):
        store.get_many(["a"])  # no second connect: skipped until RETRY_S has passed
    assert time.monotonic() - t0 < 1.0
    cache = EmbeddingCache(MemoryStore(1 << 20), store, ttl_s=60)
    assert cache.get_many(["a"]) == ({}, False)  # a bypass, not a miss
    assert cache.put_many({"a": b"v"}) is False and cache.memory.get_many(["a"]) == {"a": b"v"}


def test_the_cache_status_header_says_what_happened() -> None:
    assert CacheTally(hits=3).header() == 'greenserve; hit; detail="hit=3 revalidated=0 fresh=0 miss=0"'
    assert CacheTally(hits=3, revalidated=3).header().startswith("greenserve; fwd=stale; fwd-status=304;")
    assert CacheTally(hits=2, misses=1, stored=True).header().startswith("greenserve; fwd=miss; stored;")
    assert CacheTally(bypassed=1).header().startswith("greenserve; fwd=bypass;")


def test_the_setting_names_a_mode_or_a_redis_url() -> None:
    assert Settings(cache="redis://cache.internal:6379/2").cache.startswith("redis://")
    with pytest.raises(SettingsError, match="GREENSERVE_CACHE"):
        Settings(cache="memcached://x")


def test_a_repeated_image_is_answered_from_the_cache_and_a_corrupt_entry_is_recomputed(tmp_path: Path) -> None:
    model = FakeModel()
    app = create_app(Settings(cache_dir=str(tmp_path)), model=model, fetcher=FakeFetcher({}))
    client = app.test_client()
    body = {"images": ["data:image/jpeg;base64," + base64.b64encode(images.jpeg(40, 40)).decode()]}
    first = client.post("/v1/embeddings", json=body)
    second = client.post("/v1/embeddings", json=body)
    assert first.status_code == second.status_code == 200 and len(model.batches) == 1
    assert second.headers["Cache-Status"].startswith("greenserve; hit")
    assert first.json["data"] == second.json["data"]
    app.extensions["greenserve"].orchestrator.cache.memory.clear()
    db = sqlite3.connect(str(tmp_path / "embeddings.sqlite3"))
    with db:
        db.execute("UPDATE entries SET value = substr(value, 1, 40) WHERE key LIKE 'e:%'")
    third = client.post("/v1/embeddings", json=body)
    assert "fwd=miss" in third.headers["Cache-Status"] and len(model.batches) == 2
    assert third.json["data"] == first.json["data"]


def test_the_callers_cache_control_embeds_again_or_leaves_the_cache_out(tmp_path: Path) -> None:
    model = FakeModel()
    client = create_app(Settings(cache_dir=str(tmp_path)), model=model, fetcher=FakeFetcher({})).test_client()
    body = {"images": ["data:image/jpeg;base64," + base64.b64encode(images.jpeg(48, 40, seed=3)).decode()]}
    assert "fwd=miss; stored" in client.post("/v1/embeddings", json=body).headers["Cache-Status"]
    again = client.post("/v1/embeddings", json=body, headers={"Cache-Control": "no-cache"})
    assert "fwd=bypass; stored" in again.headers["Cache-Status"] and len(model.batches) == 2
    other = {"images": ["data:image/jpeg;base64," + base64.b64encode(images.jpeg(48, 40, seed=4)).decode()]}
    kept_out = client.post("/v1/embeddings", json=other, headers={"Cache-Control": "no-store"})
    assert "stored" not in kept_out.headers["Cache-Status"]
    assert "fwd=miss" in client.post("/v1/embeddings", json=other).headers["Cache-Status"] and len(model.batches) == 4
