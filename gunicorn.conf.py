"""gunicorn settings for greenserve. Values come from GREENSERVE_* variables (see the README table).

This file runs in the master. It imports the model's libraries before forking (``service.preimport``) but
never runs torch (nor creates metric objects): threads and devices do not survive fork. The hooks prepare
what workers share: the metrics directory and the load board (``service.balance``), on which each worker
gets a seat.
"""

import os
import shutil
import tempfile
import time

from gunicorn import systemd
from gunicorn.errors import HaltServer

from service import catalog, logs
from service.balance.board import SLOTS, LoadBoard, Seat
from service.balance.memo import SharedMemo
from service.balance.repository import SharedRepository
from service.engine.model_set import model_set
from service.preimport import preimport
from service.settings import Settings, SettingsError

try:
    _settings = Settings.from_env()
except SettingsError as exc:  # a bad value stops the master in one line naming the variable, not a traceback
    raise SystemExit(f"greenserve: {exc}") from None

# torch's OpenMP runtime (libgomp) keeps each of its threads spinning on a core for ~300,000 rounds after
# every parallel region before it sleeps: 5-6 ms after each forward, measured on this project's 2-core
# host, taken from the hub that must send the answer and from the next request's decode. 30,000 rounds
# keep the forward as fast (the threads still spin between layers) and free the core within ~0.5 ms;
# 1-image requests came back 4-6 ms sooner. Set in the master, so each worker's libgomp reads it when
# torch loads after fork. An operator's own GOMP_SPINCOUNT wins.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

bind = _settings.bind
workers = _settings.workers
# gevent greenlets do the I/O; each worker runs its model in one native thread. This subclass of
# gunicorn's gevent worker accepts only while its model is ready and, with the accept gate, while no sibling
# has less load; it caps idle connections and rebalances kept-alive ones (service/balance).
worker_class = "service.balance.gunicorn_worker.GreenserveWorker"
# Idle connections cost a greenlet each and are capped below this (GREENSERVE_MAX_IDLE_CONNECTIONS), so a
# flood of them cannot fill the worker; admission control answers 503 long before it is full of requests.
worker_connections = _settings.worker_connections
# Load the app (and so the model) in each worker after fork: libgomp/CUDA are not fork-safe.
preload_app = False
# The hub stays responsive while inference runs in a thread, so this only fires on a real hang.
timeout = _settings.worker_timeout_s
# In-flight requests get this long to finish on SIGTERM/HUP before workers are killed.
graceful_timeout = _settings.graceful_timeout_s
# Also bounds how long a request's line and headers may take (gunicorn times the read of each request).
keepalive = _settings.keepalive_s
# Access log to stdout with the request id greenserve echoes, so a log line can be matched to a reply.
accesslog = "-"
access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(M)sms rid=%({x-request-id}o)s pid=%(p)s'
errorlog = "-"
loglevel = _settings.log_level
# GREENSERVE_LOG_FORMAT=json: one JSON object per line; the app writes richer access lines itself
logconfig_dict = logs.gunicorn_logconfig(_settings.log_level, _settings.log_format) or {}
if logconfig_dict:
    accesslog = None
proc_name = "greenserve"
# No gunicornc control socket: it is not used, and two instances on one host would fight over its path.
control_socket_disable = True


def on_starting(server):
    """Before any fork and before the port is bound: the model's libraries imported, and GREENSERVE_MODEL
    checked against its family's list (a typo stops here in one line, not after every worker's load); a fresh
    prometheus multiprocess directory, the shared load board and the memo of measured choices that
    replacements after a HUP or a respawn read (``service.balance.memo``). A stop clears the board's reload
    stamp before the master signals its workers: stopped within a reload's graceful timeout, they must drain
    at once, not wait to hand over to replacements that will never come. gunicorn has no hook before it
    signals, hence the wrapper."""
    # after GOMP_SPINCOUNT is set above: libgomp reads it when torch loads
    took = sum(preimport(spec.model) for spec in model_set(_settings))
    server.log.info("imported the models' libraries in %.1fs, once for every worker", took)
    try:
        for spec in model_set(_settings):  # every served model's name, before any worker loads one
            catalog.check(spec.model)
    except SettingsError as exc:
        raise SystemExit(f"greenserve: {exc}") from None
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="greenserve-metrics-")
    server.greenserve_board = board = LoadBoard()
    server.greenserve_memo = SharedMemo()
    server.greenserve_repository = SharedRepository(SLOTS)  # which models the workers serve (the repository API)
    stop = server.stop

    def stopping(graceful=True):
        board.mark_reload(float("-inf"))
        while True:
            try:
                return stop(graceful)
            except HaltServer:
                # two workers that failed to boot at once: gunicorn's stop reaps the second and raises again
                # mid-way (the server then exited 1 with a traceback); each raise has removed its worker
                continue

    server.stop = stopping


def on_reload(server):
    """HUP: the workers about to be stopped hand over to their replacements (``gunicorn_worker``) rather than
    stop accepting before any replacement can serve."""
    server.greenserve_board.mark_reload(time.monotonic())


def pre_fork(server, worker):
    """Give the worker-to-be a seat on the load board (its slot is also its ordinal for GPU spreading)."""
    worker.greenserve_seat = Seat(server.greenserve_board, server.greenserve_board.claim(), server.greenserve_memo,
                                  server.greenserve_repository)


def child_exit(server, worker):
    """A worker died or retired: free its seat and drop its live metrics."""
    worker.greenserve_seat.release()
    from prometheus_client import multiprocess  # no metric objects: safe in the master

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    """Tell systemd (Type=notify) we are going down; gunicorn itself only sends READY=1."""
    systemd.sd_notify("STOPPING=1", server.log)
    shutil.rmtree(os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""), ignore_errors=True)
