"""Callers over HTTP: how a caller is told apart, and the heavy caller's 429 while the others are served."""

from __future__ import annotations

import time

import gevent
import pytest
from flask.testing import FlaskClient

from harness.fakes import BASE, FakeFetcher, FakeModel
from harness.images import solid
from service.app import create_app
from service.http.context import caller_of
from service.settings import Settings, SettingsError


def test_callers_are_told_apart_by_the_configured_sources_in_order() -> None:
    headers = {"Authorization": "Bearer s3cret", "X-Client-ID": "album-sync", "X-Real-IP": "10.1.2.3"}
    source, caller = caller_of(headers, "127.0.0.1", ("token", "header", "address"))
    assert source == "token" and "s3cret" not in caller and caller.startswith("token:")
    assert caller_of({"Authorization": "Bearer other"}, None, ("token",))[1] != caller
    assert caller_of(headers, "127.0.0.1", ("header", "address")) == ("header", "client:album-sync")
    assert caller_of(headers, "127.0.0.1", ("forwarded", "address")) == ("forwarded", "ip:10.1.2.3")
    assert caller_of({"X-Forwarded-For": "10.9.9.9, 10.0.0.1"}, None, ("forwarded",)) == ("forwarded", "ip:10.9.9.9")
    assert caller_of({}, "192.0.2.7", ("token", "header", "address")) == ("address", "ip:192.0.2.7")
    assert caller_of({}, None, ("token",)) == ("none", "")
    with pytest.raises(SettingsError, match="GREENSERVE_CALLER_FROM"):
        Settings(caller_from=("cookie",))


def refusals(client: FlaskClient) -> float:
    line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith("greenserve_over_share_total "))
    return float(line.split()[1])


def test_over_http_the_heavy_caller_gets_429_and_the_others_are_served() -> None:
    settings = Settings(image_base_url=BASE, max_images=8, max_queue_images=16, max_caller_images=4)
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
