"""What the client's connection can do to a request: send a body with broken framing, or go away.

    guard_body          a WSGI wrapper: gunicorn's errors while the body is read (a bad chunk size, a
                        missing CRLF, the client hanging up mid-body) become a 400 ``malformed_body``
                        instead of a 500 with a traceback
    cancel_on_hang_up   while a request works, a greenlet waits on its socket; end-of-file means the client
                        left, and ``ClientGone`` is thrown into the request where it waits (the batch already
                        running finishes, nothing else of it runs)
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import gevent
from gevent.socket import wait_read
from gunicorn.http.errors import NoMoreData, ParseException

from service.errors import ClientGone, RequestError

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def guard_body(app: WSGIApp) -> WSGIApp:
    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        stream = environ.get("wsgi.input")
        if stream is not None:
            environ["wsgi.input"] = _GuardedInput(stream)
        return app(environ, start_response)

    return wrapped


class _GuardedInput:
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def read(self, *args: Any) -> bytes:
        return _framed(self._stream.read, *args)

    def readline(self, *args: Any) -> bytes:
        return _framed(self._stream.readline, *args)

    def readlines(self, *args: Any) -> list[bytes]:
        return _framed(self._stream.readlines, *args)

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line


def _framed(read: Callable[..., Any], *args: Any) -> Any:
    try:
        return read(*args)
    except (ParseException, NoMoreData) as exc:
        raise RequestError(f"the request body is malformed or ended early ({type(exc).__name__}: {exc}); "
                           "send a complete body with a valid Content-Length or chunked framing",
                           code="malformed_body") from exc


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
