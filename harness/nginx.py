"""A real nginx running the shipped config (``harness.deploy.render``), and a fleet of two greenserve
instances behind it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from harness.deploy import render
from harness.launch import GunicornServer, free_port


def nginx_binary() -> str | None:
    """nginx on PATH, or where Debian puts it (/usr/sbin is not on every user's PATH)."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")


def nginx_command(main: Path) -> list[str]:
    binary = nginx_binary()
    assert binary is not None
    return [binary, "-p", str(main.parent), "-e", str(main.parent / "logs" / "error.log"), "-c", str(main)]


class Nginx:
    """nginx in the foreground (``daemon off``) with its prefix, pid, logs and temp files in ``prefix``."""

    def __init__(self, prefix: Path, upstreams: list[int]) -> None:
        self.port = free_port()
        self.prefix = prefix
        self.conf = render(prefix, listen=f"127.0.0.1:{self.port}", upstreams=upstreams)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Nginx:
        self.proc = subprocess.Popen([*nginx_command(self.conf), "-g", "daemon off;"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"nginx exited with {self.proc.returncode}:\n{self.log('error.log')}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nginx not listening after 10 s:\n{self.log('error.log')}")

    def log(self, name: str = "greenserve.access.log") -> str:
        path = self.prefix / "logs" / name
        return path.read_text(errors="replace") if path.exists() else ""

    def access_line(self, needle: str) -> str:
        """The one access-log line containing ``needle`` (nginx writes it just after the answer has gone)."""
        deadline = time.monotonic() + 5
        while not (lines := [line for line in self.log().splitlines() if needle in line]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(lines) == 1, (needle, lines)
        return lines[0]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Fleet:
    """Two one-worker greenserve instances on fixed ports behind one nginx; ``ensure_up`` restarts a dead one."""

    def __init__(self, env: dict[str, str], prefix: Path) -> None:
        self.env = env
        self.ports = [free_port(), free_port()]
        self.instances: list[GunicornServer | None] = [None, None]
        self.nginx = Nginx(prefix, self.ports)

    def ensure_up(self) -> None:
        dead = [i for i, srv in enumerate(self.instances) if srv is None or srv.proc.poll() is not None]
        with ThreadPoolExecutor(2) as pool:  # the two model loads overlap
            started = pool.map(lambda i: GunicornServer(self.env, workers=1, port=self.ports[i]).start(), dead)
            for i, srv in zip(dead, started, strict=True):
                self.instances[i] = srv

    def instance(self, i: int) -> GunicornServer:
        srv = self.instances[i]
        assert srv is not None
        return srv

    def logs(self, needle: str = "") -> str:
        """Both instances' logs, once ``needle`` is in them (gunicorn logs a request just after its answer)."""
        deadline = time.monotonic() + 5
        while True:
            text = "".join(srv.log() for srv in self.instances if srv is not None)
            if needle in text or time.monotonic() > deadline:
                return text
            time.sleep(0.05)

    @contextmanager
    def running(self) -> Iterator[Fleet]:
        """Both instances and nginx up for the block, everything stopped after it."""
        try:
            self.ensure_up()
            self.nginx.start()
            yield self
        finally:
            self.stop()

    def stop(self) -> None:
        self.nginx.stop()
        for srv in self.instances:
            if srv is not None:
                srv.stop()
