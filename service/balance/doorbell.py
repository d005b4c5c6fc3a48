"""How a worker that closes its listeners for being ahead of a sibling tells that sibling to look again at
once: each worker binds a Unix datagram socket in Linux's abstract namespace, named for its board and
slot, and a sibling that closes rings it (one empty datagram).

Without it a closed worker looked again only at its next tick (20 ms): in a burst of connections the
workers closed in turn, one arriving connection ahead of the other, and the burst came in at about one
connection a tick while a probe behind it waited 2.0 s in the kernel's queue. Elsewhere than Linux there
is no doorbell, and the ticks alone reopen.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterable

from gevent import socket as gsocket


class Doorbell:
    def __init__(self, board: str, slot: int) -> None:
        self._board = board
        self._sock: gsocket.socket | None = None
        if sys.platform.startswith("linux"):
            sock = gsocket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.bind(self._address(slot))
                self._sock = sock
            except OSError:
                sock.close()

    def _address(self, slot: int) -> str:
        return f"\0greenserve-{self._board}-{slot}"

    def wait(self) -> bool:
        """Until a sibling rings (cooperatively); False when there is no doorbell."""
        if self._sock is None:
            return False
        self._sock.recv(64)
        return True

    def ring(self, slots: Iterable[int]) -> None:
        """Ring each of ``slots``' doorbells; one that is not there (a worker that has gone) is skipped."""
        if self._sock is None:
            return
        for slot in slots:
            with contextlib.suppress(OSError):
                self._sock.sendto(b"", socket.MSG_DONTWAIT, self._address(slot))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
