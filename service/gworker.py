"""gunicorn's gevent worker with an accept gate (``worker_class = "service.gworker.GreenserveWorker"``).

A gevent worker's hub stays free while its model is busy, so it keeps accepting connections and takes
its share of new requests even when a sibling worker sits idle. The gate lets the runner pause
accepting while a sibling has less load (requests in flight plus connections accepted whose first
request has not started); the kernel then hands new connections to the sibling. Everything else is
gunicorn's ``GeventWorker``.
"""

from __future__ import annotations

from typing import Any

from gevent.server import StreamServer
from gunicorn.workers import ggevent

from service import worker


class GatedStreamServer(StreamServer):
    """A StreamServer whose accepting can be paused from outside without being resumed by its pool."""

    _gate_open = True

    def pause_accepting(self) -> None:
        self._gate_open = False
        self.stop_accepting()

    def resume_accepting(self) -> None:
        if not self._gate_open:
            self._gate_open = True
            if self.started and not self.closed and (self.pool is None or not self.pool.full()):
                super().start_accepting()

    def start_accepting(self) -> None:
        # gevent calls this whenever a connection slot frees up; respect a closed gate
        if self._gate_open:
            super().start_accepting()

    def start(self) -> None:
        super().start()
        worker.register_listener(self)

    def do_read(self) -> Any:
        if not worker.gate_allows():  # it paused this server: the connection waits for a sibling
            return None
        accepted = super().do_read()
        if accepted:
            worker.connection_arrived(accepted[0])  # counted before the next accept can happen
        return accepted


class GreenserveWorker(ggevent.GeventWorker):
    def run(self) -> Any:
        # GeventWorker.run builds its servers from the module's StreamServer name
        ggevent.StreamServer = GatedStreamServer
        return super().run()

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        try:
            super().handle(listener, client, addr)
        finally:
            worker.connection_settled(client)

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> None:
        worker.connection_settled(sock)  # from here the request itself is counted (Runner.request)
        super().handle_request(listener_name, req, sock, addr)
