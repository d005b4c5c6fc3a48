"""Facts shared between gunicorn's master and its workers, set up by ``gunicorn.conf.py`` hooks.

Kept torch-free and metric-free: the master imports this module before it forks.

- ``LoadBoard``: each worker's load (inference requests in progress, plus connections it accepted whose
  first request has not started), in shared memory the master allocates before forking. A worker reads
  its siblings' loads to decide whether to stop accepting connections (a less loaded sibling should
  take them) and whether it may borrow idle cores for torch.
- the slot of this worker on the board (also its ordinal, used to spread workers over GPUs);
- the listening servers of this worker, so the accept gate can pause and resume them;
- the connections this worker accepted whose first request has not started (``connection_arrived``).
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable, Protocol

SLOTS = 256  # more than any worker count; a dead worker's slot is reused by its replacement


class Listener(Protocol):
    def pause_accepting(self) -> None: ...

    def resume_accepting(self) -> None: ...


class LoadBoard:
    def __init__(self, slots: int = SLOTS) -> None:
        # RawArray: anonymous shared memory, inherited by every forked worker; single-word writes only
        self._alive = multiprocessing.RawArray("b", slots)
        self._load = multiprocessing.RawArray("i", slots)

    def claim(self) -> int:
        """Master, before fork: the first free slot, marked alive with no load."""
        for i in range(len(self._alive)):
            if not self._alive[i]:
                self._alive[i], self._load[i] = 1, 0
                return i
        raise RuntimeError(f"more than {len(self._alive)} live workers")

    def release(self, slot: int) -> None:
        """Master, when a worker exits."""
        self._alive[slot], self._load[slot] = 0, 0

    def set_load(self, slot: int, load: int) -> None:
        self._load[slot] = load

    def sibling_loads(self, slot: int) -> list[int]:
        """The loads (requests and arriving connections) of the other live workers."""
        return [self._load[i] for i in range(len(self._alive)) if i != slot and self._alive[i]]

    def least_load(self, slot: int) -> int | None:
        """The least load at a live sibling; None without one."""
        return min(self.sibling_loads(slot), default=None)


_board: LoadBoard | None = None
_slot = 0
_listeners: list[Listener] = []


def create_board() -> LoadBoard:
    global _board
    _board = LoadBoard()
    return _board


def board() -> LoadBoard | None:
    return _board


def set_slot(slot: int) -> None:
    global _slot
    _slot = slot


def slot() -> int:
    """This worker's index among its siblings (0..workers-1 while none has been replaced): also used to
    spread workers over GPUs."""
    return _slot


def register_listener(server: Any) -> None:
    _listeners.append(server)


_gate: Callable[[], bool] | None = None


def set_gate(check: Callable[[], bool]) -> None:
    """``check()`` decides from the siblings' loads now whether to accept, pausing the listeners if not."""
    global _gate
    _gate = check


def gate_allows() -> bool:
    """Ask the accept gate at the moment of an accept (True without a gate). The periodic look at the
    siblings is up to 20 ms old: a sibling's load that dropped meanwhile would let one connection in."""
    return _gate is None or _gate()


_arriving: set[Any] = set()  # accepted connections whose first request has not started yet
_on_arrivals: list[Callable[[], None]] = []


def connection_arrived(conn: Any) -> None:
    """A connection was just accepted: it counts as this worker's load until its first request starts
    (the request then counts itself) or it closes. Counted at accept, a burst of connections spreads
    over the workers; counted at the request, one worker took 17 connections within a millisecond,
    before any of their requests had arrived."""
    _arriving.add(conn)
    _arrivals_changed()


def connection_settled(conn: Any) -> None:
    """The connection's first request started, or the connection closed."""
    if conn in _arriving:
        _arriving.discard(conn)
        _arrivals_changed()


def arriving() -> int:
    return len(_arriving)


def on_arrivals(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever ``arriving()`` changes (the runner republishes its load)."""
    _on_arrivals.append(callback)


def _arrivals_changed() -> None:
    for callback in _on_arrivals:
        callback()


def set_accepting(accepting: bool) -> None:
    for server in _listeners:
        if accepting:
            server.resume_accepting()
        else:
            server.pause_accepting()
