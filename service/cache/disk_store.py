"""The host's disk store (``GREENSERVE_CACHE=disk``): one sqlite file in WAL mode that every worker of the host
shares, held with its WAL under one cap, and never a reason for a request to fail.

    cap       ``max_bytes`` holds the file and its WAL together. The WAL gets WAL_SHARE of it (at most WAL_MAX),
              and a write that leaves it larger checkpoints and truncates it. The file gets the rest, counted in
              the pages it uses (keys, values, indexes and their slack): a write that takes it over evicts the
              expired rows, then the least recently used (ties by key), down to EVICT_TO of it; the commit
              hands the freed pages back to the file system (``auto_vacuum=FULL``), so the file shrinks with them
    errors    every sqlite or OS error is ``StoreDown``: the request goes on without the store (a miss)
    damage    a file with a damaged page (SQLITE_CORRUPT) is emptied in place: an empty store is copied over it
              with sqlite's backup API, under sqlite's own locks, so every worker's open connection reads the
              empty store next. Nothing is renamed while workers hold it open: the last connection to close a
              renamed file deletes ``<name>-wal`` by name, which would be the new file's. A file that is not a
              database at all is renamed aside (ASIDE) at boot and a new one made; found so while serving (it
              cannot be emptied), this worker leaves the store and caches in its memory until it restarts

Why sqlite: faster stores (LMDB) save a negligible part of a cold album (docs/CACHE.md, "Why sqlite"); sqlite
is in the standard library, its cap and LRU eviction are a few queries, WAL lets every worker read while one
writes, and a crashed writer never needs a repair.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from service.cache.stores import StoreDown

log = logging.getLogger(__name__)
T = TypeVar("T")

DB_NAME = "embeddings.sqlite3"
ASIDE = ".corrupt"  # a file unreadable at boot is kept under this suffix for a look (the last one only)
EVICT_TO = 0.9  # eviction frees down to this share of the file's part, so it runs once per many writes
EVICT_ROUNDS = 4  # rows free pages only roughly (slack, shared leaves): eviction measures again, at most this often
WAL_SHARE = 0.25  # of the cap, the WAL's part ...
WAL_MAX = 16 * 1024 * 1024  # ... at most this: a longer WAL only slows reads (sqlite's own checkpoint is at 4 MiB)
# creating the table waits this long for the lock: a host's workers boot together, and each one's first
# connection to a new file turns it to WAL and creates the table, holding the lock while it does (on a busy
# host, past a request's ``timeout_s``; the worker then served without the store, every lookup a miss)
SETUP_TIMEOUT_S = 30.0
REPAIR_TIMEOUT_S = 2.0  # emptying a damaged file waits this long for another worker's write, then tries next time
DAMAGED = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB: the file is wrong, not the moment
SCHEMA = ("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, value BLOB NOT NULL, size INTEGER NOT NULL, "
          "used REAL NOT NULL, expires REAL NOT NULL)", "CREATE INDEX IF NOT EXISTS entries_used ON entries (used)")
# the oldest-used rows (ties by key) until their sizes add up to what is over
LRU_DELETE = ("DELETE FROM entries WHERE key IN (SELECT key FROM (SELECT key, size, SUM(size) OVER "
              "(ORDER BY used, key ROWS UNBOUNDED PRECEDING) AS run FROM entries) WHERE run - size < ?)")


class DiskStore:
    """One sqlite file under ``directory`` for every worker of the host, the file and its WAL within
    ``max_bytes``. Blocking: call it from a thread, not the hub (``tiers``). A lock held longer than
    ``timeout_s`` by another worker is StoreDown for this call, not a wait."""

    name = "disk"

    def __init__(self, directory: str, max_bytes: int, timeout_s: float = 0.1) -> None:
        self.path = os.path.join(directory, DB_NAME)
        self.max_bytes = max_bytes
        self.wal_bytes = int(min(max_bytes * WAL_SHARE, WAL_MAX))
        self.file_bytes = max_bytes - self.wal_bytes
        self.timeout_s = timeout_s
        self.left = ""  # why this worker left the store; empty while it uses it
        self._local = threading.local()  # a connection per thread: sqlite3 objects stay in their thread
        os.makedirs(directory, exist_ok=True)
        try:
            self._create()
        except sqlite3.DatabaseError as exc:
            if not _damaged(exc):
                raise
            self._set_aside(exc)

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        now = time.time()
        marks = ",".join("?" * len(keys))

        def read(db: sqlite3.Connection) -> dict[str, bytes]:
            rows = db.execute(f"SELECT key, value FROM entries WHERE key IN ({marks}) AND expires > ?",
                              [*keys, now]).fetchall()
            if rows:
                _touch(db, [k for k, _ in rows], now)
                self._trim_wal(db)  # touches write too
            return {k: bytes(v) for k, v in rows}

        return self._run(read)

    def put_many(self, items: Mapping[str, bytes], ttl_s: float, first_wins: bool = False) -> int:
        if not items:
            return 0
        now = time.time()
        expires = now + ttl_s if ttl_s > 0 else float("inf")
        rows = [(k, v, len(k) + len(v), now, expires) for k, v in items.items()]

        def write(db: sqlite3.Connection) -> int:
            with db:
                db.executemany(f"INSERT OR {'IGNORE' if first_wins else 'REPLACE'} INTO entries VALUES (?, ?, ?, ?, ?)",
                               rows)
                evicted = self._evict(db)
            self._trim_wal(db)
            return evicted

        return self._run(write)

    def stats(self) -> dict[str, Any]:
        entries, size = self._run(lambda db: db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries").fetchone())
        files = {s: os.path.getsize(self.path + s) for s in ("", "-wal") if os.path.exists(self.path + s)}
        return {"store": self.name, "path": self.path, "entries": entries, "bytes": size, "max_bytes": self.max_bytes,
                "file_bytes": sum(files.values()), "wal_bytes": files.get("-wal", 0)}

    def clear(self) -> int:
        def empty(db: sqlite3.Connection) -> int:
            with db:
                n = int(db.execute("DELETE FROM entries").rowcount)
            db.execute("PRAGMA auto_vacuum=FULL")  # a file made before it did shrinks from now on
            db.execute("VACUUM")
            return n

        return self._run(empty)

    def _evict(self, db: sqlite3.Connection) -> int:
        """Over the file's part: expired rows out, then the least recently used until the pages in use fit
        EVICT_TO of it (the commit gives the freed pages back to the file system: auto_vacuum)."""
        if _used_bytes(db) <= self.file_bytes:
            return 0
        gone = db.execute("DELETE FROM entries WHERE expires <= ?", (time.time(),)).rowcount
        target = int(self.file_bytes * EVICT_TO)
        for _ in range(EVICT_ROUNDS):
            used = _used_bytes(db)
            (rows,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
            if used <= target or not rows:
                break
            gone += db.execute(LRU_DELETE, (max(1, (used - target) * rows // used),)).rowcount  # the rows' share
        return int(gone)

    def _trim_wal(self, db: sqlite3.Connection) -> None:
        """A WAL past its part (readers kept sqlite's own checkpoint from restarting it) is copied into the file
        and truncated; a reader that holds on past ``timeout_s`` leaves it for the next write."""
        try:
            size = os.path.getsize(self.path + "-wal")
        except FileNotFoundError:
            return
        if size > self.wal_bytes:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def _run(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """``op`` on this thread's connection; any sqlite or OS error is StoreDown (a damaged file emptied first)."""
        if self.left:
            raise StoreDown(f"the disk store was left: {self.left}", left=True)
        try:
            return op(self._db())
        except (sqlite3.Error, OSError) as exc:
            raise self._down(exc) from exc

    def _down(self, exc: sqlite3.Error | OSError) -> StoreDown:
        kind = getattr(exc, "sqlite_errorname", "") or type(exc).__name__
        message = f"sqlite: {exc}"
        if not isinstance(exc, sqlite3.Error) or not _damaged(exc):
            return StoreDown(message, kind=kind)
        try:
            _empty_over(self.path, self.wal_bytes)
        except sqlite3.OperationalError as busy:  # another worker's write (or its own repair): the next call tries
            return StoreDown(message, kind=kind, action=f"emptying {self.path} failed for now ({busy})")
        except sqlite3.DatabaseError as unreadable:
            self.left = f"{self.path} is damaged and could not be emptied ({unreadable})"
            return StoreDown(message, kind=kind, left=True, action=f"{self.left}: this worker caches in its memory "
                             f"only until it restarts, and the restart sets the file aside as {DB_NAME}{ASIDE}")
        return StoreDown(message, kind=kind, action=f"emptied {self.path} in place: every worker goes on with an "
                         "empty store")

    def _create(self) -> None:
        db = _connect(self.path, SETUP_TIMEOUT_S, self.wal_bytes, create=True)
        try:
            with db:
                for statement in SCHEMA:
                    db.execute(statement)
        finally:
            db.close()

    def _set_aside(self, exc: sqlite3.Error) -> None:
        """A file that is not a database at boot: renamed aside with its WAL and index, and a new one made.
        Under a lock on the directory, and only while it still fails: a sibling booting beside this worker may
        have made the new one already (no worker holds the old one open: it never opened)."""
        with _locked(os.path.dirname(self.path)):
            try:
                self._create()
                return
            except sqlite3.DatabaseError as again:
                if not _damaged(again):
                    raise
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(self.path + ASIDE + suffix):
                    os.remove(self.path + ASIDE + suffix)  # an older one's: it would pair with this file
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, self.path + ASIDE + suffix)
            self._create()
        log.warning("embedding cache: %s is not a readable database (%s); set it aside as %s%s and made a new one",
                    self.path, exc, DB_NAME, ASIDE)

    def _db(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = _connect(self.path, self.timeout_s, self.wal_bytes)
        return db


def _touch(db: sqlite3.Connection, keys: list[str], now: float) -> None:
    """A hit is used now: the LRU order, in one short write. Only an order: while another worker holds the write
    lock past ``timeout_s`` (or the disk is full) the rows read are still the answer; a damaged file is not."""
    try:
        with db:
            db.execute(f"UPDATE entries SET used = ? WHERE key IN ({','.join('?' * len(keys))})", [now, *keys])
    except sqlite3.OperationalError:
        pass


def _connect(path: str, timeout_s: float, wal_bytes: int, *, create: bool = False) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=timeout_s)
    try:
        # a new file gives freed pages back at each commit (sqlite's incremental vacuum, through Python's sqlite3,
        # frees one page a call): set before WAL mode writes its first page; a write, so only at set-up
        if create:
            db.execute("PRAGMA auto_vacuum=FULL")
        db.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer, nor it for them
        db.execute("PRAGMA synchronous=NORMAL")  # a power cut may lose the last writes, never corrupt
        db.execute(f"PRAGMA journal_size_limit={wal_bytes}")  # a WAL sqlite restarts is cut back to its part
        (page,) = db.execute("PRAGMA page_size").fetchone()
        db.execute(f"PRAGMA wal_autocheckpoint={max(16, wal_bytes // page // 2)}")  # at half of it, in pages
    except BaseException:
        db.close()
        raise
    return db


def _empty_over(path: str, wal_bytes: int) -> None:
    """An empty store copied over the file at ``path``: sqlite's backup API writes it page by page under the
    file's locks and bumps its schema version, so every open connection reads the empty store next."""
    target = _connect(path, REPAIR_TIMEOUT_S, wal_bytes)
    empty = sqlite3.connect(":memory:")
    deadline = time.monotonic() + REPAIR_TIMEOUT_S

    def bounded(status: int, remaining: int, total: int) -> None:  # the backup retries a busy file forever
        if time.monotonic() > deadline:
            raise sqlite3.OperationalError(f"the file stayed locked for {REPAIR_TIMEOUT_S:.0f}s")

    try:
        (page,) = target.execute("PRAGMA page_size").fetchone()
        empty.execute(f"PRAGMA page_size={page}")  # a WAL file takes only a copy of its own page size
        empty.execute("PRAGMA auto_vacuum=FULL")
        for statement in SCHEMA:
            empty.execute(statement)
        empty.backup(target, progress=bounded)
    finally:
        empty.close()
        target.close()


@contextmanager
def _locked(directory: str) -> Iterator[None]:
    """The host's workers one at a time: a lock on the directory itself (no lock file left behind)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _used_bytes(db: sqlite3.Connection) -> int:
    """The bytes of the file's pages in use (keys, values, indexes and their slack), free pages left out."""
    (pages,), (free,), (size,) = (db.execute(f"PRAGMA {name}").fetchone()
                                  for name in ("page_count", "freelist_count", "page_size"))
    return int((pages - free) * size)


def _damaged(exc: sqlite3.Error) -> bool:
    """SQLITE_CORRUPT or SQLITE_NOTADB, with any extended code: the file is wrong, not the moment."""
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in DAMAGED
