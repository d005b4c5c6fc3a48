"""A real ``redis-server`` on 127.0.0.1 (Debian's: ``make test`` installs it as root with apt-get), for the tests of
a fleet's shared cache and its shared precision choice."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from harness.launch import free_port


def redis_binary() -> str | None:
    """redis-server on PATH, or where Debian puts it."""
    return shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)


class RedisServer:
    """``redis-server`` on 127.0.0.1 with no persistence and a memory cap evicting least recently used keys."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = redis_binary() or "/usr/bin/redis-server"
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy",
                                      "allkeys-lru"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise TimeoutError("redis-server did not answer in 10 s")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
