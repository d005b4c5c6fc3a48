"""One keep-alive ``http.client`` connection to a server on 127.0.0.1: JSON POSTs timed by the caller's clock,
the least client work per request (for latency figures that are the server's, not the client library's)."""

from __future__ import annotations

import http.client
import time


class KeepAlive:
    def __init__(self, port: int, timeout_s: float = 60) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)

    def post_ms(self, path: str, body: bytes) -> float:
        """POST ``body`` (JSON) to ``path``, read the answer whole; milliseconds taken. Not 200: RuntimeError."""
        t0 = time.perf_counter()
        self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {path}")
        return (time.perf_counter() - t0) * 1000

    def close(self) -> None:
        self.conn.close()
