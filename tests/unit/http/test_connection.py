"""What a client's connection can do, against gunicorn's own body reader and gevent's sockets: a chunk size
that takes the body past the cap is refused from its size line, before its bytes are awaited; an answer the
client does not read ends at its send bound, and the socket is left as gunicorn set it afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import gevent
import gevent.socket
import pytest
from gunicorn.http.body import Body, ChunkedReader
from gunicorn.http.unreader import IterUnreader
from werkzeug.exceptions import RequestEntityTooLarge

from service.errors import RequestError
from service.http import connection
from service.http.connection import SendBound, guard_body

CAP = 1024


class _Request:
    """What gunicorn's ChunkedReader asks of its request: the line limits (0: gunicorn's defaults)."""

    limit_request_field_size = 0
    max_buffer_headers = 0


def read_chunked(pieces: Iterable[bytes], cap: int = CAP) -> dict[str, Any]:
    """The chunked body ``pieces`` (as they arrive from the socket) read through ``guard_body``: what the
    app's read gave, or raised. The pieces end there: a reader that waited for more would see the body cut
    short (gunicorn's NoMoreData, a 400), not the cap."""
    seen: dict[str, Any] = {}

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        try:
            seen["body"] = environ["wsgi.input"].read()
        except Exception as exc:  # what the view would have seen
            seen["error"] = exc
        return [b""]

    environ = {"wsgi.input": Body(ChunkedReader(_Request(), IterUnreader(pieces)))}
    guard_body(app, cap, 5.0)(environ, lambda *args: None)
    return seen


@pytest.mark.parametrize("pieces", [
    [b"ffffffffffffffff\r\nabc"],  # 16 hex digits: 2**64 - 1 bytes announced, 3 sent
    [b"1", b"0000000"],  # digits that pass the cap before their line ends
    [b"400\r\n" + b"a" * CAP + b"\r\n", b"1\r\nb"],  # a chunk at the cap, then one byte more announced
], ids=["16 hex digits", "digits trickled past the cap", "the sum of the sizes"])
def test_a_chunk_size_past_the_cap_is_413_from_its_size_line(pieces: list[bytes]) -> None:
    seen = read_chunked(pieces)
    assert isinstance(seen.get("error"), RequestEntityTooLarge), seen


@pytest.mark.parametrize(("pieces", "body"), [
    ([b"5\r\nhello\r\n", b"6;ext=1\r\n world\r\n0\r\n\r\n"], b"hello world"),
    ([b"0005\r\nhe", b"llo\r\n0\r\n\r\n"], b"hello"),
    ([b"400\r\n" + b"a" * CAP + b"\r\n0\r\n\r\n"], b"a" * CAP),
], ids=["an extension", "leading zeros", "exactly the cap"])
def test_chunk_sizes_within_the_cap_read_as_gunicorn_reads_them(pieces: list[bytes], body: bytes) -> None:
    assert read_chunked(pieces) == {"body": body}


def test_a_bad_chunk_size_is_still_gunicorns_400() -> None:
    seen = read_chunked([b"zz\r\nabc\r\n0\r\n\r\n"])
    assert isinstance(seen.get("error"), RequestError) and seen["error"].code == "malformed_body"


def test_a_write_the_client_does_not_read_ends_at_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "SEND_GRACE_S", 0.0)
    ours, theirs = gevent.socket.socketpair()
    with ours, theirs:
        bound = SendBound(ours, time.monotonic() + 0.3, time.monotonic())
        bound.arm()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            ours.sendall(b"x" * (64 << 20))  # far more than the socket buffers take: it waits on the peer
        assert 0.2 < time.monotonic() - t0 < 1.0
        bound.release()
        assert ours.gettimeout() is None  # the next request is read as gunicorn set the socket


def test_a_client_that_reads_gets_the_whole_answer_within_the_bound() -> None:
    ours, theirs = gevent.socket.socketpair()
    with ours, theirs:
        answer = b"x" * (8 << 20)

        def read_all() -> int:
            got = 0
            while got < len(answer):
                got += len(theirs.recv(1 << 20))
            return got

        reader = gevent.spawn(read_all)
        bound = SendBound(ours, time.monotonic() + 5, time.monotonic())
        bound.arm()
        ours.sendall(answer)
        assert reader.get(timeout=5) == len(answer)
