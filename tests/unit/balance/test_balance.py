"""The balance part on its own: the accept decision, arrivals, the idle cap, rebalancing, and the listening
server that follows the decision (a real gevent StreamServer with a full pool)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import gevent
import gevent.event
import gevent.pool
import pytest

from service.balance import gate
from service.balance.board import UNAVAILABLE, LoadBoard, Seat
from service.balance.doorbell import Doorbell
from service.balance.gate import ARRIVAL_WINDOW_S, BORROW_QUIET_S, Balance, Policy
from service.balance.gunicorn_worker import GatedStreamServer


@dataclass
class Engine:
    ready: bool = True
    load_error: BaseException | None = None
    fatal_error: BaseException | None = None


class Listener:
    def __init__(self) -> None:
        self.accepting: bool | None = None

    def set_accepting(self, accepting: bool) -> None:
        self.accepting = accepting


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Conn:
    def __init__(self) -> None:
        self.hung_up = False

    def shutdown(self, how: int) -> None:
        self.hung_up = True


def pair(policy: Policy | None = None, engine: Engine | None = None) -> tuple[Balance, LoadBoard, int, Listener, Clock]:
    """A balance on slot 0 of a board whose slot 1 is a sibling (its load set by the test)."""
    board = LoadBoard(slots=4)
    mine, sibling = board.claim(), board.claim()
    clock = Clock()
    balance = Balance(Seat(board, mine), policy or Policy(), clock=clock)
    balance._readiness = engine or Engine()
    listener = Listener()
    balance.add_listener(listener)
    board.publish(sibling, 0, 0)
    board.publish_open(sibling, True)
    return balance, board, sibling, listener, clock


def test_a_worker_accepts_only_while_no_sibling_has_less_load() -> None:
    balance, board, sibling, listener, _ = pair()
    assert balance.may_accept() and listener.accepting  # equal loads: both accept
    with balance.inference():
        assert not listener.accepting  # 1 against 0
        board.publish(sibling, 1, 0)
        assert balance.may_accept() and listener.accepting  # asked at the accept: the sibling's load now
    board.publish(sibling, 3, 0)
    assert balance.may_accept()


def test_a_worker_that_gets_ahead_rings_its_sibling_which_reopens_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a burst each worker closes once it is an arriving connection ahead. The one closed before looked
    again only at its next tick, so the burst came in about a connection a tick, or (had the one ahead
    stayed open) went nearly all to one worker."""
    monkeypatch.setattr(gate, "TICK_S", 30.0)  # no tick comes to the rescue in this test
    board = LoadBoard(slots=4)
    a, b = (Balance(Seat(board, board.claim()), Policy(), clock=Clock()) for _ in range(2))
    listeners = {}
    for name, balance in (("a", a), ("b", b)):
        listeners[name] = Listener()
        balance.add_listener(listeners[name])
        balance.start(Engine())
    try:
        gevent.sleep(0.01)
        b.accepted(Conn())  # b ahead: it closes
        assert not listeners["b"].accepting and listeners["a"].accepting
        a.accepted(Conn())
        a.accepted(Conn())  # now a is ahead: it rings b, and stays open while b is closed
        assert listeners["a"].accepting
        gevent.sleep(0.05)
        assert listeners["b"].accepting, "b waited for its tick"
        assert not a.may_accept()  # b accepts again: a, ahead, closes
    finally:
        a.stop()
        b.stop()


def test_a_worker_ahead_of_its_sibling_accepts_while_the_sibling_does_not() -> None:
    """Both closed at once, a burst would wait in the kernel: the one ahead stays open meanwhile."""
    balance, board, sibling, listener, _ = pair()
    with balance.inference():
        assert not listener.accepting  # ahead of a sibling that accepts
        board.publish_open(sibling, False)
        assert balance.may_accept() and listener.accepting
        assert board.any_open(sibling)  # what the sibling sees: this worker accepts
        board.publish_open(sibling, True)
        assert not balance.may_accept() and not board.any_open(sibling)


def test_a_new_connection_counts_as_load_only_for_the_arrival_window() -> None:
    balance, board, sibling, listener, clock = pair()
    balance.accepted(Conn())
    assert balance.load() == 1 and not listener.accepting
    clock.now += ARRIVAL_WINDOW_S + 0.01  # an idle connection stops steering clients away
    assert balance.may_accept() and balance.load() == 0
    conn = Conn()
    balance.accepted(conn)
    balance.request_started(conn)  # its request counts itself (through inference()), not the arrival
    assert balance.load() == 0


def test_without_the_gate_a_worker_accepts_whatever_its_siblings_load() -> None:
    balance, board, sibling, listener, _ = pair(Policy(accept_gate=False))
    with balance.inference(), balance.inference():
        assert balance.may_accept() and listener.accepting


def test_a_loading_worker_beside_a_serving_sibling_accepts_nothing_and_the_sibling_does_not_defer_to_it() -> None:
    """A reload or a respawn: the serving sibling takes every connection, so no request meets 503 not_ready."""
    engine = Engine(ready=False)
    for policy in (Policy(), Policy(accept_gate=False)):
        balance, board, sibling, listener, _ = pair(policy, engine)
        assert not balance.may_accept() and not listener.accepting
        assert board.siblings(sibling) == [(UNAVAILABLE, 0)]
    engine.ready = True
    assert balance.may_accept() and board.siblings(sibling) == [(0, 0)]


def test_while_no_sibling_serves_a_loading_worker_accepts_so_probes_are_answered() -> None:
    """The server is starting: /healthz 200 and /readyz 503 at once, not after the load in the kernel's queue."""
    engine = Engine(ready=False)
    balance, board, sibling, listener, _ = pair(engine=engine)
    board.publish(sibling, UNAVAILABLE, 0)  # loading too
    assert balance.may_accept() and listener.accepting
    assert board.siblings(sibling) == [(UNAVAILABLE, 0)]  # still no load for a sibling to defer to
    board.publish(sibling, 0, 0)  # the sibling is ready first: it takes the connections from now on
    assert not balance.may_accept() and not listener.accepting
    alone = Balance(None, Policy())
    alone._readiness = engine
    assert alone.may_accept()


def test_a_load_no_retry_fixes_ends_the_server_only_while_no_sibling_serves() -> None:
    missing = FileNotFoundError("weights")
    balance, board, sibling, _, _ = pair(engine=Engine(ready=False, load_error=missing, fatal_error=missing))
    assert balance.fatal_error() is None  # a replacement beside a serving sibling: the server serves on
    board.publish(sibling, UNAVAILABLE, 0)
    assert balance.fatal_error() is missing
    other, board, sibling, _, _ = pair(engine=Engine(ready=False, load_error=RuntimeError("CUDA error")))
    board.publish(sibling, UNAVAILABLE, 0)
    assert other.fatal_error() is None  # a retry may fix it: not fatal


def test_a_worker_whose_model_failed_accepts_only_when_no_sibling_can() -> None:
    engine = Engine(ready=False, load_error=RuntimeError("bad weights"))
    balance, board, sibling, listener, _ = pair(engine=engine)
    assert not balance.may_accept()  # the sibling serves
    board.publish(sibling, UNAVAILABLE, 0)
    assert balance.may_accept()  # nobody else can: answer, so /readyz says why
    alone = Balance(None, Policy())
    alone._readiness = engine
    assert alone.may_accept()


def test_closing_stops_accepting_at_once() -> None:
    balance, _, _, listener, _ = pair()
    balance.close()
    assert listener.accepting is False and not balance.may_accept()


def test_old_workers_leave_one_per_ready_replacement_and_serve_meanwhile() -> None:
    """Two workers wanted, a reload: two old ones (slots 0 and 1) and two new ones (2 and 3)."""
    board = LoadBoard(slots=4)
    old = [Balance(Seat(board, board.claim()), Policy(), clock=Clock()) for _ in range(2)]
    for b in old:
        b._readiness = Engine()
        b.add_listener(Listener())
        b.hand_over()
    new = [board.claim(), board.claim()]  # loading: UNAVAILABLE
    assert all(b.may_accept() for b in old)  # they serve on, as any worker does
    assert not any(b.replaced(2) for b in old)
    board.publish(new[0], 5, 0)  # one replacement ready (and busy): the lower slot may go, the other stays
    assert old[0].replaced(2) and not old[1].replaced(2)
    old[0].close()  # it drains: no longer serving
    assert not old[1].replaced(2)
    board.publish(new[1], 0, 0)  # the second replacement is ready
    assert old[1].replaced(2)


def test_a_lone_old_worker_is_replaced_by_one_ready_worker() -> None:
    balance, board, sibling, _, _ = pair()
    balance.hand_over()
    board.publish(sibling, UNAVAILABLE, 0)
    assert not balance.replaced(1) and balance.may_accept()
    board.publish(sibling, 3, 0)
    assert balance.replaced(1)


def test_idle_connections_past_the_cap_are_hung_up_oldest_first() -> None:
    balance, _, _, _, clock = pair(Policy(max_idle=2))
    busy, kept, idle, new = Conn(), Conn(), Conn(), Conn()
    balance.accepted(busy)
    balance.request_started(busy)  # in a request: not idle, never hung up
    balance.accepted(kept)
    balance.request_started(kept)
    balance.request_done(kept)  # kept alive: idle again, the longest waiting
    clock.now += 1
    balance.accepted(idle)
    assert not any(c.hung_up for c in (busy, kept, idle))  # two idle: at the cap
    balance.accepted(new)
    assert kept.hung_up and not idle.hung_up and not new.hung_up and not busy.hung_up
    balance.closed(kept)  # its greenlet saw end-of-file and closed it
    assert balance.load() == 2  # idle and new are arriving


def test_a_worker_keeping_more_connections_than_a_sibling_sheds_one_after_its_response() -> None:
    balance, board, sibling, _, _ = pair()
    conns = [Conn() for _ in range(4)]
    for c in conns:
        balance.accepted(c)
        assert not balance.request_started(c)  # a connection's first request is never shed
        balance.request_done(c)
    board.publish(sibling, 0, 3)
    assert not balance.request_started(conns[0])  # 4 against 3: within the slack of 1 ...
    balance.request_done(conns[0])
    board.publish(sibling, 0, 0)  # ... a respawned sibling keeps none
    shed = [balance.request_started(c) for c in conns]
    assert shed == [True, True, True, False]  # down to 1 kept, one more than the sibling


def test_without_rebalancing_a_worker_keeping_more_connections_than_a_sibling_sheds_none() -> None:
    balance, board, sibling, _, _ = pair(Policy(rebalance=False))
    conns = [Conn() for _ in range(4)]
    for c in conns:
        balance.accepted(c)
        balance.request_started(c)
        balance.request_done(c)
    board.publish(sibling, 0, 0)  # a respawned sibling keeps none: 4 against 0
    assert [balance.request_started(c) for c in conns] == [False] * 4


def test_siblings_idle_is_the_engines_view_of_the_board() -> None:
    balance, board, sibling, _, _ = pair()
    assert balance.siblings_idle()
    board.publish(sibling, 2, 0)
    assert not balance.siblings_idle()
    board.release(sibling)
    assert balance.siblings_idle()
    assert not Balance(None, Policy()).siblings_idle()  # outside gunicorn nothing is known


def test_borrowing_pauses_for_a_while_after_two_workers_had_requests_at_once() -> None:
    balance, board, sibling, _, clock = pair()
    with balance.inference():  # alone: no overlap seen
        pass
    assert balance.siblings_idle()
    board.publish(sibling, 1, 0)
    with balance.inference():  # starts while the sibling has a request: the board remembers
        pass
    board.publish(sibling, 0, 0)
    assert not balance.siblings_idle()  # the sibling is idle now, but two clients are about
    clock.now += BORROW_QUIET_S - 0.1
    assert not balance.siblings_idle()
    clock.now += 0.2
    assert balance.siblings_idle()
    board.publish(sibling, UNAVAILABLE, 0)  # a loading sibling is no overlap, though it counts as busy
    with balance.inference():
        pass
    board.publish(sibling, 0, 0)
    assert balance.siblings_idle()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    s.sendall(b"x")
    return s


class HeldServer:
    """A GatedStreamServer on 127.0.0.1 whose handlers hold their connection until ``release`` is set."""

    def __init__(self, balance: Balance, pool_size: int) -> None:
        self.release = gevent.event.Event()
        self.handled: list[int] = []
        self.server = GatedStreamServer(("127.0.0.1", 0), handle=self._handle, spawn=gevent.pool.Pool(pool_size),
                                        balance=balance)
        self.server.start()
        self.clients: list[socket.socket] = []

    def _handle(self, sock: socket.socket, addr: object) -> None:
        self.handled.append(1)
        self.release.wait()
        sock.close()

    def connect(self, n: int = 1) -> None:
        self.clients += [_connect(self.server.server_port) for _ in range(n)]

    def close(self) -> None:
        self.release.set()
        for c in self.clients:
            c.close()
        self.server.stop()


def test_a_server_reopened_while_its_pool_is_full_accepts_again_when_a_slot_frees() -> None:
    """The wedge: gevent re-arms a full pool's accept with a one-shot link. If the gate was closed when it
    fired and reopened while the pool was still full, nothing started accepting again."""
    balance, _, _, _, _ = pair(Policy(accept_gate=False, max_idle=10))
    held = HeldServer(balance, 2)
    try:
        held.connect(3)
        gevent.sleep(0.2)
        assert len(held.handled) == 2  # the pool is full; the third waits in the backlog
        held.server.set_accepting(False)  # the gate closes ...
        held.release.set()
        gevent.sleep(0.05)  # ... the slots free while it is closed: gevent's one-shot link is spent
        held.release.clear()
        assert len(held.handled) == 2
        held.server.set_accepting(True)
        gevent.sleep(0.2)
        assert len(held.handled) == 3, "the reopened server never accepted the waiting connection"
        held.server.set_accepting(False)
        held.server.set_accepting(True)  # reopened again: idempotent
        held.connect()
        gevent.sleep(0.2)
        assert len(held.handled) == 4
    finally:
        held.close()
        balance.stop()


def test_a_server_reopened_while_its_pool_is_still_full_accepts_once_a_slot_frees() -> None:
    balance = Balance(None, Policy(accept_gate=False))
    balance._readiness = Engine()
    held = HeldServer(balance, 1)
    try:
        held.connect(2)
        gevent.sleep(0.2)
        assert len(held.handled) == 1  # full
        held.server.set_accepting(False)
        held.server.set_accepting(True)  # reopened while full: no accept yet, but a wake-up is linked
        gevent.sleep(0.05)
        assert len(held.handled) == 1
        held.release.set()
        gevent.sleep(0.2)
        assert len(held.handled) == 2
    finally:
        held.close()


def test_a_doorbell_never_waits_to_ring_and_takes_every_waiting_ring_at_once() -> None:
    a, b = Doorbell("test-bell", 0), Doorbell("test-bell", 1)
    try:
        def ring_many() -> bool:
            for _ in range(5000):  # far more than its queue holds: a full doorbell is skipped, not waited for
                a.ring([1, 2])  # slot 2 has no doorbell: skipped too
            return True

        assert gevent.with_timeout(2.0, ring_many, timeout_value=False), "a full doorbell was waited for"
        assert gevent.with_timeout(1.0, b.wait) is True
        assert gevent.with_timeout(0.1, b.wait, timeout_value="nothing more") == "nothing more"
    finally:
        a.close()
        b.close()
