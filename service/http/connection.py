"""What the client's connection can do to a request: send a body with broken framing, too long or too
slowly, go away, or not read the answer.

    guard_body          a WSGI wrapper around the body's reads: gunicorn's framing errors (a bad chunk
                        size, a missing CRLF, the client hanging up mid-body) become a 400
                        ``malformed_body`` instead of a 500 with a traceback; a chunked body longer than
                        GREENSERVE_MAX_BODY_BYTES is a 413 (werkzeug's own cap stops reading there without
                        a word), at once when a chunk's size line says so; a body that has not all arrived
                        within GREENSERVE_BODY_TIMEOUT_S is a 408. After any of them the connection closes:
                        the rest of the body will not be read
    cancel_on_hang_up   while a request works, a greenlet waits on its socket; end-of-file means the client
                        left, and ``ClientGone`` is thrown into the request where it waits (the batch already
                        running finishes, nothing else of it runs)
    SendBound           the answer's writes end by the request's deadline (``SEND_GRACE_S`` after an answer
                        ready later): a client that does not read has its connection closed by the worker,
                        and the requests it pipelined behind are never run
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import gevent
from gevent.socket import wait_read
from gunicorn.http.body import ChunkedReader
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import RequestEntityTooLarge

from service.errors import BodyTimeout, ClientGone, RequestError
from service.settings import Settings

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def guard_body(app: WSGIApp, max_body_bytes: int, body_timeout_s: float) -> WSGIApp:
    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        stream = environ.get("wsgi.input")
        if stream is None:
            return app(environ, start_response)
        chunked = not environ.get("CONTENT_LENGTH")  # a Content-Length over the cap is werkzeug's 413
        guarded = _GuardedInput(stream, max_body_bytes if chunked else None, time.monotonic() + body_timeout_s)
        environ["wsgi.input"] = guarded
        answer = app(environ, start_response)
        sock = environ.get("gunicorn.socket")
        if not guarded.refused or sock is None:
            return answer
        _close_after(start_response)
        return _Lingering(answer, sock)

    return wrapped


def _close_after(start_response: Callable[..., Any]) -> None:
    """Close the connection after this answer. gunicorn's ``start_response`` is its Response's own method;
    without this it would try to drain the unread body before the next request (a stalled one for as long
    as its keep-alive timeout, an endless chunked one for ever)."""
    force_close = getattr(getattr(start_response, "__self__", None), "force_close", None)
    if force_close is not None:
        force_close()


LINGER_S = 2.0
LINGER_BYTES = 8 << 20


class _Lingering:
    """A closing that lets the client read the answer (a lingering close, as nginx does): closed with its
    body unread, the socket would answer the client's next bytes with a reset, and the client's TCP stack
    would throw the answer away unread. So: the answer, our end of the sending shut, then what the client
    still sends is read and dropped for at most ``LINGER_S`` and ``LINGER_BYTES``."""

    def __init__(self, answer: Iterable[bytes], sock: socket.socket) -> None:
        self._answer, self._sock = answer, sock

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._answer)

    def close(self) -> None:  # gunicorn calls it once the answer is written
        close = getattr(self._answer, "close", None)
        if close is not None:
            close()
        dropped = 0
        try:
            self._sock.shutdown(socket.SHUT_WR)
            with gevent.Timeout(LINGER_S, False):
                while dropped < LINGER_BYTES and (data := self._sock.recv(65536)):
                    dropped += len(data)
        except OSError:
            pass


class _GuardedInput:
    """The body as gunicorn gives it, read 1 MiB at a time and handed out in the pieces asked for.

    werkzeug asks for 64 KiB at a time, and each such read made gunicorn's buffer copy what it held
    beyond that (up to a whole recv) twice over, on the hub (docs/SCHEDULING.md#hub-turns)."""

    PIECE = 1 << 20

    def __init__(self, stream: Any, cap: int | None, deadline: float) -> None:
        self._stream, self._cap, self._deadline = stream, cap, deadline
        self._received = 0
        self._held, self._at = b"", 0
        self.refused = False
        reader = getattr(stream, "reader", None)
        if cap is not None and isinstance(reader, ChunkedReader):
            reader.parse_chunk_size = _ChunkSizes(reader, cap)

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            data = self._take(len(self._held)) + self._pull(self._stream.read)
        else:
            if self._at >= len(self._held):
                self._held, self._at = self._pull(self._stream.read, max(size, self.PIECE)), 0
            data = self._take(size)
        # A socket that already holds data never makes this greenlet wait, so a large body was read in
        # one turn of the hub (docs/SCHEDULING.md#hub-turns); a turn for the others after every piece
        gevent.sleep(0)
        return data

    def readline(self, size: int | None = -1) -> bytes:
        if self._at < len(self._held):  # what is held first, up to its end of line
            end = self._held.find(b"\n", self._at)
            n = len(self._held) - self._at if end < 0 else end + 1 - self._at
            return self._take(n if size is None or size < 0 else min(n, size))
        return self._pull(self._stream.readline, *(() if size is None or size < 0 else (size,)))

    def readlines(self, *args: Any) -> list[bytes]:
        return list(self)

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line

    def _take(self, n: int) -> bytes:
        data = self._held[self._at:self._at + n]
        self._at += len(data)
        return data

    def _pull(self, read: Callable[..., bytes], *args: Any) -> bytes:
        """From gunicorn, counted: werkzeug reads a chunked body up to the cap and no further, so past it,
        or at it with one more byte to come, the body was larger than allowed."""
        data: bytes = self._guarded(read, *args)
        self._received += len(data)
        if self._cap is not None and data and self._received >= self._cap and (
                self._received > self._cap or self._guarded(self._stream.read, 1)):
            self.refused = True
            raise RequestEntityTooLarge()  # werkzeug's own, so the one 413 handler words it (api.handle_http)
        return data

    def _guarded(self, read: Callable[..., Any], *args: Any) -> Any:
        timer = gevent.Timeout(max(self._deadline - time.monotonic(), 0.001))
        try:
            with timer:
                return read(*args)
        except gevent.Timeout as exc:
            if exc is not timer:  # someone else's deadline
                raise
            self.refused = True
            raise BodyTimeout("the request body did not arrive in time; send it whole within "
                              "GREENSERVE_BODY_TIMEOUT_S (or put a proxy that buffers bodies in front)") from None
        except _OverCap:
            self.refused = True
            raise RequestEntityTooLarge() from None
        except (ParseException, NoMoreData) as exc:
            self.refused = True
            raise RequestError(f"the request body is malformed or ended early ({type(exc).__name__}: {exc}); "
                               "send a complete body with a valid Content-Length or chunked framing",
                               code="malformed_body") from exc


_HEX_DIGITS = re.compile(rb"[0-9A-Fa-f]*")


class _OverCap(Exception):
    """A chunk's size line says the body will be longer than the cap."""


class _ChunkSizes:
    """gunicorn's parsing of a chunk's size line, with the cap applied to the digits as they arrive: a size that
    takes the body past GREENSERVE_MAX_BODY_BYTES (16 hex digits, say) is refused at once, where gunicorn would
    wait for that many bytes until the body's deadline. Set on this request's ``ChunkedReader``, whose parser
    looks the method up on the reader for each chunk."""

    def __init__(self, reader: Any, cap: int) -> None:
        self._reader, self._parse, self._left = reader, reader.parse_chunk_size, cap

    def __call__(self, unreader: Any, data: bytes | None = None) -> tuple[int, bytes | None]:
        line = bytearray(data or b"")
        # past gunicorn's line limit its own parse refuses the line (400)
        while self._fits(line) and b"\r\n" not in line and len(line) <= self._reader.limit_chunk_size_line:
            self._reader.read_into(unreader, line)
        if not self._fits(line):
            raise _OverCap()
        size, rest = self._parse(unreader, bytes(line))
        self._left -= size
        return size, rest

    def _fits(self, line: bytearray) -> bool:
        """The size the line's hex digits say so far (more digits only make it larger) is within what is left."""
        match = _HEX_DIGITS.match(line)
        digits = match.group().lstrip(b"0") if match else b""
        return len(digits) <= len(f"{self._left:x}") and int(digits or b"0", 16) <= self._left


SEND_GRACE_S = 2.0  # an answer ready at (or after) its deadline still has this long to be written
_LAST_WRITE_S = 0.05  # a write past the bound: only what the kernel takes at once still goes


class SendBound:
    """The writes of one answer, bounded in time: each ends by ``until``, the request's deadline (or
    ``SEND_GRACE_S`` after the answer was ready, if later). The socket's own timeout carries it (gevent's
    ``sendall`` holds to it across the whole call), set before each write; a write that cannot finish raises
    ``TimeoutError`` in gunicorn's write, and the worker closes the connection (``gunicorn_worker``)."""

    def __init__(self, sock: Any, deadline: float, now: float) -> None:
        self._sock, self.until = sock, max(deadline, now) + SEND_GRACE_S

    def arm(self) -> None:
        """Before a write: what is left of the bound."""
        if self._sock is not None:
            self._sock.settimeout(max(self.until - time.monotonic(), _LAST_WRITE_S))

    def release(self) -> None:
        """After the answer: the connection's next request is read as gunicorn set it, without a timeout."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.settimeout(None)


@contextlib.contextmanager
def cancel_on_hang_up(sock: socket.socket | None) -> Iterator[None]:
    """Throw ``ClientGone`` into the calling greenlet if ``sock``'s peer closes it meanwhile."""
    if sock is None:  # not under gunicorn (unit tests)
        yield
        return
    request = gevent.getcurrent()

    def watch() -> None:
        try:
            wait_read(sock.fileno())
            gone = not sock.recv(1, socket.MSG_PEEK)  # readable with no byte: end-of-file
        except OSError:
            gone = True
        if gone:
            gevent.kill(request, ClientGone("the client disconnected before the answer was ready"))
        # else: the client sent more (a pipelined request); nothing more can be learnt without reading it

    watcher = gevent.spawn(watch)
    try:
        yield
    finally:
        watcher.kill()


def werkzeug_limits(settings: Settings) -> dict[str, int]:
    """The app's config for werkzeug's own caps, which refuse a larger body with 413 before a view reads it."""
    return {"MAX_CONTENT_LENGTH": settings.max_body_bytes, "MAX_FORM_MEMORY_SIZE": settings.max_body_bytes,
            # werkzeug's default of 1,000 form parts would refuse a form within the image and label limits
            "MAX_FORM_PARTS": settings.max_images + settings.max_labels + 16}
