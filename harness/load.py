"""The one load generator of the tests and benchmarks: a closed loop of ``clients`` threads, each posting one
JSON body after another to a server on 127.0.0.1 until stopped or its duration is up.

Each client holds one ``http.client`` keep-alive connection (``fresh``: a new one per request) and parses
only a failed answer's body, so the figures are the server's and not the client library's. Every request
ends as a ``Done``: the fault tests count statuses and worker pids, the benchmarks take latencies and
completion times from the same records.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from harness.stats import percentile


@dataclass(frozen=True)
class Done:
    """One finished request."""

    started: float  # time.monotonic()
    seconds: float
    status: int  # 0: no HTTP answer (connection error, timeout)
    images: int = 0
    code: str = ""  # a failed answer's error code, with its details' codes: "out_of_memory/..."
    pid: int | None = None  # X-Worker-PID
    retry_after: str | None = None
    error: str = ""  # the exception's name when there was no answer

    @property
    def ended(self) -> float:
        return self.started + self.seconds


def error_code(body: Any) -> str:
    """``{"error": {"code", "details": [{"code"}]}}`` → "code" or "code/detail,codes"."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return "?"
    details = sorted({str(d.get("code")) for d in err.get("details") or [] if isinstance(d, dict) and d.get("code")})
    return str(err.get("code", "?")) + (f"/{','.join(details)}" if details and details != [err.get("code")] else "")


class _Client:
    """One connection posting one body; a connection error drops the connection and the next post opens one."""

    def __init__(self, url: str, path: str, body: bytes, images: int, timeout_s: float, fresh: bool,
                 headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.path, self.body, self.images, self.timeout_s, self.fresh = path, body, images, timeout_s, fresh
        self.headers = {"Content-Type": "application/json", **headers}
        self.conn: http.client.HTTPConnection | None = None

    def post(self) -> Done:
        t0 = time.monotonic()
        reused = self.conn is not None
        try:
            resp, data = self._exchange()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
            self.close()
            if not reused:
                return Done(t0, time.monotonic() - t0, 0, self.images, error=type(exc).__name__)
            try:  # the server closed the idle keep-alive connection first: once more on a new one, as SDKs do
                resp, data = self._exchange()
            except (OSError, http.client.HTTPException) as again:
                self.close()
                return Done(t0, time.monotonic() - t0, 0, self.images, error=type(again).__name__)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return Done(t0, time.monotonic() - t0, 0, self.images, error=type(exc).__name__)
        seconds = time.monotonic() - t0
        if self.fresh or resp.will_close:
            self.close()
        pid = int(resp.getheader("X-Worker-PID") or 0) or None
        if resp.status == 200:
            return Done(t0, seconds, 200, self.images, pid=pid)
        try:
            code = error_code(json.loads(data))
        except ValueError:
            code = "not_json"
        return Done(t0, seconds, resp.status, self.images, code, pid, resp.getheader("Retry-After"))

    def _exchange(self) -> tuple[http.client.HTTPResponse, bytes]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        self.conn.request("POST", self.path, body=self.body, headers=self.headers)
        resp = self.conn.getresponse()
        return resp, resp.read()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Load:
    """``clients`` threads posting ``body`` (with ``headers``: X-Client-ID, say) to ``url + path`` back to
    back for ``duration_s`` or until ``stop()``; a context manager. ``done`` holds every finished request in
    the order they ended. ``retry_after``: after a refusal that says Retry-After, a client waits that long."""

    def __init__(self, url: str, clients: int, body: dict[str, Any], *, path: str = "/v1/embeddings",
                 duration_s: float = 30.0, fresh: bool = False, timeout_s: float = 60.0,
                 headers: dict[str, str] | None = None, retry_after: bool = False) -> None:
        self.duration_s, self.timeout_s, self.retry_after = duration_s, timeout_s, retry_after
        payload = json.dumps(body).encode()
        images = len(body.get("images") or body.get("input") or [])
        self._clients = [_Client(url, path, payload, images, timeout_s, fresh, headers or {})
                         for _ in range(clients)]
        self._threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in self._clients]
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self.done: list[Done] = []
        self.deadline = 0.0

    def start(self) -> Load:
        self.deadline = time.monotonic() + self.duration_s
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> Load:
        self._halt.set()
        return self.join()

    def join(self) -> Load:
        """Wait for the clients to finish (at the duration's end, or after ``stop``)."""
        for t in self._threads:
            t.join(max(0.0, self.deadline - time.monotonic()) + self.timeout_s + 5)
        return self

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, client: _Client) -> None:
        while not self._halt.is_set() and time.monotonic() < self.deadline:
            done = client.post()
            with self._lock:
                self.done.append(done)
            if self.retry_after and done.retry_after:  # as the SDKs do: wait as told before the next try
                self._halt.wait(min(float(done.retry_after), max(0.0, self.deadline - time.monotonic())))
        client.close()

    def since(self, t: float) -> list[Done]:
        """The requests started at ``t`` (time.monotonic()) or later."""
        with self._lock:
            return [d for d in self.done if d.started >= t]


def post_once(url: str, body: dict[str, Any], *, path: str = "/v1/embeddings", timeout_s: float = 60.0,
              headers: dict[str, str] | None = None) -> Done:
    """One request on a fresh connection, recorded as the load's requests are."""
    images = len(body.get("images") or body.get("input") or [])
    client = _Client(url, path, json.dumps(body).encode(), images, timeout_s, True, headers or {})
    try:
        return client.post()
    finally:
        client.close()


def load_summary(done: list[Done]) -> dict[str, Any]:
    """Counts, failures by status and code, latency p50/p99/max of the 200s, answers per worker pid."""
    ok = [d.seconds for d in done if d.status == 200]
    pids: dict[int, int] = {}
    for d in done:
        if d.status == 200 and d.pid:
            pids[d.pid] = pids.get(d.pid, 0) + 1
    return {"requests": len(done), "ok": len(ok), "failed": len(done) - len(ok),
            "failures": sorted({f"{d.status} {d.code or d.error}" for d in done if d.status != 200}),
            "p50_s": round(statistics.median(ok), 3) if ok else None,
            "p99_s": round(p99, 3) if (p99 := percentile(ok, 0.99)) is not None else None,
            "max_s": round(max(ok), 3) if ok else None, "by_pid": pids}
