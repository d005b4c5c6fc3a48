"""The systemd unit, tested without systemd as PID 1: static verify, then its own ExecStart line with its
environment, speaking the notify protocol to a socket we bind (READY=1, then STOPPING=1 on SIGTERM)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from harness.deploy import INSTALL_DIR, UNIT, directives
from harness.imagehost import ImageHost
from harness.launch import ROOT, free_port
from harness.servers import e2e_env


def rendered_unit(tmp_path: Path) -> Path:
    """The unit with its install path pointed at this checkout (so ExecStart's binary exists)."""
    out = tmp_path / "greenserve.service"
    out.write_text(UNIT.read_text().replace(INSTALL_DIR, str(ROOT)))
    return out


def test_unit_has_the_deployment_contract() -> None:
    d = directives(UNIT)
    assert d["Type"] == ["notify"] and d["KillMode"] == ["mixed"]
    assert "HUP" in d["ExecReload"][0]
    assert d["User"] != ["root"]
    assert any(e.startswith("-/etc/greenserve/") for e in d["EnvironmentFile"])
    assert "MemoryDenyWriteExecute" not in d
    graceful = int(os.environ.get("GREENSERVE_GRACEFUL_TIMEOUT_S", "30"))
    assert int(d["TimeoutStopSec"][0]) > graceful


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_passes(tmp_path: Path) -> None:
    r = subprocess.run(["systemd-analyze", "verify", str(rendered_unit(tmp_path))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "greenserve.service" not in r.stderr, r.stderr


@pytest.mark.e2e
def test_execstart_notifies_ready_then_stopping(tmp_path: Path, weights_file: Path, image_host: ImageHost) -> None:
    unit = directives(rendered_unit(tmp_path))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GREENSERVE_", "NOTIFY_SOCKET"))}
    for assignment in unit.get("Environment", []):
        key, _, value = assignment.partition("=")
        env[key] = value
    env["TORCH_HOME"] = str(tmp_path / "torch")  # the unit's state dir does not exist here
    env_file = Path(unit["EnvironmentFile"][0].lstrip("-"))
    assert not env_file.exists() or env_file.is_file()
    port = free_port()
    env.update(e2e_env(weights_file, image_host, GREENSERVE_BIND=f"127.0.0.1:{port}", GREENSERVE_WORKERS="1"))
    sock_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(sock_path))
        notify.settimeout(60)
        env["NOTIFY_SOCKET"] = str(sock_path)
        cmd = shlex.split(unit["ExecStart"][0])
        proc = subprocess.Popen(cmd, cwd=unit["WorkingDirectory"][0], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            assert b"READY=1" in notify.recv(4096)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # READY=1 comes before the model: /readyz tells when to route
                try:
                    if requests.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                        break
                except (requests.ConnectionError, requests.Timeout):  # worker still importing torch
                    pass
                time.sleep(0.2)
            else:
                pytest.fail("never ready")
            proc.send_signal(signal.SIGTERM)
            messages = b""
            while b"STOPPING=1" not in messages:
                messages += notify.recv(4096)
            assert proc.wait(45) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize(("given", "expected"), [(None, "30000"), ("300000", "300000")])
def test_config_caps_openmp_spinning_unless_the_operator_set_it(given: str | None, expected: str) -> None:
    """gunicorn.conf.py runs in the master before fork: workers' libgomp reads GOMP_SPINCOUNT from it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GREENSERVE_") and k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    code = "import os, runpy; runpy.run_path('gunicorn.conf.py'); print(os.environ['GOMP_SPINCOUNT'])"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected
