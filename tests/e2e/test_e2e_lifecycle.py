"""Process lifecycle on real gunicorn -k gevent: a master killed with ``kill -9`` leaves workers that stop
accepting at once, finish the requests they hold and exit (gunicorn's gevent worker exited at its next
heartbeat, up to a second later, cutting every request in flight); a reload (HUP) keeps the old workers
serving until a replacement is ready."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.load import Load, load_summary
from harness.servers import e2e_env

pytestmark = pytest.mark.e2e


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.add(pid)
        except ProcessLookupError:
            pass
    return out


def refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return False
    except (ConnectionRefusedError, TimeoutError, OSError):
        return True


def test_a_dead_masters_workers_stop_accepting_and_finish_what_they_hold(weights_file: Path,
                                                                        image_host: ImageHost) -> None:
    env = e2e_env(weights_file, image_host, GREENSERVE_GRACEFUL_TIMEOUT_S="20", GREENSERVE_FETCH_TIMEOUT_S="10")
    srv = GunicornServer(env, workers=2).start()
    try:
        workers = srv.worker_pids()
        answers: list[int | str] = []

        def slow(i: int) -> None:  # photos the image host sends 2.5 s late: in flight when the master dies
            try:
                r = requests.post(srv.url + "/v1/embeddings", json={"images": [f"img00{i}.jpg?delay=2.5&m={i}"]},
                                  headers={"Cache-Control": "no-store"}, timeout=30)
                answers.append(r.status_code)
            except requests.RequestException as exc:
                answers.append(type(exc).__name__)

        clients = [threading.Thread(target=slow, args=(i,)) for i in range(4)]
        for t in clients:
            t.start()
        time.sleep(1.0)
        assert srv.proc is not None
        t_kill = time.monotonic()
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
        while not refuses(srv.port) and time.monotonic() - t_kill < 5:
            time.sleep(0.05)
        refused_after = time.monotonic() - t_kill
        for t in clients:
            t.join(30)
        while alive(workers) and time.monotonic() - t_kill < 25:
            time.sleep(0.1)
        lingering = alive(workers)
        for pid in lingering:
            os.kill(pid, signal.SIGKILL)
    finally:
        srv.stop()
    print(f"\nport refusing {refused_after:.2f}s after the kill; answers {answers}")
    assert answers == [200] * 4, answers  # nothing in flight was cut
    assert refused_after < 0.5, f"the orphaned workers still accepted {refused_after:.2f}s after their master died"
    assert not lingering, "orphaned workers outlived the graceful timeout"


def test_a_reload_keeps_the_old_workers_serving_until_a_replacement_is_ready(weights_file: Path,
                                                                             image_host: ImageHost) -> None:
    """HUP under load: requests that start after the signal and before any new worker is ready are answered
    by the old workers (they used to stop accepting at once, and those requests waited for a model load)."""
    body = {"images": [f"img00{i}.jpg" for i in range(4)]}
    with GunicornServer(e2e_env(weights_file, image_host), workers=2) as srv:
        old = srv.worker_pids()
        with Load(srv.url, 4, body, duration_s=60, headers={"Cache-Control": "no-store"}) as load:
            time.sleep(2.0)
            assert srv.proc is not None
            t_hup = time.monotonic()
            os.kill(srv.proc.pid, signal.SIGHUP)
            deadline = t_hup + 40
            while time.monotonic() < deadline:
                recent = {d.pid for d in load.since(time.monotonic() - 1.0) if d.status == 200}
                if recent and not recent & old:
                    break
                time.sleep(0.5)
            load.stop()
    done = load.done
    new = {d.pid for d in done} - old
    assert new and all(d.status == 200 for d in done), load_summary(done)
    first_new = min(d.ended for d in done if d.pid in new)
    meanwhile = [d for d in done if t_hup + 0.3 < d.started < first_new - 0.5]
    seconds = sorted(d.seconds for d in done)
    print(f"\nHUP: {len(meanwhile)} requests started before a new worker served; max {seconds[-1]:.2f}s, "
          f"p50 {seconds[len(seconds) // 2]:.2f}s")
    assert len(meanwhile) >= 3 and {d.pid for d in meanwhile} <= old, [(d.pid, d.seconds) for d in meanwhile]


def thread_nices(pid: int) -> dict[int, int]:
    """Each thread's nice value (``/proc/PID/task/TID/stat``, field 19), by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
        except (OSError, IndexError):
            pass
    return out


def test_a_replacement_boots_below_its_serving_siblings_and_serves_at_its_own_priority(
        weights_file: Path, image_host: ImageHost) -> None:
    """After a HUP the new workers load at a lower CPU priority while the old ones serve (on 2 cores their
    boot slowed every request: max latency 2.4x p50, 1.4-1.5x lowered), and every thread takes its
    priority back before the worker accepts: the hub at the master's, the model's thread 5 below it."""
    with GunicornServer(e2e_env(weights_file, image_host), workers=2) as srv:
        assert srv.proc is not None
        master = os.getpriority(os.PRIO_PROCESS, srv.proc.pid)
        old = srv.worker_pids()
        assert all(thread_nices(pid)[pid] == master for pid in old)  # the first boot is not lowered
        os.kill(srv.proc.pid, signal.SIGHUP)
        booting: dict[int, int] = {}
        deadline = time.monotonic() + 60
        while srv.log().count("model ready:") < 4 and time.monotonic() < deadline:
            for pid in srv.worker_pids() - old:  # the highest seen: a fresh fork holds the master's until init
                with contextlib.suppress(OSError, KeyError):
                    booting[pid] = max(booting.get(pid, master), thread_nices(pid)[pid])
            time.sleep(0.01)
        while alive(old) and time.monotonic() < deadline:
            time.sleep(0.1)
        new = srv.worker_pids()
        r = requests.post(srv.url + "/v1/embeddings", json={"images": ["img000.jpg", "img001.jpg"]}, timeout=60)
        serving = {pid: thread_nices(pid) for pid in new}
    assert r.status_code == 200, r.text
    assert set(booting) == new and set(booting.values()) == {master + 10}, booting
    for pid, nices in serving.items():
        assert nices[pid] == master, nices  # the hub
        assert master + 5 in nices.values(), nices  # the model's thread, 5 below the hub as on a first boot
        assert max(nices.values()) <= master + 10, nices  # decode threads at most 10 below


def test_the_master_imports_the_model_libraries_for_its_workers(weights_file: Path, image_host: ImageHost) -> None:
    """torch is in the master before any fork (``service.preimport``): a new worker does not import it again."""
    with GunicornServer(e2e_env(weights_file, image_host), workers=1) as srv:
        assert srv.proc is not None
        with open(f"/proc/{srv.proc.pid}/maps") as maps:
            assert "libtorch_cpu" in maps.read()
        assert "imported the models' libraries in" in srv.log()
        r = requests.post(srv.url + "/v1/embeddings", json={"images": ["img000.jpg"]}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_stop_soon_after_a_reload_drains_at_once(weights_file: Path, image_host: ImageHost) -> None:
    """A SIGTERM to the master within a reload's graceful timeout is a stop, not a handover: the workers
    must not wait for replacements that will never come (they would hold the stop for the whole timeout)."""
    env = e2e_env(weights_file, image_host, GREENSERVE_GRACEFUL_TIMEOUT_S="30")
    srv = GunicornServer(env, workers=2).start()
    try:
        assert srv.proc is not None
        old = srv.worker_pids()
        os.kill(srv.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 60
        while srv.log().count("model ready:") < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        while alive(old) and time.monotonic() < deadline:  # the old ones handed over and left
            time.sleep(0.2)
        t_stop = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(40)
        took = time.monotonic() - t_stop
    finally:
        srv.stop()
    assert took < 10, f"the stop took {took:.1f}s: the workers waited to hand over"


ABORT = ("terminate called", "SIGABRT", "core dumped")


def stop_at(srv: GunicornServer, sig: signal.Signals, *, when: str) -> str:
    """Start ``srv``, send its master ``sig`` at ``when`` (``boot``: while the workers import and load the
    model; ``idle``: ready, no request; ``served``: after a request) and return its whole log."""
    if when == "boot":
        srv.boot()
        time.sleep(1.0)  # the app is being built: the model's load is queued or in its thread
    else:
        srv.start()
        if when == "served":
            r = requests.post(srv.url + "/v1/embeddings", json={"images": ["img000.jpg", "img001.jpg"]}, timeout=60)
            assert r.status_code == 200, r.text
    assert srv.proc is not None
    srv.proc.send_signal(sig)
    assert srv.proc.wait(60) == 0
    return srv.log()


@pytest.mark.parametrize(("sig", "when"), [(signal.SIGTERM, "boot"), (signal.SIGINT, "boot"),
                                           (signal.SIGTERM, "served"), (signal.SIGINT, "idle")])
def test_no_worker_aborts_at_exit(weights_file: Path, image_host: ImageHost, sig: signal.Signals, when: str) -> None:
    """A stop while the model loads used to abort every worker ("terminate called without an active
    exception", SIGABRT): the interpreter finalized while the load ran in a daemon thread."""
    log = stop_at(GunicornServer(e2e_env(weights_file, image_host), workers=2), sig, when=when)
    aborts = [line for line in log.splitlines() if any(a in line for a in ABORT)]
    assert not aborts, "\n".join(aborts)
    assert log.count("Booting worker") >= 2  # the workers were there to be stopped
    # each ended through the worker's own exit (without finalizing the interpreter: ``GreenserveWorker.run``)
    assert log.count("Worker exiting") + log.count("exits with the model still busy") == log.count("Booting worker")
