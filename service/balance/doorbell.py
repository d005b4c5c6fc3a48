"""How a worker that gets ahead of its siblings tells them to look again at once: each worker binds a Unix
datagram socket in Linux's abstract namespace, named for its board and slot, and a sibling rings it (one
empty datagram).

Without it a worker closed for being ahead looked again only at its next tick (20 ms): in a burst of
connections the workers closed in turn, one arriving connection ahead of the other, and the burst came in
at about one connection a tick, with every connection behind it waiting in the kernel's queue (figures:
docs/SCHEDULING.md#balance). Elsewhere than Linux there is no doorbell, and the ticks alone reopen.

The sockets are the C module's, never gevent's: a ring must not wait. A doorbell whose queue is full has
rings waiting already, and gevent's ``sendto`` would wait for room, ignoring ``MSG_DONTWAIT``.
"""

from __future__ import annotations

import _socket
import contextlib
import socket
import sys
from collections.abc import Iterable

from gevent.socket import wait_read


class Doorbell:
    def __init__(self, board: str, slot: int) -> None:
        self._board = board
        self._sock: _socket.socket | None = None
        if sys.platform.startswith("linux"):
            sock = _socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            try:
                sock.bind(self._address(slot))
                self._sock = sock
            except OSError:
                sock.close()

    def _address(self, slot: int) -> str:
        return f"\0greenserve-{self._board}-{slot}"

    def wait(self) -> bool:
        """Until a sibling rings (cooperatively), then take every ring waiting; False: no doorbell."""
        if self._sock is None:
            return False
        wait_read(self._sock.fileno())
        with contextlib.suppress(BlockingIOError):
            while True:
                self._sock.recv(64)
        return True

    def ring(self, slots: Iterable[int]) -> None:
        """Ring each of ``slots``' doorbells, never waiting; one that is gone or full is skipped."""
        if self._sock is None:
            return
        for slot in slots:
            with contextlib.suppress(OSError):
                self._sock.sendto(b"", self._address(slot))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
