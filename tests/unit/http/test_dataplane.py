"""The data plane every protocol shares, without Flask: built from the worker's parts, it takes the request's
context as an argument, and the answer carries what the access line needs."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from harness import images
from harness.fakes import FakeFetcher, FakeModel
from service.balance.gate import Balance, Policy
from service.engine.runner import Runner
from service.errors import DeadlineExceeded, RequestError
from service.http.context import RequestContext
from service.http.dataplane import DataPlane
from service.pipeline.inputs import parse_json
from service.pipeline.orchestrate import Orchestrator
from service.pipeline.text_encoder import TextEncoder
from service.settings import Settings

BASE = "http://img.test/"


@pytest.fixture(scope="module")
def plane() -> Iterator[DataPlane]:
    settings = Settings(image_base_url=BASE, max_images=8)
    balance = Balance(None, Policy.from_settings(settings))
    runner = Runner(settings, model=FakeModel(), siblings=balance)
    fetcher = FakeFetcher({f"{BASE}a.jpg": images.jpeg(64, 48, seed=1), f"{BASE}b.jpg": images.jpeg(64, 48, seed=2)})
    texts = TextEncoder(runner, 16, max_tokens=settings.max_text_tokens)
    orchestrator = Orchestrator(runner, fetcher, texts, max_pixels=settings.max_image_pixels)
    runner.start()
    yield DataPlane(settings, runner, orchestrator, balance)


def context(**kw: object) -> RequestContext:
    return RequestContext(**{"request_id": "rid-1", "started": time.monotonic(), **kw})  # type: ignore[arg-type]


@pytest.mark.slow  # a fresh interpreter imports torch
def test_the_data_plane_imports_no_flask() -> None:
    code = "import sys, service.http.dataplane; sys.exit('flask' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_run_answers_with_the_request_id_and_what_the_access_line_needs(plane: DataPlane) -> None:
    req = parse_json(b'{"images": ["a.jpg", "b.jpg", "missing.jpg"], "partial": true}', plane.settings)
    answer = plane.run(context(), req, "embeddings")
    assert answer.body["request_id"] == "rid-1" and answer.body["model"] == "fake"
    assert [row["index"] for row in answer.body["data"]] == [0, 1]
    assert [e["code"] for e in answer.body["errors"]] == ["fetch_failed"]
    assert answer.served.images == 3 and answer.served.timings_ms == answer.body["timings_ms"]
    assert {"fetch", "decode", "total"} <= set(answer.served.timings_ms)


def test_run_rows_gives_each_images_row_and_its_work(plane: DataPlane) -> None:
    req = parse_json(b'{"images": ["a.jpg"]}', plane.settings)
    rows, served = plane.run_rows(context(), req, ("embeddings", "classify"))
    assert served.images == 1 and served.timings_ms == rows.timings_ms


def test_the_deadline_is_the_contexts_start_plus_the_shortest_timeout() -> None:
    ctx = context(started=100.0, timeout_header="2.5")
    assert ctx.deadline(30.0) == 102.5 and ctx.deadline(30.0, 1.0) == 101.0 and context(started=5.0).deadline(3.0) == 8.0
    for bad in ("soon", "0", "-1"):
        with pytest.raises(RequestError):
            context(timeout_header=bad).deadline(30.0)


def test_a_context_past_its_deadline_is_504_before_any_work(plane: DataPlane) -> None:
    req = parse_json(b'{"images": ["a.jpg"]}', plane.settings)
    with pytest.raises(DeadlineExceeded):
        plane.run(context(started=time.monotonic() - 60, timeout_header="1"), req, "embeddings")


def test_a_context_takes_a_sane_request_id_or_makes_one() -> None:
    assert RequestContext.begin({"X-Request-ID": "abc-1"}, None, 1.0).request_id == "abc-1"
    made = RequestContext.begin({"X-Request-ID": "bad id\n"}, None, 1.0).request_id
    assert len(made) == 32 and made != "bad id\n"
