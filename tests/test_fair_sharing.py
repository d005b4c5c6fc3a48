"""Fair sharing between callers on one worker: start-time fair tags over images, the batcher ending a
request's batch when another caller's image is due, the per-caller cap (429, not 503), and how a caller is
told apart (token digest, X-Client-ID, forwarded address, peer address)."""

from __future__ import annotations

import time

import gevent
import numpy as np
import pytest
from flask.testing import FlaskClient

from harness.fakes import BASE, FakeFetcher, FakeModel
from harness.images import solid
from service.app import create_app
from service.engine.fairness import Callers, FairTags
from service.engine.runner import Runner
from service.engine.scheduling import Admission, Gather, Scheduler
from service.errors import Overloaded, OverShare
from service.http.context import caller_of
from service.settings import Settings, SettingsError
from tests.test_batcher import Forward, Policy, Request, make, pixel
from tests.test_scheduling import AllCores


def test_a_callers_requests_follow_each_other_and_a_new_caller_starts_now() -> None:
    tags = FairTags()
    assert [tags.start("heavy", 30) for _ in range(4)] == [0, 30, 60, 90]
    tags.taken(10.0)  # the batcher is at the heavy caller's 11th image
    assert tags.start("light", 1) == 10.0, "a caller with nothing queued goes next, not after 120 images"
    assert tags.start("light", 1) == 11.0 and tags.start("heavy", 30) == 120.0
    tags.taken(5.0)
    assert tags.now == 10.0, "fair time never goes back"


def test_fair_tags_forget_callers_whose_work_is_behind() -> None:
    tags = FairTags()
    for i in range(200):
        tags.start(f"caller {i}", 1)
    tags.taken(500.0)
    assert tags._finish == {}, "callers with nothing ahead of now are not remembered"


def test_a_caller_over_its_share_is_429_while_others_are_admitted() -> None:
    scheduler = Scheduler(Settings(max_queue_images=8, max_caller_images=4), 2, AllCores())
    with scheduler.admit(3, caller="heavy"):
        with pytest.raises(OverShare) as over:
            with scheduler.admit(2, caller="heavy", seconds_per_image=1.0):
                pass
        assert over.value.status_code == 429 and over.value.code == "over_share"
        assert over.value.headers["Retry-After"] == "3"
        with scheduler.admit(1, caller="heavy"), scheduler.admit(4, caller="light"):
            with pytest.raises(Overloaded) as full:  # the worker is full: that is 503, whoever asks
                with scheduler.admit(1, caller="third"):
                    pass
            assert full.value.status_code == 503
    with scheduler.admit(6, caller="heavy"):
        pass  # alone, a request bigger than the share is admitted: it could never run otherwise


def test_the_share_defaults_to_the_whole_queue() -> None:
    assert Settings(max_queue_images=64).caller_share() == 64
    assert Settings(max_queue_images=64, max_caller_images=16).caller_share() == 16


def test_a_light_callers_image_goes_between_a_heavy_callers_images() -> None:
    """A heavy request with all its images on the way holds batches of its own; the light caller's one
    image must be in the next batch, not after the heavy request's 24."""
    settings = Settings.from_env({"GREENSERVE_WORKERS": "1", "GREENSERVE_MAX_BATCH": "4"})
    runner = Runner(settings, model=FakeModel(delay_s=0.02), cores=2)
    pixels = np.zeros((32, 32, 3), np.uint8)
    order: list[str] = []

    def image(admission: Admission, name: str) -> None:
        with admission.image():
            result = runner.infer(pixels, None, admission)
        result.get()
        order.append(name)

    runner.batcher.start()
    try:
        with runner.admit(24, caller="heavy") as heavy:
            jobs = [gevent.spawn(image, heavy, f"heavy {i}") for i in range(24)]
            while len(order) < 2:
                gevent.sleep(0.005)
            with runner.admit(1, caller="light") as light:
                jobs.append(gevent.spawn(image, light, "light"))
                gevent.joinall(jobs, raise_error=True, timeout=10)
        # 2 done when it came, a batch of 4 running, the next batch: by then it must have gone (FIFO: 24th)
        assert order.index("light") < 2 + 4 + 4, order
    finally:
        runner.batcher.stop()


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


def test_after_a_streamed_first_row_the_next_batch_gathers_from_when_the_hold_ended() -> None:
    """The first row's forward holds reads and decodes, so no image comes meanwhile: that silence is not a gap
    in the fetches, and the next batch still gathers (it went with the 2 images decoded before the hold)."""
    fwd = Forward(delay_s=0.1)
    coming = [5]
    b = make(fwd, max_batch=8, max_wait_s=0.0, policy=Policy(lambda: coming[0], Gather.BRIDGE_GAPS))
    streamed = _Streamed()
    first = b.submit(pixel(1), admission=streamed, tag=0.0)
    gevent.sleep(0.02)  # its forward runs: two images decoded before the hold are queued
    rest = [b.submit(pixel(2 + i), admission=streamed, tag=1.0 + i) for i in range(2)]
    first.get(timeout=2)
    rest.append(b.submit(pixel(4), admission=streamed, tag=3.0))  # the first image after the hold
    streamed.upstream = coming[0] = 0
    b.wake()
    for r in rest:
        r.get(timeout=3)
    assert fwd.sizes == [1, 3], fwd.sizes
    b.stop()


def test_forwards_are_short_only_while_callers_share_the_worker() -> None:
    callers = Callers(Settings(fair_quantum_ms=250))
    callers.admit("backfill", 30, seconds_per_image=0.05)
    assert callers.batch_cap(0.05) is None, "one caller: its batches are as big as they come"
    callers.admit("search", 1, seconds_per_image=0.05)
    assert callers.batch_cap(0.05) == 5  # 250 ms of 50 ms images
    assert callers.batch_cap(0.4) == 1, "at least one image"


class _Streamed(Request):
    def __init__(self) -> None:
        super().__init__(upstream=5)
        self.first = True

    def first_at_once(self) -> bool:
        first, self.first = self.first, False
        return first


def test_a_streamed_requests_first_batch_goes_with_one_image() -> None:
    """With images on their way a batch would gather them (up to 2 s); a streamed request's first row goes
    at once, and its next batch gathers as usual."""
    fwd = Forward(delay_s=0.02)
    policy = Policy(lambda: 5, Gather.BRIDGE_GAPS)
    b = make(fwd, max_batch=8, max_wait_s=0.5, policy=policy)
    streamed = _Streamed()
    t0 = time.monotonic()
    first = b.submit(pixel(1), admission=streamed, tag=0.0)
    first.get(timeout=2)
    assert time.monotonic() - t0 < 0.3 and fwd.sizes == [1]
    assert policy.urgent_calls == [True, False], "the first row's forward is urgent (decodes and reads wait)"
    rest = [b.submit(pixel(2 + i), admission=streamed, tag=1.0 + i) for i in range(3)]
    streamed.upstream = 0
    b.wake()
    for r in rest:
        r.get(timeout=3)
    assert fwd.sizes[1:] == [3], fwd.sizes
    assert policy.urgent_calls == [True, False], "the rest are not"
    b.stop()
