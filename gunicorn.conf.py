"""gunicorn settings for greenserve. Values come from GREENSERVE_* variables (see the README table).

Never import torch here: this file runs in the master, and torch state does not survive fork.
"""

from gunicorn import systemd

from service.settings import Settings
from service import worker as _worker

_settings = Settings.from_env()  # bad values stop the master at start-up, naming the variable

bind = _settings.bind
workers = _settings.workers
# gevent: greenlets do the I/O; each worker runs its model in one native thread of its own.
worker_class = "gevent"
# Cap concurrent connections per worker so a worker with a saturated model cannot hoard clients.
worker_connections = 1000
# Load the app (and so the model) in each worker after fork: libgomp/CUDA are not fork-safe.
preload_app = False
# The hub stays responsive while inference runs in a thread, so this only fires on a real hang.
timeout = _settings.worker_timeout_s
# In-flight requests get this long to finish on SIGTERM/HUP before workers are killed.
graceful_timeout = _settings.graceful_timeout_s
keepalive = 5
# Access log to stdout with the request id greenserve echoes, so a log line can be matched to a reply.
accesslog = "-"
access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(M)sms rid=%({x-request-id}o)s pid=%(p)s'
errorlog = "-"
loglevel = _settings.log_level
proc_name = "greenserve"
# No gunicornc control socket: it is not used, and two instances on one host would fight over its path.
control_socket_disable = True


def on_exit(server):
    """Tell systemd (Type=notify) we are going down; gunicorn itself only sends READY=1."""
    systemd.sd_notify("STOPPING=1", server.log)


def post_fork(server, worker):
    """Record which worker this is (spreads workers over GPUs); no torch, no threads yet."""
    _worker.set_ordinal(worker.age - 1)
