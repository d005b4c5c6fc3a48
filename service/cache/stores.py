"""Where entries live: ``MemoryStore`` (one worker's LRU) and ``DiskStore`` (sqlite in WAL mode, shared by the
host's workers); ``redis_store.RedisStore`` is the fleet's. Each is a ``Store``: keys to bytes, many at once.

Why sqlite: faster stores (LMDB) save a negligible part of a cold album (docs/CACHE.md, "Why sqlite"); sqlite
is in the standard library, its size cap and LRU eviction are one query, WAL lets every worker read while one
writes, and a crashed writer never needs a repair.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

DB_NAME = "embeddings.sqlite3"
EVICT_TO = 0.9  # eviction frees down to this share of the cap, so it runs once per many writes, not per write
# creating the table waits this long for the lock: a host's workers boot together, and each one's first
# connection to a new file turns it to WAL and creates the table, holding the lock while it does (on a busy
# host, past a request's ``timeout_s``; the worker then served without the store, every lookup a miss)
SETUP_TIMEOUT_S = 30.0


class StoreDown(Exception):
    """The store could not answer in time (down, slow, full): this request goes on without it."""


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


class DiskStore:
    """One sqlite file under ``directory`` for every worker of the host, capped at ``max_bytes`` of values:
    the least recently used go first. Blocking: call it from a thread, not the hub (``tiers``). A lock held
    longer than ``timeout_s`` by another worker is StoreDown for this call, not a wait."""

    name = "disk"

    def __init__(self, directory: str, max_bytes: int, timeout_s: float = 0.1) -> None:
        self.path = os.path.join(directory, DB_NAME)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._local = threading.local()  # a connection per thread: sqlite3 objects stay in their thread
        os.makedirs(directory, exist_ok=True)
        db = _connect(self.path, SETUP_TIMEOUT_S)
        try:
            with db:
                db.execute("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, value BLOB NOT NULL, "
                           "size INTEGER NOT NULL, used REAL NOT NULL, expires REAL NOT NULL)")
                db.execute("CREATE INDEX IF NOT EXISTS entries_used ON entries (used)")
        finally:
            db.close()

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        now = time.time()
        marks = ",".join("?" * len(keys))
        try:
            db = self._db()
            rows = db.execute(f"SELECT key, value FROM entries WHERE key IN ({marks}) AND expires > ?",
                              [*keys, now]).fetchall()
        except sqlite3.Error as exc:
            raise StoreDown(f"sqlite: {exc}") from exc
        if rows:
            self._touch(db, [k for k, _ in rows], now)
        return {k: bytes(v) for k, v in rows}

    @staticmethod
    def _touch(db: sqlite3.Connection, keys: list[str], now: float) -> None:
        """A hit is used now: the LRU order, in one short write. Only an order: while another worker holds
        the write lock past ``timeout_s`` the rows read are still the answer (they were a bypass before)."""
        try:
            with db:
                db.execute(f"UPDATE entries SET used = ? WHERE key IN ({','.join('?' * len(keys))})", [now, *keys])
        except sqlite3.OperationalError:
            pass

    def put_many(self, items: Mapping[str, bytes], ttl_s: float, first_wins: bool = False) -> int:
        if not items:
            return 0
        now = time.time()
        expires = now + ttl_s if ttl_s > 0 else float("inf")
        try:
            db = self._db()
            with db:
                db.executemany(f"INSERT OR {'IGNORE' if first_wins else 'REPLACE'} INTO entries VALUES (?, ?, ?, ?, ?)",
                               [(k, v, len(k) + len(v), now, expires) for k, v in items.items()])
                return self._evict(db)
        except sqlite3.Error as exc:
            raise StoreDown(f"sqlite: {exc}") from exc

    def _evict(self, db: sqlite3.Connection) -> int:
        (total,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
        if total <= self.max_bytes:
            return 0
        gone = db.execute("DELETE FROM entries WHERE expires <= ?", (time.time(),)).rowcount
        (total,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
        over = total - int(self.max_bytes * EVICT_TO)
        if over <= 0:
            return int(gone)
        # the oldest-used rows (ties by key) until their sizes add up to what is over the target
        gone += db.execute("DELETE FROM entries WHERE key IN (SELECT key FROM (SELECT key, size, SUM(size) OVER "
                           "(ORDER BY used, key ROWS UNBOUNDED PRECEDING) AS run FROM entries) WHERE run - size < ?)",
                           (over,)).rowcount
        return int(gone)

    def stats(self) -> dict[str, Any]:
        entries, size = self._db().execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries").fetchone()
        return {"store": self.name, "path": self.path, "entries": entries, "bytes": size, "max_bytes": self.max_bytes,
                "file_bytes": sum(os.path.getsize(self.path + s) for s in ("", "-wal") if os.path.exists(self.path + s))}

    def clear(self) -> int:
        db = self._db()
        with db:
            n = int(db.execute("DELETE FROM entries").rowcount)
        db.execute("VACUUM")
        return n

    def _db(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = _connect(self.path, self.timeout_s)
        return db


def _connect(path: str, timeout_s: float) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=timeout_s)
    db.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer, nor it for them
    db.execute("PRAGMA synchronous=NORMAL")  # a power cut may lose the last writes, never corrupt
    return db
