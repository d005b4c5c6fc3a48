"""Fault scenarios against a server on 127.0.0.1, for the fault tests and ``bench.fault_bench``.

    IdleFlood   n connections that each send half a request line, then nothing, until closed
    SlowLoris   keeps n connections open, a byte every ``interval_s``, reopening each one that is dropped
    probe       timed GETs of one path on fresh connections
    damage_page garbage over one table page in the middle of a sqlite file (the disk cache's)

Everything is bounded: a connection count, a deadline after which each thread stops by itself, and
socket timeouts. Only 127.0.0.1 is ever a target. The load
they run beside is ``harness.load``.
"""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from pathlib import Path

import requests

HOST = "127.0.0.1"
PARTIAL_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: greenserve\r\nX-Slow: "


class IdleFlood:
    """``with IdleFlood(port, 600) as flood:`` opens the connections (those the server refuses are counted)."""

    def __init__(self, port: int, n: int, *, connect_timeout_s: float = 2.0) -> None:
        self.port, self.n, self.connect_timeout_s = port, n, connect_timeout_s
        self.socks: list[socket.socket] = []
        self.refused = 0

    def __enter__(self) -> IdleFlood:
        for _ in range(self.n):
            try:
                s = socket.create_connection((HOST, self.port), timeout=self.connect_timeout_s)
                s.sendall(PARTIAL_REQUEST)
                self.socks.append(s)
            except OSError:
                self.refused += 1
        return self

    def still_open(self) -> int:
        """How many of the flood's connections the server has not closed."""
        alive = 0
        for s in self.socks:
            s.setblocking(False)
            try:
                alive += s.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                alive += 1
            except OSError:
                pass
        return alive

    def __exit__(self, *exc: object) -> None:
        for s in self.socks:
            s.close()
        self.socks.clear()


class SlowLoris(threading.Thread):
    """Keeps ``n`` slow connections open until ``stop()`` or ``duration_s``; counts reopenings."""

    def __init__(self, port: int, n: int, *, interval_s: float = 1.0, duration_s: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.port, self.n, self.interval_s = port, n, interval_s
        self.deadline = time.monotonic() + duration_s
        self.reopened = 0
        self._halt = threading.Event()

    def run(self) -> None:
        socks: list[socket.socket | None] = [None] * self.n
        try:
            while not self._halt.is_set() and time.monotonic() < self.deadline:
                for i in range(self.n):
                    socks[i] = self._drip(socks[i])
                self._halt.wait(self.interval_s)
        finally:
            for s in socks:
                if s is not None:
                    s.close()

    def _drip(self, s: socket.socket | None) -> socket.socket | None:
        try:
            if s is None:
                s = socket.create_connection((HOST, self.port), timeout=1.0)
                s.sendall(PARTIAL_REQUEST)
                self.reopened += 1
            else:
                s.sendall(b"x")
            return s
        except OSError:
            if s is not None:
                s.close()
            return None

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def probe(url: str, n: int, *, interval_s: float = 0.1, timeout_s: float = 2.0) -> tuple[list[float], int]:
    """``n`` GETs of ``url`` on fresh connections: (latencies of the answered ones, how many failed)."""
    latencies, failed = [], 0
    for _ in range(n):
        t0 = time.monotonic()
        try:
            r = requests.get(url, timeout=timeout_s)
            if r.status_code == 200:
                latencies.append(time.monotonic() - t0)
            else:
                failed += 1
        except requests.RequestException:
            failed += 1
        time.sleep(interval_s)
    return latencies, failed


def worker_pid_answering(url: str, tries: int = 40) -> set[int]:
    pids = set()
    for _ in range(tries):
        try:
            pids.add(requests.get(url + "/healthz", timeout=2).json()["pid"])
        except requests.RequestException:
            pass
    return pids


def damage_page(path: str | Path, page_bytes: int = 4096) -> int:
    """Garbage over one table b-tree page in the second half of the sqlite file at ``path``, its WAL copied in
    first, so readers find it there (what a torn write or a failing disk leaves): the page's index."""
    db = sqlite3.connect(str(path))
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    finally:
        db.close()
    data = Path(path).read_bytes()
    pages = len(data) // page_bytes
    index = next(n for n in range(pages // 2, pages) if data[n * page_bytes] == 0x0D)  # 0x0D: a table leaf
    with open(path, "r+b") as f:
        f.seek(index * page_bytes)
        f.write(b"\xa5" * page_bytes)
    return index
