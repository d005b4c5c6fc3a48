"""gunicorn's gevent worker with greenserve's balancing (``worker_class`` in ``gunicorn.conf.py``).

Everything is gunicorn's ``GeventWorker`` except that the worker builds its ``Balance`` from the ``Seat``
the master gave it, its listeners accept only while the balance says so, every connection and request is
reported to the balance, and a shutdown signal stops accepting at once (gunicorn's loop notices it up to
a second later, and served fresh connections meanwhile).

A reload (HUP) hands over: the master's SIGTERM to an old worker leaves it serving until a replacement of
its own is ready (the old ones leave one per ready new one, ``Balance.replaced``), and only then does it
stop accepting and drain. A stop (SIGTERM to the master) still stops accepting at once.

A master that dies (``kill -9``) is a graceful stop too: the kernel sends the worker SIGTERM at once
(``PR_SET_PDEATHSIG``), and where gunicorn's gevent worker would ``sys.exit`` at its next heartbeat and cut
every request in flight, this one stops accepting, finishes what it holds within the graceful timeout and
exits.

A model that cannot load for good (an unknown name, missing weights: ``Runner.fatal_error``) ends the server
while no sibling serves: the worker exits with gunicorn's boot-error status, and the master stops every worker
and exits with it. The worker's one log line above says what to change.

However it stops, the worker ends the model's native threads before the interpreter finalizes (a stop
during the model's load used to abort every worker: ``Runner.close`` says why).

A client that does not read its answers is bounded: the kernel keeps at most ``SEND_LOWAT`` of a connection's
answer unsent, so the rest waits in the worker, where the answer's send bound (the request's deadline,
``service/http/connection.py``) ends the write; the worker then closes the connection, and the requests the
client pipelined behind are never run.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import gevent
from gevent.server import StreamServer
from gunicorn.arbiter import Arbiter
from gunicorn.workers import ggevent
from gunicorn.workers.base import Worker

from service.balance.board import Seat
from service.balance.gate import Balance, Policy
from service.balance.priority import BootPriority
from service.settings import Settings

_current: Balance | None = None
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What the kernel keeps of a connection's answer not yet sent (TCP_NOTSENT_LOWAT): past it a write waits in
# the worker, under the answer's send bound. Without it the kernel held 4.2 MB of answers for a client that read
# nothing (tests/e2e/test_e2e_streaming.py); 128 KiB still keeps a fast link busy (bytes in flight do not count).
SEND_LOWAT = 128 << 10
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # linux/tcp.h
# At exit, how long a model load or forward still running may take before the worker exits without
# finalizing. Nobody waits for its result by then; this only lets the interpreter finish cleanly.
ENGINE_STOP_S = 2.0


def worker_balance() -> Balance | None:
    """The balance of the gunicorn worker this process is (None outside one): for ``wsgi.py``."""
    return _current


class GatedStreamServer(StreamServer):  # type: ignore[misc]  # gevent has no type information
    """A StreamServer whose accepting follows its ``Balance`` (level-triggered, see ``set_accepting``)."""

    def __init__(self, *args: Any, balance: Balance, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._balance = balance
        self._open = False

    def set_accepting(self, accepting: bool) -> None:
        """Open or close; safe to call at any time and as often as wanted."""
        self._open = accepting
        if not accepting:
            super().stop_accepting()
        elif self.started and not self.closed:
            if self.full():
                # gevent re-arms accepting through a one-shot link when a pool slot frees; make sure
                # one is there (unlink first: at most one)
                self.pool._semaphore.unlink(self._start_accepting_if_started)
                self.pool._semaphore.rawlink(self._start_accepting_if_started)
            else:
                super().start_accepting()

    def start_accepting(self) -> None:
        # gevent calls this when a pool slot frees or after an accept error's back-off
        if self._open:
            super().start_accepting()

    def start(self) -> None:
        super().start()
        self._balance.add_listener(self)

    def do_read(self) -> Any:
        if not self._balance.may_accept():  # closed now: the connection waits in the kernel for a sibling
            return None
        accepted = super().do_read()
        if accepted:
            self._balance.accepted(accepted[0])  # counted before the next accept can happen
        return accepted


class GreenserveWorker(ggevent.GeventWorker):  # type: ignore[misc]  # nor gunicorn
    greenserve_seat: Seat | None = None  # set by gunicorn.conf.py's pre_fork hook
    alive: bool  # gunicorn's: the run loop goes on while it holds

    def init_process(self) -> None:
        global _current
        seat = self.greenserve_seat
        boot = BootPriority()
        if seat is not None and seat.board.any_serving(seat.slot):
            # a replacement (HUP, respawn): its siblings serve on these cores while it loads (``priority``)
            boot.lower()
        self.balance = _current = Balance(seat, Policy.from_settings(Settings.from_env()), boot=boot)
        _term_when_parent_dies()
        super().init_process()

    def notify(self) -> None:
        Worker.notify(self)  # the heartbeat; not GeventWorker's, which exits at once when the master is gone
        if self.alive and self.ppid != os.getppid():
            self.log.warning("the master (pid %s) is gone: this worker stops accepting, finishes the requests it "
                             "holds and exits", self.ppid)
            self.stop_listening()
            self.alive = False
        if self.balance.fatal_error() is not None:  # nothing to finish: no model ever served here
            self.stop_listening()
            self._exit_now("worker %s cannot load its model (above) and no sibling serves: the server stops",
                           self.pid, status=Arbiter.WORKER_BOOT_ERROR)

    def run(self) -> None:
        # GeventWorker.run builds its servers from the module's StreamServer name
        self.listeners: list[GatedStreamServer] = []

        def listener(*args: Any, **kwargs: Any) -> GatedStreamServer:
            server = GatedStreamServer(*args, balance=self.balance, **kwargs)
            self.listeners.append(server)
            return server

        ggevent.StreamServer = listener
        try:
            super().run()
        except SystemExit as stop:  # SIGINT
            if stop.code not in (None, 0):
                raise
        finally:  # drained, stopped by a signal, or the master gone
            self._end_engine()
        # Stopped cleanly: every request is answered and the cache written. Finalizing the interpreter
        # would only collect torch's heap, seconds of CPU taken from the workers that serve on right after a
        # HUP (docs/SCHEDULING.md#hand-over). gunicorn's own worker_exit hook is not run: this project's
        # config has none.
        self._exit_now("Worker exiting (pid: %s)", self.pid)

    def _end_engine(self) -> None:
        """End the model's threads before the interpreter finalizes; if a model load or forward (a gone
        client's, say) is still running after ``ENGINE_STOP_S``, exit without finalizing, which would abort
        the process (``Runner.close`` says why)."""
        if not self.balance.close_engine(ENGINE_STOP_S):
            self._exit_now("worker %s exits with the model still busy (a load or a forward nobody waits for)",
                           self.pid)

    def _exit_now(self, message: str, *args: Any, status: int = 0) -> None:
        """Log, flush the logs and exit with ``status`` without finalizing the interpreter."""
        self.log.info(message, *args)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(status)

    def stop_listening(self) -> None:
        """Accept nothing more, at once: the gate shut and this worker's listening sockets closed (once every
        process holding the port has closed it, the kernel refuses new connections instead of queueing them)."""
        self.balance.close()
        for server in getattr(self, "listeners", ()):
            gevent.spawn(server.close)  # from a signal handler too: closed on the hub's next turn

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        try:
            if client.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(OSError):  # a kernel without it (before Linux 3.12): the write bound alone
                    client.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, SEND_LOWAT)
            super().handle(listener, client, addr)
        finally:
            self.balance.closed(client)

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> None:
        if self.balance.request_started(sock):
            req.must_close = True  # gunicorn answers "Connection: close" and closes after the response
        try:
            super().handle_request(listener_name, req, sock, addr)
        except TimeoutError:  # a write of the answer passed its send bound: the client is not reading
            self.log.info("closed a connection whose client read too little of its answer within the request's "
                          "deadline (%s); requests it pipelined behind are not run", addr)
            raise StopIteration() from None  # gunicorn's loop ends the connection and closes the socket
        finally:
            self.balance.request_done(sock)

    def handle_quit(self, sig: Any, frame: Any) -> None:
        self.balance.close()
        super().handle_quit(sig, frame)

    def handle_exit(self, sig: Any, frame: Any) -> None:
        if self._reloading() and not getattr(self, "_handing_over", False):
            self._handing_over = True
            gevent.spawn(self._hand_over)  # from the signal handler: the greenlet runs on the hub's next turn
            return
        self.stop_listening()
        super().handle_exit(sig, frame)

    def _reloading(self) -> bool:
        """This SIGTERM is the master's, stopping the old workers of a reload it has just begun."""
        seat = self.greenserve_seat
        return (seat is not None and self.ppid == os.getppid()
                and time.monotonic() - seat.board.reload_at() < self.cfg.graceful_timeout)

    def _hand_over(self) -> None:
        """Serve on until a replacement of its own serves, then stop as on any SIGTERM, so no request
        waits for a new worker's model load (docs/SCHEDULING.md#hand-over). Bounded by the graceful timeout,
        and by the master's death."""
        self.log.info("reload: worker %s serves until a replacement is ready", self.pid)
        self.balance.hand_over()
        until = time.monotonic() + self.cfg.graceful_timeout
        while not self.balance.replaced(self.cfg.workers) and time.monotonic() < until and self.ppid == os.getppid():
            gevent.sleep(0.05)
        self.stop_listening()
        self.alive = False


def _term_when_parent_dies() -> None:
    """SIGTERM to this process the moment its parent (the master) dies; Linux only, elsewhere the heartbeat
    (``notify``) notices within a second."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
