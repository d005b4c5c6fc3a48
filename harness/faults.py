"""Fault scenarios against a server on 127.0.0.1, for the fault tests and ``bench.fault_bench``.

    IdleFlood   n connections that each send half a request line, then nothing, until closed
    SlowLoris   keeps n connections open, a byte every ``interval_s``, reopening each one that is dropped
    Load        client threads sending requests in a loop, recording every outcome, until stopped
    probe       timed GETs of one path on fresh connections

Everything is bounded: a connection count, a deadline after which each thread stops by itself, and
socket timeouts. Only 127.0.0.1 is ever a target.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests

from harness.stats import percentile

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


@dataclass
class Outcome:
    started: float  # monotonic
    seconds: float
    status: int  # 0: no HTTP answer (connection error, timeout)
    pid: int | None = None
    error: str = ""
    code: str = ""


@dataclass
class Load:
    """``clients`` threads, each sending ``request(session)`` in a loop (keep-alive unless ``fresh``)."""

    url: str
    clients: int
    request: Callable[[requests.Session, str], requests.Response]
    duration_s: float = 30.0
    fresh: bool = False
    timeout_s: float = 60.0
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._halt = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        self._lock = threading.Lock()

    def start(self) -> Load:
        self.deadline = time.monotonic() + self.duration_s
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> Load:
        self._halt.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)
        return self

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _client(self) -> None:
        session = requests.Session()
        session.trust_env = False
        while not self._halt.is_set() and time.monotonic() < self.deadline:
            if self.fresh:
                session.close()
            t0 = time.monotonic()
            try:
                r = self.request(session, self.url)
                code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
                out = Outcome(t0, time.monotonic() - t0, r.status_code, int(r.headers.get("X-Worker-PID", 0)),
                              code=code)
            except (requests.RequestException, ValueError) as exc:
                out = Outcome(t0, time.monotonic() - t0, 0, error=type(exc).__name__)
            with self._lock:
                self.outcomes.append(out)
        session.close()

    def since(self, t: float) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.started >= t]

    @staticmethod
    def summary(outcomes: list[Outcome]) -> dict[str, Any]:
        ok = [o.seconds for o in outcomes if o.status == 200]
        pids: dict[int, int] = {}
        for o in outcomes:
            if o.status == 200 and o.pid:
                pids[o.pid] = pids.get(o.pid, 0) + 1
        return {"requests": len(outcomes), "ok": len(ok),
                "failed": len(outcomes) - len(ok),
                "failures": sorted({f"{o.status} {o.code or o.error}" for o in outcomes if o.status != 200}),
                "p50_s": round(statistics.median(ok), 3) if ok else None,
                "p99_s": round(p99, 3) if (p99 := percentile(ok, 0.99)) is not None else None,
                "max_s": round(max(ok), 3) if ok else None, "by_pid": pids}


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
