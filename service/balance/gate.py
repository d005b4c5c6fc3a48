"""One worker's side of balancing: its connections, its load on the board, and whether it accepts.

    accepts     a worker accepts only while it serves: its model is ready, it is not shutting down, and,
                with the accept gate on, no sibling has less load; then the kernel hands new connections to
                that sibling. While no sibling serves (the server is starting), a worker whose model loads or
                failed accepts too, so probes are answered at once (``/healthz`` 200, ``/readyz`` 503 and why)
                instead of waiting in the kernel's queue for the load; beside a serving sibling (a reload, a
                respawn) it leaves every connection to the sibling, so no request meets 503 not_ready. One
                that gets ahead rings its siblings' doorbells (``doorbell``), and they look again at once;
                it stays open while none of them accepts (up to a bound that grows with the burst), so a
                burst does not wait in the kernel for a sibling's tick
    load        inference requests in progress, plus connections accepted in the last ``ARRIVAL_WINDOW_S``
                that have not sent their first request (a burst spreads before its requests arrive, and an
                idle flood stops counting after the window)
    idle cap    connections waiting for a request (new or kept alive) beyond ``max_idle`` are closed,
                oldest first, so idle or slow connections cannot fill the worker
    rebalance   a worker that keeps more than one keep-alive connection more than a sibling closes the
                connection of the request it starts, after the response: the client reconnects, and the
                gate sends it to the lighter sibling (after a respawn, say)

The decision is level-triggered: ``tick`` re-applies it every ``TICK_S``, and each accept asks again, so
no lost wake-up (gevent re-arms a full pool's accept once) can leave a worker that should accept idle.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import gevent

from service.balance.board import SLOTS, UNAVAILABLE, Seat
from service.balance.doorbell import Doorbell
from service.balance.memo import SharedMemo
from service.balance.priority import BootPriority
from service.balance.repository import SharedRepository
from service.settings import Settings

log = logging.getLogger(__name__)

TICK_S = 0.02  # how often the decision is re-applied from the siblings' loads
# How long a new connection counts as load before its first request: a burst of connections spreads over the
# workers before its requests arrive, and idle ones stop steering clients after it (docs/SCHEDULING.md#balance).
ARRIVAL_WINDOW_S = 1.0
# A worker ahead of a closed sibling stays open while it is at most 1 ahead, or 1 per this many of its
# arriving connections (``_decide``)
ROOM_PER_ARRIVING = 8
# After two workers last had requests at once, how long none borrows its siblings' cores: a sibling that
# starts a forward during a borrowed one puts 3 torch threads on 2 cores, and libgomp's barriers stall both
# (docs/SCHEDULING.md#cores). One client at a time keeps borrowing.
BORROW_QUIET_S = 2.0


class Listener(Protocol):
    """A listening server the gate opens and closes (``GatedStreamServer``)."""

    def set_accepting(self, accepting: bool) -> None: ...


class Readiness(Protocol):
    """What the gate reads of the engine (``Runner``), and how the worker ends it at exit."""

    @property
    def ready(self) -> bool: ...

    @property
    def fatal_error(self) -> BaseException | None: ...

    def close(self, timeout_s: float) -> bool: ...


@dataclass(frozen=True)
class Policy:
    accept_gate: bool = True
    max_idle: int = 512
    rebalance: bool = True

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        return cls(settings.accept_gate, settings.max_idle_connections, settings.rebalance_connections)


class Balance:
    """Made per worker from its ``Seat``; without one (unit tests, one process) it only counts."""

    def __init__(self, seat: Seat | None, policy: Policy, *, clock: Any = time.monotonic,
                 boot: BootPriority | None = None) -> None:
        self._seat = seat
        self._boot = boot  # lowered while this worker boots beside serving siblings (``priority``)
        self.policy = policy
        self._clock = clock
        self._readiness: Readiness | None = None
        self._listeners: list[Listener] = []
        self._requests = 0
        self._idle: OrderedDict[Any, float] = OrderedDict()  # connection → since when it waits for a request
        self._arriving: OrderedDict[Any, float] = OrderedDict()  # accepted, no request yet → accepted at
        self._kept: set[Any] = set()  # connections that served a request and were not shed
        self._closing = False
        self._accepting: bool | None = None
        self._ticker: gevent.Greenlet | None = None
        self._bell: Doorbell | None = None  # from ``start``, on a board
        self._was_ahead = False
        self._answerer: gevent.Greenlet | None = None
        self._own_repository: SharedRepository | None = None

    @property
    def memo(self) -> SharedMemo | None:
        """What earlier workers of this master measured, for this one to reuse (None outside gunicorn)."""
        return self._seat.memo if self._seat else None

    @property
    def repository(self) -> SharedRepository:
        """Which configured models the host's workers serve (a worker's own outside gunicorn)."""
        if self._seat is not None and self._seat.repository is not None:
            return self._seat.repository
        if self._own_repository is None:
            self._own_repository = SharedRepository(SLOTS)
        return self._own_repository

    def live_slots(self) -> list[int]:
        """Every other live worker's slot."""
        return self._seat.board.others(self.slot) if self._seat else []

    @property
    def slot(self) -> int:
        """This worker's index among its siblings (0 outside gunicorn): also used to spread GPUs."""
        return self._seat.slot if self._seat else 0

    # ------------------------------------------------------------------ wiring

    def start(self, readiness: Readiness) -> None:
        """In the worker, once the app is built: follow ``readiness`` and keep the decision applied."""
        self._readiness = readiness
        if self._seat is not None and self._ticker is None:  # alone (no board) there is nothing to follow
            self._bell = Doorbell(self._seat.board.name, self.slot)
            self._ticker = gevent.spawn(self._tick_forever)
            self._answerer = gevent.spawn(self._answer_bell, self._bell)

    def stop(self) -> None:
        for greenlet in (self._ticker, self._answerer):
            if greenlet is not None:
                greenlet.kill()
        self._ticker = self._answerer = None
        if self._bell is not None:
            self._bell.close()
            self._bell = None

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)
        self.apply()

    def close(self) -> None:
        """Shutting down (SIGTERM/SIGINT/HUP): accept nothing more, at once."""
        self._closing = True
        self.apply()

    def close_engine(self, timeout_s: float) -> bool:
        """At the worker's exit, after the last request: end the engine's threads (``Runner.close``). False:
        one was still running model code after ``timeout_s``."""
        self.stop()
        return self._readiness is None or self._readiness.close(timeout_s)

    def hand_over(self) -> None:
        """Stopping after a reload: serve on, as any worker does, until ``replaced``."""
        if self._seat is not None:
            self._seat.board.mark_leaving(self.slot)
        self.apply()

    def replaced(self, workers: int) -> bool:
        """Enough of the new generation serves for this old worker to stop, with ``workers`` wanted: the old
        ones leave one per ready replacement, lowest slot first, so as many workers serve as before. (When
        every old worker left at the first ready one, that one took all the load while its siblings were
        still loading on the same cores: docs/SCHEDULING.md#hand-over.)"""
        if self._seat is None:
            return False
        new, old, old_below = self._seat.board.generations(self.slot)
        # once this one and those before it have left: the ready new ones plus the old ones after it
        return new + old - old_below >= workers

    # ------------------------------------------------------------------ connections (the gunicorn worker)

    def accepted(self, conn: Any) -> None:
        now = self._clock()
        self._arriving[conn] = now
        self._idle[conn] = now
        while len(self._idle) > self.policy.max_idle:
            oldest, _ = self._idle.popitem(last=False)
            self._arriving.pop(oldest, None)
            _hang_up(oldest)
        self.apply()

    def request_started(self, conn: Any) -> bool:
        """The connection's next request starts; True: close the connection after this response."""
        self._idle.pop(conn, None)
        first = self._arriving.pop(conn, None) is not None
        shed = self._should_shed(conn, first)
        if shed:
            self._kept.discard(conn)
        else:
            self._kept.add(conn)
        self.apply()
        return shed

    def request_done(self, conn: Any) -> None:
        if conn in self._kept:
            self._idle[conn] = self._clock()

    def closed(self, conn: Any) -> None:
        self._idle.pop(conn, None)
        self._arriving.pop(conn, None)
        self._kept.discard(conn)
        self.apply()

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        """Count one inference request in progress (parsing included): what siblings see as load."""
        self._requests += 1
        self.apply()
        if self._seat is not None and any(0 < load < UNAVAILABLE for load, _ in self._seat.board.siblings(self.slot)):
            self._seat.board.mark_overlap(self._clock())
        try:
            yield
        finally:
            self._requests -= 1
            self.apply()

    def may_accept(self) -> bool:
        """Asked at each accept: the decision from the siblings' loads now (the last tick may be 20 ms old)."""
        return self.apply()

    def fatal_error(self) -> BaseException | None:
        """The model's load failed in a way no retry fixes, and no sibling serves: the worker ends the server
        with it. None while a sibling serves (a replacement after a reload): the server goes on serving."""
        error = self._readiness.fatal_error if self._readiness is not None else None
        if error is None or self._seat is not None and self._seat.board.any_serving(self.slot):
            return None
        return error

    # ------------------------------------------------------------------ the view the engine reads

    def siblings_idle(self) -> bool:
        """No live sibling has load, and none had while another did for ``BORROW_QUIET_S`` (false without a
        board: outside gunicorn nothing is known)."""
        if self._seat is None or any(load for load, _ in self._seat.board.siblings(self.slot)):
            return False
        return bool(self._clock() - self._seat.board.overlap_at() > BORROW_QUIET_S)

    # ------------------------------------------------------------------ the decision

    def load(self) -> int:
        """What this worker publishes: requests plus arriving connections, or ``UNAVAILABLE``."""
        if not self._serving():
            return UNAVAILABLE
        horizon = self._clock() - ARRIVAL_WINDOW_S
        while self._arriving and next(iter(self._arriving.values())) < horizon:
            self._arriving.popitem(last=False)
        return self._requests + len(self._arriving)

    def apply(self) -> bool:
        """Publish this worker's load, decide, and open or close the listeners (idempotent)."""
        accepting, ahead = self._decide()
        if accepting != self._accepting:
            log.debug("accepting: %s (load %d)", accepting, self.load())
        if ahead and not self._was_ahead and self._bell is not None:
            # a sibling closed for being ahead of this worker is behind it now: it looks again at once
            assert self._seat is not None
            self._bell.ring(self._seat.board.others(self.slot))
        self._was_ahead = ahead
        self._accepting = accepting
        if self._seat is not None:
            self._seat.board.publish_open(self.slot, accepting)
        for listener in self._listeners:
            listener.set_accepting(accepting)
        return accepting

    def _decide(self) -> tuple[bool, bool]:
        """Whether to accept, and whether this worker is ahead of a sibling (serving, with the gate on)."""
        load = self.load()
        siblings = self._seat.board.siblings(self.slot) if self._seat else []
        if self._seat:
            self._seat.board.publish(self.slot, load, len(self._kept))
        if self._closing:
            return False, False
        least = min((sib_load for sib_load, _ in siblings), default=None)
        serving = self._serving()
        if serving and self._boot is not None and self._boot.lowered:
            self._boot.restore()  # before the first connection: it serves at its normal priority
        if not serving:  # loading or failed: take connections only while no sibling can (the docstring says why)
            return self._readiness is not None and (least is None or least >= UNAVAILABLE), False
        if not self.policy.accept_gate or least is None or load <= least or self._seat is None:
            return True, False
        # Ahead of a sibling: close, unless no sibling accepts now (it is closed, and its doorbell rung) and
        # this worker is not too far ahead. How far grows with the burst: in a flood the kernel's queue must
        # not wait for a sibling's wake-up, but 8 connections at once must still go about 4/4 (the sibling's
        # wake-up takes longer than this worker's accepting them all: they went 6/2).
        room = max(1, len(self._arriving) // ROOM_PER_ARRIVING)
        return load - least <= room and not self._seat.board.any_open(self.slot), True

    def _serving(self) -> bool:
        return not self._closing and self._readiness is not None and self._readiness.ready

    def _should_shed(self, conn: Any, first: bool) -> bool:
        """Only a connection kept alive from an earlier request is shed: a new one was just placed by the
        gate, and shedding it would only bounce it."""
        if not self.policy.rebalance or self._seat is None or first or conn not in self._kept:
            return False
        kept = len(self._kept)
        fewest = min((k for load, k in self._seat.board.siblings(self.slot) if load < UNAVAILABLE), default=None)
        return fewest is not None and kept > fewest + 1

    def _tick_forever(self) -> None:
        while True:
            self.apply()
            gevent.sleep(TICK_S)

    def _answer_bell(self, bell: Doorbell) -> None:
        while bell.wait():
            self.apply()


def _hang_up(conn: Any) -> None:
    """End an idle connection: its reading greenlet sees end-of-file and closes it as usual."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
