"""Start and stop a real ``gunicorn -k gevent`` greenserve on 127.0.0.1 (used by e2e tests and benchmarks)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
READY_LINE = "model ready:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on 127.0.0.1, ready once its log shows ``ready_line`` for every worker.

    Subclasses give ``command()``; ``env`` is the child's whole environment.
    """

    ready_line = READY_LINE
    kind = "server"

    def __init__(self, env: dict[str, str], *, workers: int, port: int, ready_timeout_s: float,
                 cwd: Path = ROOT) -> None:
        self.env = env
        self.cwd = cwd
        self.workers = workers
        self.models = 1  # "model ready" lines a worker logs (one per model it serves)
        self.port = port
        self.ready_timeout_s = ready_timeout_s
        fd, log_path = tempfile.mkstemp(prefix=f"{self.kind}-", suffix=".log")
        os.close(fd)  # only the path is needed: start() reopens it for the child
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self) -> ServerProcess:
        """Start the process and return at once (``start`` waits until it is ready)."""
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self.command(), cwd=self.cwd, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)
        return self

    def start(self) -> ServerProcess:
        self.spawn()
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}:\n{self.log()}")
            if self.log().count(self.ready_line) >= self.workers * self.models:
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.kind} not ready after {self.ready_timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GunicornServer(ServerProcess):
    """``with GunicornServer({"GREENSERVE_MODEL": "resnet18"}, workers=2) as srv: srv.url``."""

    kind = "greenserve"

    def __init__(self, env: dict[str, str], *, workers: int = 2, port: int | None = None, cache: str = "fresh",
                 ready_timeout_s: float = 120.0, extra_args: list[str] | None = None, cwd: Path = ROOT) -> None:
        """``cwd``: the checkout whose greenserve runs (another one's, to measure an earlier commit).
        ``cache``: "fresh" runs the default embedding cache in a directory of this server's own (removed
        when it stops), so no test finds another's entries; "off" turns it off (benchmarks that repeat an
        album measure the model, not the cache), where the checkout has one. ``env`` wins over both."""
        port = port or free_port()
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("GREENSERVE_")}
        self.cache_dir: str | None = None
        if cache == "fresh" and "GREENSERVE_CACHE_DIR" not in env:
            self.cache_dir = tempfile.mkdtemp(prefix="greenserve-cache-")
            child_env["GREENSERVE_CACHE_DIR"] = self.cache_dir
        elif cache == "off" and (cwd / "service" / "cache").is_dir():
            child_env["GREENSERVE_CACHE"] = "off"
        child_env.update({"GREENSERVE_BIND": f"127.0.0.1:{port}", "GREENSERVE_WORKERS": str(workers),
                          "PYTHONUNBUFFERED": "1", **env})
        super().__init__(child_env, workers=workers, port=port, ready_timeout_s=ready_timeout_s, cwd=cwd)
        # each worker says "model ready" once per model it serves (GREENSERVE_MODELS: name=model, ...)
        self.models = max(1, len([m for m in child_env.get("GREENSERVE_MODELS", "").split(",") if m.strip()]))
        self.extra_args = extra_args or []

    def command(self) -> list[str]:
        return [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", *self.extra_args, "wsgi:app"]

    def __enter__(self) -> GunicornServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self.cache_dir:
            shutil.rmtree(self.cache_dir, ignore_errors=True)

    def boot(self, within_s: float = 30.0) -> GunicornServer:
        """Start, and return once every worker has forked: each is then importing the app and loading its
        model (a stop now lands during the load)."""
        self.spawn()
        deadline = time.monotonic() + within_s
        while self.log().count("Booting worker") < self.workers and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def worker_pids(self) -> set[int]:
        """PIDs of the master's live children (the workers)."""
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return {int(p) for p in out.stdout.split()}

    def healthz_pids(self, tries: int = 40, within_s: float = 10.0) -> set[int]:
        """PIDs that answer /healthz over fresh connections: at least ``tries`` probes, and more until every
        worker has answered or ``within_s`` has passed (a worker still finishing an earlier test's request
        defers to its idle sibling, so a burst of probes can all land on one)."""
        pids: set[int] = set()
        deadline = time.monotonic() + within_s
        workers = self.worker_pids()
        n = 0
        while n < tries or pids != workers and time.monotonic() < deadline:
            pids.add(requests.get(self.url + "/healthz", timeout=5).json()["pid"])
            n += 1
            if n >= tries and pids != workers:
                time.sleep(0.05)
        return pids
