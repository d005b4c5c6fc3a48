"""Start and stop ``uvicorn`` serving one asyncio design on 127.0.0.1 (the twin of ``bench.launch``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.asyncio_designs.app import READY_LINE, AppConfig
from bench.launch import ROOT, free_port


class UvicornServer:
    """``with UvicornServer(config, workers=1) as srv: srv.url`` — ready once every process's model is warm.

    ``workers`` > 1 uses uvicorn's own multi-process mode (``--workers``): one listening socket shared by
    spawned processes, each building the app (and loading the model) itself.
    """

    def __init__(self, config: AppConfig, *, workers: int = 1, port: int | None = None,
                 ready_timeout_s: float = 120.0) -> None:
        self.config = config
        self.workers = workers
        self.port = port or free_port()
        self.ready_timeout_s = ready_timeout_s
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("BENCH_ASYNCIO_", "GREENSERVE_"))}
        self.env.update({"PYTHONUNBUFFERED": "1", **config.to_env()})
        fd, path = tempfile.mkstemp(prefix=f"asyncio-{config.design}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> UvicornServer:
        # --no-access-log: gunicorn's access log is on for greenserve, but it costs the loop per request;
        # leaving it out only flatters the asyncio designs.
        cmd = [sys.executable, "-m", "uvicorn", "--factory", "bench.asyncio_designs.app:create_app",
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", "--no-access-log",
               "--workers", str(self.workers)]
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {self.proc.returncode}:\n{self.log()}")
            if self.log().count(READY_LINE) >= self.workers:
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"uvicorn not ready after {self.ready_timeout_s}s:\n{self.log()}")

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

    def __enter__(self) -> UvicornServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
