"""A start on real gunicorn -k gevent, as a newcomer meets it: a setting no retry can fix (a typo in the model's
name, weights not on the machine) stops the whole server in one line that says what to do, and while the model
loads the probes answer at once (they used to wait in the kernel's queue for the load: 5-second timeouts, then
200 at 37.9 s)."""

from __future__ import annotations

import http.client
import re
import subprocess
import time
from pathlib import Path

import pytest

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import CLIP_ARCH, e2e_env

pytestmark = pytest.mark.e2e

EXIT_WITHIN_S = 30.0
PROBE_EVERY_S = 0.05
ANSWER_WITHIN_S = 0.1


def exits(srv: GunicornServer, within_s: float = EXIT_WITHIN_S) -> tuple[int, float]:
    """Spawn ``srv`` and wait for its master to exit by itself: (its status, seconds it took)."""
    started = time.monotonic()
    srv.spawn()
    assert srv.proc is not None
    try:
        status = srv.proc.wait(within_s)
    except subprocess.TimeoutExpired:
        srv.stop()
        pytest.fail(f"still running {within_s:.0f}s after its start:\n{srv.log()[-3000:]}")
    return status, time.monotonic() - started


@pytest.mark.parametrize(("setting", "said"), [
    ({"GREENSERVE_MODEL": "resnet500"}, "GREENSERVE_MODEL='resnet500' is not one of the"),
    ({"GREENSERVE_WEIGHTS": "/nonexistent/resnet18.pt"}, "GREENSERVE_WEIGHTS='/nonexistent/resnet18.pt' is neither"),
], ids=["model-name-typo", "weights-file-missing"])
def test_a_setting_the_master_can_check_stops_it_before_any_worker_in_one_line(
        image_host: ImageHost, weights_file: Path, setting: dict[str, str], said: str) -> None:
    """A model name is checked against its family's list (``service.catalog``) once the master has imported
    the family, before it binds the port or forks."""
    srv = GunicornServer(e2e_env(weights_file, image_host, **setting))
    status, took = exits(srv)
    log = srv.log()
    print(f"\nexit {status} after {took:.1f}s: {log.splitlines()[-1]}")
    assert status != 0
    [line] = [ln for ln in log.splitlines() if said in ln]
    assert line.startswith("greenserve: ")
    assert "Traceback" not in log and "Booting worker" not in log
    if "resnet500" in said:
        assert "did you mean resnet50" in line and "greenserve models" in line, line


@pytest.mark.parametrize(("model", "weights", "fix"), [
    ("resnet18", "imagenet", "`greenserve download-weights resnet18`"),
    ("open_clip:ViT-B-32", "laion2b_s34b_b79k",  # the README's CLIP quick start without the weights cached
     "`greenserve download-weights open_clip:ViT-B-32 --pretrained laion2b_s34b_b79k`"),
], ids=["torchvision-imagenet", "clip-quick-start"])
def test_weights_not_on_the_machine_stop_every_worker_and_the_master(image_host: ImageHost, weights_file: Path,
                                                                      tmp_path: Path, model: str, weights: str,
                                                                      fix: str) -> None:
    """Found by a worker's load (the caches are looked in there): it exits with gunicorn's boot-error status,
    and the master stops its siblings and exits with it, the worker's one line above its own."""
    env = e2e_env(weights_file, image_host, GREENSERVE_MODEL=model, GREENSERVE_WEIGHTS=weights,
                  TORCH_HOME=str(tmp_path / "torch"), HF_HOME=str(tmp_path / "hf"))  # empty caches
    srv = GunicornServer(env, workers=2)
    status, took = exits(srv)
    log = srv.log()
    print(f"\nexit {status} after {took:.1f}s")
    assert status == 3  # gunicorn's WORKER_BOOT_ERROR: "Reason: Worker failed to boot."
    said = [ln for ln in log.splitlines() if fix in ln]
    assert said and all("[CRITICAL]" in ln and "cannot serve " in ln for ln in said), log[-3000:]
    assert "Traceback" not in log
    booted = {int(pid) for pid in re.findall(r"Booting worker with pid: (\d+)", log)}
    assert len(booted) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in booted)  # none outlives its master


def probe(port: int, path: str) -> tuple[int | str, float]:
    """One probe on a fresh connection, as an orchestrator sends it: (status or what went wrong, seconds)."""
    started = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        conn.close()
        return response.status, time.monotonic() - started
    except ConnectionRefusedError:  # not listening yet: the master imports the model's libraries first
        return "refused", time.monotonic() - started
    except TimeoutError:
        return "timeout", time.monotonic() - started


def test_probes_answer_within_100_ms_throughout_a_clip_start(clip_checkpoint: Path) -> None:
    """Every 50 ms a /healthz and a /readyz, each on a new connection, from the master's start until the model
    serves: 200 and 503 while it loads, within 100 ms each, from the moment a worker first takes a connection
    (the port is bound a moment before: the worker imports greenserve and builds its app, 0.6-1.3 s here)."""
    srv = GunicornServer({"GREENSERVE_MODEL": f"open_clip:{CLIP_ARCH}", "GREENSERVE_WEIGHTS": str(clip_checkpoint)},
                         workers=2)
    rows: list[tuple[float, str, int | str, float]] = []
    started = time.monotonic()
    srv.spawn()
    try:
        while time.monotonic() - started < 120:
            for path in ("/healthz", "/readyz"):
                status, took = probe(srv.port, path)
                rows.append((time.monotonic() - started, path, status, took))
            if rows[-1][2] == 200:
                break
            time.sleep(PROBE_EVERY_S)
        log = srv.log()
    finally:
        srv.stop()
    answered = [r for r in rows if isinstance(r[2], int)]
    assert answered and rows[-1][2] == 200, log[-3000:]
    first = rows.index(answered[0])
    boot_wait = answered[0][3]  # a probe that connected before any worker took connections waited for one
    after = rows[first + 1:]
    loading = [r for r in after if r[1] == "/readyz" and r[2] == 503]
    slow = [r for r in after if r[3] > ANSWER_WITHIN_S]
    print(f"\nready {rows[-1][0]:.1f}s after the start; the first answer at {answered[0][0]:.1f}s, {boot_wait:.2f}s after "
          f"its probe connected; then {len(after)} probes, {len(loading)} of them /readyz 503 while loading, the "
          f"slowest in {max(r[3] for r in after) * 1000:.0f} ms")
    assert {r[2] for r in rows[:first]} <= {"refused"}  # the master imports the model's libraries, then binds
    assert all(r[2] == 200 for r in after if r[1] == "/healthz"), after
    assert len(loading) >= 10, "hardly a probe was answered while the model loaded"
    assert not slow, slow
    assert boot_wait < 5.0  # the worker's own boot (imports, the app), not the model's load
