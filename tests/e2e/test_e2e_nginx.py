"""A real nginx running the shipped deploy/nginx/greenserve.conf (only its addresses and paths swapped, see
harness/deploy.py) in front of two real greenserve instances of one worker each, all on 127.0.0.1:
a crashed or draining instance fails no request, the body cap and request buffering hold at nginx, request
ids pass through. Bounded: each load stops by itself, every socket has a timeout."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness.deploy import conf_value, size_bytes
from harness.imagehost import ImageHost
from harness.load import Load, load_summary
from harness.nginx import Fleet, Nginx, nginx_binary
from harness.servers import e2e_env

pytestmark = pytest.mark.e2e
EMBED_BODY = {"images": ["img000.jpg"]}


def embed_one(session: requests.Session, url: str) -> requests.Response:
    return session.post(url + "/v1/embeddings", json=EMBED_BODY, timeout=30)


@pytest.fixture(scope="module")
def module_fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if nginx_binary() is None:  # before the weights fixture: a skip costs no torch import
        pytest.skip("no nginx binary on PATH or in /usr/sbin: `make test` installs nginx-light as root with apt-get")
    weights_file: Path = request.getfixturevalue("weights_file")
    image_host: ImageHost = request.getfixturevalue("image_host")
    # two instances on one host share its cores: one torch thread each (cores // instances on 2 cores)
    env = e2e_env(weights_file, image_host, GREENSERVE_TORCH_THREADS="1")
    with Fleet(env, tmp_path_factory.mktemp("nginx")).running() as fleet:
        yield fleet


@pytest.fixture()
def fleet(module_fleet: Fleet) -> Fleet:
    """Both instances up (a fault test before may have taken one down)."""
    module_fleet.ensure_up()
    return module_fleet


def raw_exchange(port: int, head: bytes, body_chunks: Iterator[bytes], *, timeout_s: float = 20) -> bytes:
    """Send ``head`` and the chunks (stopping when the server answers or hangs up), return all it answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(head)
        s.setblocking(False)
        answer = b""
        for chunk in body_chunks:
            try:
                answer += s.recv(65536)
                break  # answered before the body was complete
            except BlockingIOError:
                pass
            try:
                s.setblocking(True)
                s.sendall(chunk)
                s.setblocking(False)
            except (BrokenPipeError, ConnectionResetError):
                break
        s.settimeout(timeout_s)
        try:
            while chunk := s.recv(65536):  # nginx closes after the answer: 413s and "Connection: close" requests
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return answer


def status_and_headers(answer: bytes) -> tuple[int, dict[str, str]]:
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return int(head[0].split()[1]), {k.lower(): v for k, v in headers.items()}


def test_request_id_passes_through_or_is_made_by_nginx(fleet: Fleet) -> None:
    sent = f"client-{uuid.uuid4().hex[:12]}"
    r = requests.post(fleet.nginx.url + "/v1/embeddings", json=EMBED_BODY, headers={"X-Request-ID": sent}, timeout=30)
    assert r.status_code == 200 and r.headers["X-Request-ID"] == sent
    assert f"rid={sent}" in fleet.logs(f"rid={sent}")  # greenserve got the caller's id
    assert f"rid={sent}" in fleet.nginx.access_line(sent)

    probe = uuid.uuid4().hex
    r = requests.get(fleet.nginx.url + f"/readyz?probe={probe}", timeout=10)
    made = r.headers["X-Request-ID"]
    assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", made)
    assert f"rid={made} " in fleet.nginx.access_line(probe)  # nginx's $request_id, which greenserve echoed
    assert f"rid={made}" in fleet.logs(f"rid={made}")


def test_a_body_over_the_cap_is_nginxs_413_and_never_reaches_greenserve(fleet: Fleet) -> None:
    cap = size_bytes(conf_value("client_max_body_size"))
    logs_before = fleet.logs()
    head = ("POST /v1/embeddings HTTP/1.1\r\nHost: greenserve\r\nContent-Type: application/json\r\n"
            "X-Request-ID: {rid}\r\n{framing}\r\n\r\n")
    declared = head.format(rid="too-big-declared", framing=f"Content-Length: {cap + 1}").encode()
    answer = raw_exchange(fleet.nginx.port, declared, iter([b"x" * 65536] * 4))
    status, headers = status_and_headers(answer)
    assert status == 413 and headers["server"].startswith("nginx") and "x-worker-pid" not in headers, answer[:300]

    # chunked, so no length to check up front: nginx counts while it reads and stops at the cap
    mib = b"x" * (1 << 20)
    chunks = iter([b"100000\r\n" + mib + b"\r\n"] * (cap // len(mib) + 2))
    answer = raw_exchange(fleet.nginx.port, head.format(rid="too-big-chunked", framing="Transfer-Encoding: chunked")
                          .encode(), chunks)
    status, headers = status_and_headers(answer)
    assert status == 413 and "x-worker-pid" not in headers, answer[:300]

    # under nginx's cap but over this test's GREENSERVE_MAX_BODY_BYTES (8 MiB): buffered to a temp file by
    # nginx, then refused by greenserve itself
    r = requests.post(fleet.nginx.url + "/v1/embeddings", data=b"x" * (9 << 20), timeout=30,
                      headers={"Content-Type": "application/json", "X-Request-ID": "under-nginx-cap"})
    assert r.status_code == 413 and "X-Worker-PID" in r.headers, r.text
    assert "GREENSERVE_MAX_BODY_BYTES" in r.json()["error"]["message"]
    assert "too-big" not in fleet.logs("rid=under-nginx-cap").replace(logs_before, "")  # logged up to the last


def test_a_slow_upload_holds_nginx_not_a_worker(fleet: Fleet) -> None:
    """The same 4 s trickle through nginx and, as the control, straight to an instance, at the same time."""
    rids = {"nginx": f"slow-{uuid.uuid4().hex[:12]}", "direct": f"slow-direct-{uuid.uuid4().hex[:12]}"}
    ports = {"nginx": fleet.nginx.port, "direct": fleet.instance(0).port}
    body = json.dumps(EMBED_BODY).encode()
    trickle_s = 4.0
    answers: dict[str, bytes] = {}

    def trickle() -> Iterator[bytes]:
        for byte in body:
            time.sleep(trickle_s / len(body))
            yield bytes([byte])

    def slow_client(via: str) -> None:
        head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: greenserve\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nX-Request-ID: {rids[via]}\r\nConnection: close\r\n\r\n").encode()
        answers[via] = raw_exchange(ports[via], head, trickle())

    slow = [threading.Thread(target=slow_client, args=(via,), daemon=True) for via in rids]
    t0 = time.monotonic()
    for thread in slow:
        thread.start()
    during, pids = [], set()
    session = requests.Session()
    while time.monotonic() - t0 < trickle_s - 1:  # normal requests to both one-worker instances meanwhile
        t = time.monotonic()
        r = embed_one(session, fleet.nginx.url)
        during.append(time.monotonic() - t)
        assert r.status_code == 200
        pids.add(int(r.headers["X-Worker-PID"]))
    for thread in slow:
        thread.join(trickle_s + 30)
    assert time.monotonic() - t0 >= trickle_s
    status, headers = status_and_headers(answers["nginx"])
    assert status == 200 and headers["x-request-id"] == rids["nginx"]
    assert status_and_headers(answers["direct"])[0] == 200
    assert max(during) < 2.0, f"requests during the trickle took up to {max(during):.2f}s"
    assert int(headers["x-worker-pid"]) in pids, "the slow request's worker answered others meanwhile"
    # greenserve's own time for the request (gunicorn's access log): the whole trickle when it reads the body
    # itself, the inference alone when nginx hands it over complete
    app_ms = {via: int(re.search(rf"(\d+)ms rid={rid} ", fleet.logs(f"rid={rid} ")).group(1))
              for via, rid in rids.items()}
    assert app_ms["direct"] >= 0.75 * trickle_s * 1000, app_ms
    assert app_ms["nginx"] < 2000, f"greenserve spent {app_ms} ms on a request whose body took {trickle_s}s"
    line = fleet.nginx.access_line(rids["nginx"])
    request_time = float(re.search(r"request_time=([\d.]+)", line).group(1))
    upstream_time = float(re.search(r"upstream_time=([\d.]+)", line).group(1))
    assert request_time >= trickle_s - 0.5 and upstream_time < 2.0, line
    print(f"\nslow upload: greenserve's time {app_ms} ms; through nginx request_time={request_time}s "
          f"upstream_time={upstream_time}s; {len(during)} requests meanwhile, slowest {max(during):.2f}s")


def _pids_alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running: a zombie whose other threads are still exiting holds its sockets too."""
    alive = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z" or len(os.listdir(f"/proc/{pid}/task")) > 1:
                alive.add(pid)
        except FileNotFoundError:
            pass
    return alive


def _metrics_dir(worker_pids: set[int]) -> str:
    """The instance's prometheus directory (gunicorn.conf.py's on_starting), which a SIGKILL leaves behind: the
    one the workers' metric files are mapped from (the master sets it after exec, so /proc's environ lacks it)."""
    for pid in worker_pids:
        found = re.search(r"(/\S*/greenserve-metrics-[^/\s]+)/", Path(f"/proc/{pid}/maps").read_text())
        if found:
            return found.group(1)
    return ""


def _refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


def _retried(nginx: Nginx, since_char: int) -> int:
    """Requests nginx sent to more than one instance, in its access log from ``since_char`` on."""
    return sum(", " in re.search(r"upstream=(.*?) upstream_status", line).group(1)
               for line in nginx.log()[since_char:].splitlines())


def test_kill_9_of_an_instance_fails_no_request(fleet: Fleet) -> None:
    victim, survivor = fleet.instance(0), fleet.instance(1)
    assert victim.proc is not None
    workers, log_from = victim.worker_pids(), len(fleet.nginx.log())
    metrics_dir = _metrics_dir(workers)
    assert metrics_dir
    try:
        with Load(fleet.nginx.url, 3, EMBED_BODY, duration_s=15, timeout_s=30) as load:
            time.sleep(3)
            t_kill = time.monotonic()
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            # the orphaned workers are the instance's listeners until they notice their parent died (gunicorn
            # checks once a second), stop accepting and exit; killed here should they not, as the host would
            deadline = time.monotonic() + 10
            while (_pids_alive(workers) or not _refuses(victim.port)) and time.monotonic() < deadline:
                time.sleep(0.1)
            orphans_lived_s = time.monotonic() - t_kill
            lingering = _pids_alive(workers)
            for pid in lingering:
                os.kill(pid, signal.SIGKILL)
            time.sleep(max(0.0, t_kill + 6 - time.monotonic()))  # the survivor alone, under the same load
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    everything, after = load_summary(load.done), load_summary(load.since(t_kill))
    print(f"\nkill -9: {everything}; after the kill {after}; orphaned workers gone and port refusing after "
          f"{orphans_lived_s:.1f}s; nginx retried {_retried(fleet.nginx, log_from)} requests elsewhere")
    assert not lingering, f"orphaned workers {lingering} still alive {orphans_lived_s:.0f}s after their master"
    assert _refuses(victim.port)
    assert everything["failed"] == 0, everything
    assert after["ok"] >= 5 and set(after["by_pid"]) <= survivor.worker_pids() | workers, after


def test_sigterm_drains_an_instance_without_failures(fleet: Fleet) -> None:
    draining, survivor = fleet.instance(1), fleet.instance(0)
    assert draining.proc is not None
    workers, log_from = draining.worker_pids(), len(fleet.nginx.log())
    with Load(fleet.nginx.url, 3, EMBED_BODY, duration_s=15, timeout_s=30) as load:
        time.sleep(3)
        t_term = time.monotonic()
        draining.proc.send_signal(signal.SIGTERM)
        code = draining.proc.wait(45)
        drained_s = time.monotonic() - t_term
        time.sleep(2)  # and the survivor carries on alone
    everything, after = load_summary(load.done), load_summary(load.since(t_term))
    finished_there = sum(o.pid in workers for o in load.since(t_term - 0.5))
    print(f"\nSIGTERM: {everything}; after the signal {after}; the instance exited {code} after {drained_s:.1f}s, "
          f"{finished_there} requests finished on it from 0.5 s before the signal; nginx retried "
          f"{_retried(fleet.nginx, log_from)} requests elsewhere")
    assert code == 0 and drained_s < 30
    assert everything["failed"] == 0, everything
    assert set(after["by_pid"]) <= survivor.worker_pids() | workers and after["ok"] >= 5, after
