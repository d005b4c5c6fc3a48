"""Callers over HTTP: how a caller is told apart, and the heavy caller's 429 while the others are served."""

from __future__ import annotations

import hashlib
import time

import gevent
import pytest
from flask.testing import FlaskClient

from harness.fakes import BASE, FakeFetcher, FakeModel
from harness.images import solid
from service.app import create_app
from service.http.context import Identities, caller_of
from service.settings import Settings, SettingsError

KNOWN = Identities.of(("token", "address"), api_token="s3cret,other-team")
WITH_IDS = Identities.of(("token", "header", "address"), api_token="s3cret")
PROXIED = Identities.of(("token", "forwarded", "address"), trusted_proxies=("127.0.0.1", "10.8.0.0/16"))


def token(t: str) -> str:
    return "token:" + hashlib.sha256(t.encode()).hexdigest()[:24]


def client_id(text: str) -> str:
    return "client:" + hashlib.sha256(text.encode()).hexdigest()[:24]


@pytest.mark.parametrize(("who", "headers", "peer", "caller"), [
    (KNOWN, {"Authorization": "Bearer s3cret"}, "192.0.2.7", ("token", token("s3cret"))),
    (KNOWN, {"Authorization": "Bearer other-team"}, "192.0.2.7", ("token", token("other-team"))),  # its own
    (KNOWN, {"Authorization": "Bearer made-up"}, "192.0.2.7", ("address", "ip:192.0.2.7")),  # unknown: not an identity
    (Identities(), {"Authorization": "Bearer any"}, "192.0.2.7", ("address", "ip:192.0.2.7")),  # no tokens known
    (KNOWN, {"X-Client-ID": "victim"}, "192.0.2.7", ("address", "ip:192.0.2.7")),  # self-declared: ignored
    (KNOWN, {"X-Real-IP": "10.1.2.3"}, "192.0.2.7", ("address", "ip:192.0.2.7")),  # not listed
    (WITH_IDS, {"X-Client-ID": "album-sync"}, "192.0.2.7", ("header", "ip:192.0.2.7/" + client_id("album-sync"))),
    (WITH_IDS, {"X-Client-ID": "album-sync"}, "192.0.2.8", ("header", "ip:192.0.2.8/" + client_id("album-sync"))),
    (WITH_IDS, {"Authorization": "Bearer s3cret", "X-Client-ID": "a"}, "192.0.2.7",
     ("header", token("s3cret") + "/" + client_id("a"))),  # two clients of one token: two callers
    (WITH_IDS, {"X-Client-ID": "x" * 128 + "1"}, "192.0.2.7", ("header", "ip:192.0.2.7/" + client_id("x" * 128 + "1"))),
    (PROXIED, {"X-Real-IP": "10.1.2.3"}, "127.0.0.1", ("forwarded", "ip:10.1.2.3")),
    (PROXIED, {"X-Forwarded-For": "6.6.6.6, 10.9.9.9"}, "10.8.0.1", ("forwarded", "ip:10.9.9.9")),  # the proxy's
    (PROXIED, {"X-Real-IP": "10.1.2.3"}, "192.0.2.7", ("address", "ip:192.0.2.7")),  # not from a proxy
    (KNOWN, {}, None, ("none", "")),
])
def test_a_caller_is_what_the_server_can_check(who: Identities, headers: dict[str, str], peer: str | None,
                                               caller: tuple[str, str]) -> None:
    assert caller_of(headers, peer, who) == caller


def test_ids_that_share_a_long_prefix_are_two_callers_and_the_settings_say_what_is_missing() -> None:
    first = caller_of({"X-Client-ID": "x" * 128 + "1"}, "192.0.2.7", WITH_IDS)
    assert first != caller_of({"X-Client-ID": "x" * 128 + "2"}, "192.0.2.7", WITH_IDS)
    with pytest.raises(SettingsError, match="GREENSERVE_CALLER_FROM"):
        Settings(caller_from=("cookie",))
    with pytest.raises(SettingsError, match="GREENSERVE_TRUSTED_PROXIES"):
        Settings(caller_from=("forwarded", "address"))
    with pytest.raises(SettingsError, match="GREENSERVE_TRUSTED_PROXIES"):
        Settings(caller_from=("forwarded",), trusted_proxies=("nginx",))


def refusals(client: FlaskClient) -> float:
    line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith("greenserve_over_share_total "))
    return float(line.split()[1])


def test_over_http_the_heavy_caller_gets_429_and_the_others_are_served() -> None:
    settings = Settings(image_base_url=BASE, max_images=8, max_queue_images=16, max_caller_images=4,
                        caller_from=("header", "address"))  # callers on one address, told apart by their ids
    fetcher = FakeFetcher({BASE + "g10.png": solid(10)})
    client: FlaskClient = create_app(settings, model=FakeModel(delay_s=0.3), fetcher=fetcher).test_client()
    heavy = {"X-Client-ID": "backfill"}
    before = refusals(client)
    jobs = [gevent.spawn(client.post, "/v1/embeddings", json={"images": ["g10.png"] * 3}, headers=heavy)
            for _ in range(2)]
    t0 = time.monotonic()
    while not any(job.dead for job in jobs) and time.monotonic() - t0 < 5:
        gevent.sleep(0.01)
    statuses = sorted(job.get().status_code for job in jobs)
    assert statuses == [200, 429], statuses
    refused = next(job.get() for job in jobs if job.get().status_code == 429)
    assert refused.json["error"]["code"] == "over_share" and int(refused.headers["Retry-After"]) >= 1
    light = client.post("/v1/embeddings", json={"images": ["g10.png"]}, headers={"X-Client-ID": "search"})
    assert light.status_code == 200
    metrics = client.get("/metrics").text
    assert refusals(client) == before + 1
    assert 'greenserve_caller_requests_total{source="header"}' in metrics and "backfill" not in metrics


def test_the_share_defaults_to_the_whole_queue() -> None:
    assert Settings(max_queue_images=64).caller_share() == 64
    assert Settings(max_queue_images=64, max_caller_images=16).caller_share() == 16


@pytest.mark.parametrize(("header", "urgency"), [("", 3), ("u=7", 7), ("u=5, i", 5), ("i, u=0", 0), ("u=9", 3),
                                                 ("u=x", 3), ("progressive", 3)])
def test_the_priority_header_says_a_requests_urgency(header: str, urgency: int) -> None:
    from service.http.context import RequestContext

    ctx = RequestContext.begin({"Priority": header} if header else {}, None, 0.0)
    assert ctx.urgency == urgency
