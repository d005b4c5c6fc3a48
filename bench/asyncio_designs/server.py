"""Start and stop ``uvicorn`` serving one asyncio design on 127.0.0.1 (the twin of ``harness.launch``)."""

from __future__ import annotations

import os
import sys

from bench.asyncio_designs.app import READY_LINE, AppConfig
from harness.launch import ServerProcess, free_port


class UvicornServer(ServerProcess):
    """``with UvicornServer(config, workers=1) as srv: srv.url`` — ready once every process's model is warm.

    ``workers`` > 1 uses uvicorn's own multi-process mode (``--workers``): one listening socket shared by
    spawned processes, each building the app (and loading the model) itself.
    """

    ready_line = READY_LINE
    kind = "asyncio"

    def __init__(self, config: AppConfig, *, workers: int = 1, port: int | None = None,
                 ready_timeout_s: float = 120.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BENCH_ASYNCIO_", "GREENSERVE_"))}
        env.update({"PYTHONUNBUFFERED": "1", **config.to_env()})
        super().__init__(env, workers=workers, port=port or free_port(), ready_timeout_s=ready_timeout_s)
        self.config = config

    def command(self) -> list[str]:
        # --no-access-log: gunicorn's access log is on for greenserve, but it costs the loop per request;
        # leaving it out only flatters the asyncio designs.
        return [sys.executable, "-m", "uvicorn", "--factory", "bench.asyncio_designs.app:create_app",
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", "--no-access-log",
                "--workers", str(self.workers)]

    def __enter__(self) -> UvicornServer:
        self.start()
        return self
