"""GREENSERVE_LOG_FORMAT=json on a real gunicorn -k gevent: every line of the log is one JSON object, the
access lines carry what a collector needs, error lines carry the code and the request id, and no traceback
is a line of its own."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import e2e_env

pytestmark = pytest.mark.e2e
ACCESS_FIELDS = {"request_id", "method", "route", "path", "status", "images", "timings_ms", "worker_pid", "bytes_in",
                 "bytes_out", "duration_ms"}


def test_every_line_is_json_with_request_ids(weights_file: Path, image_host: ImageHost,
                                             album: dict[str, bytes]) -> None:
    env = e2e_env(weights_file, image_host, GREENSERVE_LOG_FORMAT="json")
    sent: dict[str, int] = {}
    with GunicornServer(env, workers=1) as srv:
        bad = "data:image/jpeg;base64," + base64.b64encode(b"not an image").decode()
        big = "data:image/jpeg;base64," + base64.b64encode(album["big.jpg"]).decode()  # no fetch: the deadline hits
        calls = [("ok-1", "/v1/embeddings", {"images": ["img000.jpg", "img001.jpg"]}),
                 ("bad-1", "/v1/embeddings", {"images": [bad]}),
                 ("oip-1", "/v2/models/resnet18/infer", {"inputs": [{"name": "IMAGE", "datatype": "BYTES",
                                                                     "shape": [1], "data": ["img002.jpg"]}]}),
                 ("missing-1", "/v1/nothing", {})]
        for rid, path, body in calls:
            r = requests.post(srv.url + path, json=body, headers={"X-Request-ID": rid}, timeout=60)
            sent[rid] = r.status_code
        r = requests.post(srv.url + "/v1/embeddings", json={"images": [big]}, timeout=60,
                          headers={"X-Request-ID": "late-1", "X-Request-Timeout": "0.001"})  # a 504, logged
        sent["late-1"] = r.status_code
        requests.get(srv.url + "/healthz", timeout=10)
        srv.stop()
        lines = srv.log().splitlines()
    records = []
    for line in lines:
        assert line.startswith("{"), f"not a JSON line: {line!r}"
        records.append(json.loads(line))
    assert all({"time", "level", "logger", "pid", "message"} <= set(r) for r in records)
    access = {r["request_id"]: r for r in records if r["logger"] == "service.access"}
    assert set(sent) <= set(access), sorted(access)
    for rid, status in sent.items():
        assert ACCESS_FIELDS <= set(access[rid]) and access[rid]["status"] == status
    ok = access["ok-1"]
    assert (ok["route"], ok["images"], ok["bytes_in"] > 0, ok["bytes_out"] > 0) == ("/v1/embeddings", 2, True, True)
    assert {"fetch", "decode", "inference", "total"} <= set(ok["timings_ms"])
    assert access["oip-1"]["route"] == "/v2/models/<name>/infer" and access["oip-1"]["images"] == 1
    assert access["missing-1"]["route"] == "unmatched" and sent["bad-1"] == 422
    assert any(r["logger"].startswith("gunicorn") for r in records)  # gunicorn's own lines are JSON too
    assert sent["late-1"] == 504
    errors = [r for r in records if r["level"] == "ERROR" and r["logger"] == "service.http.hooks"]
    assert [(r["request_id"], r["code"]) for r in errors] == [("late-1", "deadline_exceeded")]
    assert not any("Traceback" in r["message"] for r in records)  # only ever in an error's exc_info field
