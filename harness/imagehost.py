"""A real local HTTP image host with fault knobs, for the tests and the benchmarks.

Serves in-memory blobs and/or a directory on 127.0.0.1. Per-request knobs in the query string:

    delay=S        wait S seconds before answering (also settable host-wide: ``latency_s``)
    status=N       answer with status N (retry_after=S adds a Retry-After header)
    fail=K         answer 503 for the first K requests of this path+query, then serve normally
    redirect=URL   302 to URL (hops=N chains N redirects to this same path first)
    drip=S         send the body one byte every S seconds
    endless=1      an endless body without Content-Length
    ctype=T        Content-Type T instead of the one guessed from the name
    length=N       declare Content-Length N whatever the body is
    cut=N          declare the whole body's length, send its first N bytes, then close the connection
    gzip=1         send the body gzip-encoded (Content-Encoding: gzip)
    encoding=E     claim Content-Encoding E without encoding the body (a lying or exotic host)
    reset=1        reset the connection (RST) instead of answering
    validators=0   send neither ETag nor Last-Modified (validators=lm: Last-Modified only)
    etag=V         send the ETag "V" whatever the body (a host that reuses one ETag at other URLs)
    cache_control=V  send Cache-Control V (no-store, max-age=60, ...)

``host.redirect(name, target)`` makes ``name`` a 302 to ``target`` from then on, whatever the query, and a
later call moves it (a "latest" link, a CDN alias); ``cache_control=`` sends that Cache-Control with the 302.

Every image goes out with a strong ETag (its content's digest) and a Last-Modified (when ``replace`` last
set it), and a conditional GET whose If-None-Match (or, without one, If-Modified-Since) still holds gets
304 Not Modified without the body, as real image hosts and CDNs answer.

The host counts what it saw: ``hits`` per path, ``not_modified`` 304s and ``body_bytes`` sent,
``connections`` accepted (keep-alive shows as fewer connections than requests), ``max_inflight`` requests
handled at once. ``tls=`` serves HTTPS.

``python -m harness.imagehost --dir DIR --port P [--latency-ms L]`` runs it standalone.
"""

from __future__ import annotations

import argparse
import email.utils
import gzip
import hashlib
import mimetypes
import os
import socket
import ssl
import struct
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

START = float(int(time.time()))  # the Last-Modified of every image not replaced since the host started
STOP_POLL_S = 0.05  # how often the serving loop looks for stop(): the stdlib's 0.5 s made each stop cost half a second


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, host: ImageHost) -> None:
        self.host = host
        super().__init__((host.bind, host.port), _Handler)
        if host.tls is not None:
            self.socket = host.tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request: object, client_address: object) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, ssl.SSLError)):
            return  # a client hung up (byte cap, deadline) or refused our certificate: what fault tests do
        super().handle_error(request, client_address)  # anything else is a bug here: print it


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # quiet: tests read ``host.hits``
        pass

    def setup(self) -> None:
        with self.server.host.lock:
            self.server.host.connections += 1
        super().setup()

    def do_GET(self) -> None:
        host = self.server.host
        with host.lock:
            host.inflight += 1
            host.max_inflight = max(host.max_inflight, host.inflight)
        try:
            self._get()
        finally:
            with host.lock:
                host.inflight -= 1

    def _get(self) -> None:
        host = self.server.host
        parts = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        name = parts.path.lstrip("/")
        with host.lock:
            host.hits[parts.path] += 1
            host.hits_full[self.path] += 1
            seen = host.hits_full[self.path]
            host.headers_seen.append(dict(self.headers))
        delay = float(q.get("delay", host.latency_s))
        if delay:
            time.sleep(delay)
        if q.get("reset"):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if "fail" in q and seen <= int(q["fail"]):
            return self._plain(503, b"try again", {"Retry-After": q.get("retry_after", "0")})
        if "status" in q:
            extra = {"Retry-After": q["retry_after"]} if "retry_after" in q else {}
            return self._plain(int(q["status"]), b"status knob", extra)
        if "redirect" in q:
            hops = int(q.get("hops", "0"))
            if hops > 0:
                rest = parts.query.replace(f"hops={hops}", f"hops={hops - 1}")
                return self._plain(302, b"", {"Location": f"{parts.path}?{rest}"})
            return self._plain(302, b"", {"Location": q["redirect"]})
        if name in host.redirects:
            target, cache_control = host.redirects[name]
            return self._plain(302, b"", {"Location": target, **({"Cache-Control": cache_control} if cache_control else {})})
        if q.get("endless"):
            return self._endless(q.get("ctype", "image/jpeg"))
        body = host.get(name)
        if body is None:
            return self._plain(404, b"no such image", {})
        ctype = q.get("ctype") or mimetypes.guess_type(name)[0] or "application/octet-stream"
        headers = {"Content-Type": ctype, **self._validators(name, body, q)}
        if self._not_modified(headers):
            with host.lock:
                host.not_modified += 1
            return self._send(304, {k: v for k, v in headers.items() if k != "Content-Type"})
        if q.get("gzip"):
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        if q.get("encoding"):
            headers["Content-Encoding"] = q["encoding"]
        headers["Content-Length"] = q.get("length", str(len(body)))
        self._send(200, headers)
        if "drip" in q:
            step = float(q["drip"])
            try:
                for i in range(len(body)):
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                    time.sleep(step)
            except OSError:
                pass  # the client gave up: that is what drip tests expect
            return
        if "cut" in q:
            self.close_connection = True
            try:
                self.wfile.write(body[:int(q["cut"])])
                self.wfile.flush()
            except OSError:
                pass
            return
        try:
            self.wfile.write(body)
            with host.lock:
                host.body_bytes += len(body)
        except OSError:
            pass  # the client hung up mid-body (a byte cap or a deadline): nothing left to do

    def _validators(self, name: str, body: bytes, q: dict[str, str]) -> dict[str, str]:
        mode = q.get("validators", "1")
        headers = {"Cache-Control": q["cache_control"]} if "cache_control" in q else {}
        if mode in ("1", "etag"):
            headers["ETag"] = '"' + (q.get("etag") or hashlib.sha256(body).hexdigest()[:20]) + '"'
        if mode in ("1", "lm"):
            headers["Last-Modified"] = email.utils.formatdate(self.server.host.modified.get(name, START), usegmt=True)
        return headers

    def _not_modified(self, headers: dict[str, str]) -> bool:
        if "ETag" in headers and self.headers.get("If-None-Match"):
            return headers["ETag"] in [t.strip() for t in self.headers["If-None-Match"].split(",")]
        since, modified = self.headers.get("If-Modified-Since"), headers.get("Last-Modified")
        if since and modified and not self.headers.get("If-None-Match"):
            try:
                return email.utils.parsedate_to_datetime(modified) <= email.utils.parsedate_to_datetime(since)
            except (TypeError, ValueError):
                return False
        return False

    def _send(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _plain(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self._send(status, {"Content-Type": "text/plain", "Content-Length": str(len(body)), **headers})
        self.wfile.write(body)

    def _endless(self, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        chunk = b"\xff" * 65536
        deadline = time.monotonic() + 60  # bounded: a test host must stop by itself
        try:
            self.wfile.write(b"\xff\xd8\xff\xe0")  # starts like a JPEG, so only a byte cap stops it
            while time.monotonic() < deadline:
                self.wfile.write(chunk)
        except OSError:
            pass


class ImageHost:
    """``with ImageHost(blobs) as host: host.url("a.jpg")``."""

    def __init__(self, blobs: dict[str, bytes] | None = None, *, directory: str | os.PathLike | None = None,
                 bind: str = "127.0.0.1", port: int = 0, latency_s: float = 0.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.blobs = dict(blobs or {})
        self.directory = Path(directory) if directory else None
        self.bind, self.port, self.latency_s, self.tls = bind, port, latency_s, tls
        self.lock = threading.Lock()
        self.hits: Counter[str] = Counter()
        self.hits_full: Counter[str] = Counter()
        self.headers_seen: list[dict[str, str]] = []
        self.modified: dict[str, float] = {}  # Unix time each name was last replaced (else START)
        self.redirects: dict[str, tuple[str, str]] = {}  # name -> (Location, Cache-Control): ``redirect``
        self.not_modified = 0
        self.body_bytes = 0
        self.connections = 0
        self.inflight = 0
        self.max_inflight = 0
        self._server: _Server | None = None

    def replace(self, name: str, data: bytes) -> None:
        """Serve ``data`` as ``name`` from now on: a new ETag, and a Last-Modified at least a second later."""
        with self.lock:
            self.blobs[name] = data
            self.modified[name] = max(time.time(), self.modified.get(name, START) + 1)

    def redirect(self, name: str, target: str, cache_control: str = "") -> None:
        """Answer ``name`` with a 302 to ``target`` from now on (a later call moves it)."""
        with self.lock:
            self.redirects[name] = (target, cache_control)

    def get(self, name: str) -> bytes | None:
        if name in self.blobs:
            return self.blobs[name]
        if self.directory:
            path = (self.directory / name).resolve()
            if path.is_file() and self.directory.resolve() in path.parents:
                return path.read_bytes()
        return None

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.bind}:{self.port}/"

    def url(self, name: str, **knobs: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in knobs.items())
        return self.base_url + name + (f"?{query}" if query else "")

    def start(self) -> ImageHost:
        self._server = _Server(self)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, args=(STOP_POLL_S,), name="imagehost", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> ImageHost:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Canary:
    """A listener that must stay untouched: counts every TCP connection to 127.0.0.1:port (and [::1]:port).

    SSRF tests point blocked URLs at it; any connection at all means the guard let one through.
    ``with Canary() as canary: ...; assert canary.connections == 0``.
    """

    def __init__(self) -> None:
        self.connections = 0
        self.peers: list[str] = []
        self.lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.port = 0
        self.ipv6 = False

    def start(self) -> Canary:
        v4 = socket.create_server(("127.0.0.1", 0))
        self.port = v4.getsockname()[1]
        self._socks.append(v4)
        try:  # same port on IPv6 loopback, where the machine has it
            self._socks.append(socket.create_server(("::1", self.port), family=socket.AF_INET6))
            self.ipv6 = True
        except OSError:
            pass  # no IPv6 loopback here: the IPv6 cases still must be refused, they just cannot connect
        for sock in self._socks:
            threading.Thread(target=self._accept, args=(sock,), name="canary", daemon=True).start()
        return self

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, peer = sock.accept()
            except OSError:
                return  # closed by stop()
            with self.lock:
                self.connections += 1
                self.peers.append(str(peer))
            conn.close()

    def stop(self) -> None:
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass  # not connected: Linux still wakes accept(); close() below releases the port
            sock.close()

    def __enter__(self) -> Canary:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    args = parser.parse_args()
    host = ImageHost(directory=args.dir, port=args.port, latency_s=args.latency_ms / 1000).start()
    print(host.base_url, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        host.stop()


if __name__ == "__main__":
    main()
