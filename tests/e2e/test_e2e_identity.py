"""Whose share it is, on a real gunicorn -k gevent worker with a share of 4 images per caller: clients on
different loopback addresses, one holding its share with slow photos while it rotates ids and tokens or borrows
another's id; directly, and behind the shipped nginx."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from harness.clients import session_from
from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.nginx import Nginx, nginx_binary
from harness.servers import e2e_env

pytestmark = pytest.mark.e2e
TIMEOUT = 60
SLOW = {"images": [f"img00{i}.jpg?delay=1.5&n={i}" for i in range(4)]}  # a share, in flight for 1.5 s
ONE = {"images": ["img001.jpg"]}


@contextmanager
def holding(address: str, url: str, headers: dict[str, str]) -> Iterator[list[requests.Response]]:
    """A client at ``address`` holds its share (4 slow photos) while the block runs; its answer comes after."""
    done: list[requests.Response] = []
    session = session_from(address)
    thread = threading.Thread(target=lambda: done.append(
        session.post(url + "/v1/embeddings", json=SLOW, headers=headers, timeout=TIMEOUT)))
    thread.start()
    time.sleep(0.5)  # admitted: the photos are being fetched
    try:
        yield done
    finally:
        thread.join(TIMEOUT)
    assert [r.status_code for r in done] == [200]


def post(session: requests.Session, url: str, headers: dict[str, str]) -> int:
    return session.post(url + "/v1/embeddings", json=ONE, headers=headers, timeout=TIMEOUT).status_code


def server(weights_file: Path, image_host: ImageHost, **extra: str) -> GunicornServer:
    return GunicornServer(e2e_env(weights_file, image_host, GREENSERVE_MAX_CALLER_IMAGES="4", **extra), workers=1)


def test_by_default_rotating_ids_and_made_up_tokens_buy_no_share_and_a_borrowed_id_takes_none(
        weights_file: Path, image_host: ImageHost) -> None:
    attacker, victim = session_from("127.0.0.2"), session_from("127.0.0.3")
    with server(weights_file, image_host) as srv:  # GREENSERVE_CALLER_FROM=token,address
        with holding("127.0.0.2", srv.url, {"X-Client-ID": "victim"}):
            rotated = [post(attacker, srv.url, {"X-Client-ID": f"id-{i}"}) for i in range(3)]
            tokens = [post(attacker, srv.url, {"Authorization": f"Bearer made-up-{i}"}) for i in range(3)]
            borrowed = post(victim, srv.url, {"X-Client-ID": "victim"})
        after = post(attacker, srv.url, {})
    assert rotated == [429] * 3 and tokens == [429] * 3, (rotated, tokens)
    assert borrowed == 200 and after == 200


def test_ids_split_a_token_only_when_trusted_and_never_reach_another_token(weights_file: Path,
                                                                         image_host: ImageHost) -> None:
    """Two clients of one token with their own ids are two callers; the victim's id sent with another token is
    another caller; two ids with the same first 128 characters are two callers."""
    session = session_from("127.0.0.3")
    team_a, team_b = {"Authorization": "Bearer team-a"}, {"Authorization": "Bearer team-b"}
    long_id = "x" * 128
    with server(weights_file, image_host, GREENSERVE_CALLER_FROM="token,header,address",
                GREENSERVE_API_TOKEN="team-a,team-b") as srv:
        with holding("127.0.0.2", srv.url, {**team_a, "X-Client-ID": "backfill"}):
            same_token_other_client = post(session, srv.url, {**team_a, "X-Client-ID": "search"})
            same_client = post(session, srv.url, {**team_a, "X-Client-ID": "backfill"})  # from another address too
        with holding("127.0.0.2", srv.url, {**team_b, "X-Client-ID": "victim"}):
            borrowed = post(session, srv.url, {**team_a, "X-Client-ID": "victim"})
        with holding("127.0.0.2", srv.url, {**team_a, "X-Client-ID": long_id + "a"}):
            prefix = post(session, srv.url, {**team_a, "X-Client-ID": long_id + "b"})
    assert (same_token_other_client, same_client, borrowed, prefix) == (200, 429, 200, 200)


@pytest.mark.skipif(nginx_binary() is None, reason="no nginx binary: `make test` installs nginx-light as root")
def test_behind_nginx_a_client_is_its_own_address_whatever_it_claims(weights_file: Path, image_host: ImageHost,
                                                                     tmp_path: Path) -> None:
    attacker, victim = session_from("127.0.0.2"), session_from("127.0.0.3")
    spoof = {"X-Real-IP": "10.9.9.9", "X-Forwarded-For": "10.8.8.8"}
    with server(weights_file, image_host, GREENSERVE_CALLER_FROM="token,forwarded,address",
                GREENSERVE_TRUSTED_PROXIES="127.0.0.1") as srv:
        proxy = Nginx(tmp_path, upstreams=[srv.port]).start()
        try:
            with holding("127.0.0.2", proxy.url, {}):
                rotated = [post(attacker, proxy.url, {"X-Client-ID": f"id-{i}", **spoof}) for i in range(3)]
                other = post(victim, proxy.url, {})
            with holding("127.0.0.2", srv.url, {"X-Real-IP": "10.0.0.1"}):  # straight to greenserve, not via nginx
                direct = post(attacker, srv.url, {"X-Real-IP": "10.0.0.2"})
        finally:
            proxy.stop()
    assert rotated == [429] * 3 and other == 200, (rotated, other)
    assert direct == 429, "a client's own X-Real-IP is not believed: it is 127.0.0.2 either way"
