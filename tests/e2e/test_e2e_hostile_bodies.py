"""Hostile bodies and headers on every protocol surface, each sent to a real gunicorn -k gevent (2 workers,
resnet18): a 4xx with its stable code in the protocol's shape (never a 500), nothing forged in the log, and
the same workers answering afterwards."""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness import images
from harness.answers import code_of
from harness.imagehost import ImageHost
from harness.launch import GunicornServer
from harness.servers import E2E_MODEL, GUARD_TOKEN, e2e_env
from service.pipeline.json_body import LONG, MAX_SKELETON
from service.settings import Settings

pytestmark = pytest.mark.e2e
TIMEOUT = 60
JSON = {"Content-Type": "application/json"}
DEEP = b"[" * 100_000 + b"]" * 100_000
FORGED = "2099-01-01 00:00:00,000 [1] [CRITICAL] service.http.hooks: FORGED"


def oip(url: str) -> str:
    return f"{url}/v2/models/{E2E_MODEL}/infer"


def oip_body(data: object, **extra: object) -> dict[str, object]:
    return {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": data}], **extra}


def gzip_post(url: str, body: bytes) -> requests.Response:
    return requests.post(oip(url), data=body, headers={**JSON, "Content-Encoding": "gzip"}, timeout=TIMEOUT)


def gzip_cases(url: str) -> list[tuple[str, requests.Response, int, str]]:
    """A gzip stream is every member in it: the cap holds for all of them, and a stream that is cut short or
    followed by garbage is refused, not half-read (the e2e body cap is 8 MiB)."""
    whole = json.dumps(oip_body([base64.b64encode(images.jpeg(64, 64, seed=1)).decode()])).encode()
    member = gzip.compress(whole)
    bomb = gzip.compress(b" " * (64 << 20), compresslevel=9)  # 64 MiB of JSON whitespace in ~64 KB
    return [("a valid member, then a bomb member", gzip_post(url, member + bomb), 413, "body_too_large"),
            ("a valid member, then garbage", gzip_post(url, member + b"garbage!"), 400, "invalid_tensor"),
            ("a member cut at 3/4", gzip_post(url, member[:len(member) * 3 // 4]), 400, "invalid_tensor"),
            ("a request split over two members", gzip_post(url, gzip.compress(whole[:20]) + gzip.compress(whole[20:])),
             200, "")]


def native_gzip_cases(url: str) -> list[tuple[str, requests.Response, int, str]]:
    """The native routes read a compressed body with the same reader: cut short or bombed is refused with the
    native codes, and a form (werkzeug parses it from the wire) must come uncompressed."""
    member = gzip.compress(json.dumps({"images": ["img000.jpg"]}).encode())
    bomb = gzip.compress(b" " * (64 << 20), compresslevel=9)
    zipped = {**JSON, "Content-Encoding": "gzip"}
    form = {"Content-Type": "multipart/form-data; boundary=B", "Content-Encoding": "gzip"}
    part = b'--B\r\nContent-Disposition: form-data; name="images"; filename="a.jpg"\r\n\r\nx\r\n--B--\r\n'
    embed = f"{url}/v1/embeddings"
    return [("native gzip cut at 3/4", requests.post(embed, data=member[:len(member) * 3 // 4], headers=zipped,
                                                    timeout=TIMEOUT), 400, "malformed_body"),
            ("native gzip, then a bomb member", requests.post(embed, data=member + bomb, headers=zipped,
                                                               timeout=TIMEOUT), 413, "body_too_large"),
            ("a gzip form", requests.post(embed, data=gzip.compress(part), headers=form, timeout=TIMEOUT),
             415, "unsupported_content_encoding"),
            ("native gzip, whole", requests.post(embed, data=member, headers=zipped, timeout=TIMEOUT), 200, "")]


def hostile(url: str) -> list[tuple[str, requests.Response, int, str]]:
    """(what, response, status, code) for each hostile request."""
    post = requests.post
    predict = f"{url}/v1/models/{E2E_MODEL}:predict"
    nameless = b'--B\r\nContent-Disposition: form-data; filename="a.jpg"\r\n\r\nx\r\n--B--\r\n'
    form = {"Content-Type": "multipart/form-data; boundary=B"}
    brackets = b'{"images": ["img000.jpg"], "x": [' + b",".join([b"[]"] * 200_000) + b"]}"
    return [
        ("100,000-deep JSON, native", post(f"{url}/v1/embeddings", data=DEEP, headers=JSON, timeout=TIMEOUT),
         400, "json_too_deep"),
        ("100,000-deep JSON, OIP", post(oip(url), data=DEEP, headers=JSON, timeout=TIMEOUT), 400, "json_too_deep"),
        ("100,000-deep JSON, KServe v1", post(predict, data=DEEP, headers=JSON, timeout=TIMEOUT),
         400, "json_too_deep"),
        ("OIP data 900 lists deep", post(oip(url), timeout=TIMEOUT, data=json.dumps(
            oip_body(json.loads("[" * 900 + '"img000.jpg"' + "]" * 900))), headers=JSON), 400, "invalid_tensor"),
        ("a lone surrogate in an image name", post(f"{url}/v1/embeddings", headers=JSON, timeout=TIMEOUT,
                                                   data=b'{"images": ["http://127.0.0.1:9/\\ud800.jpg"]}'),
         400, "invalid_json"),
        ("a lone surrogate in OIP data", post(oip(url), headers=JSON, timeout=TIMEOUT,
                                              data=json.dumps(oip_body(["x"])).replace('"x"', '"\\udfff"').encode()),
         400, "invalid_json"),
        ("OIP timeout of 401 digits", post(oip(url), headers=JSON, timeout=TIMEOUT, data=json.dumps(
            oip_body(["img000.jpg"], parameters={"timeout": 10**400})).encode()), 400, "invalid_json"),
        ("an OIP output asked for twice", post(oip(url), timeout=TIMEOUT, json=oip_body(
            ["img000.jpg"], outputs=[{"name": "EMBEDDING"}] * 40_000)), 400, "duplicate_output"),
        ("1.5 million one-letter strings", post(f"{url}/v1/embeddings", headers=JSON, timeout=TIMEOUT,
                                                data=b'{"images": ["img000.jpg"], "x": [' + b",".join(
                                                    [b'"a"'] * 1_500_000) + b"]}"), 413, "json_too_complex"),
        ("200,000 empty arrays", post(f"{url}/v1/embeddings", data=brackets, headers=JSON, timeout=TIMEOUT),
         413, "json_too_complex"),
        ("a 1 MB string with an escape", post(f"{url}/v1/embeddings", headers=JSON, timeout=TIMEOUT, data=(
            b'{"images": ["img000.jpg"], "x": "' + b"a" * 500_000 + b"\\n" + b"a" * 500_000 + b'"}')),
         400, "invalid_json"),
        ("a 1 MB string that is not UTF-8", post(f"{url}/v1/embeddings", headers=JSON, timeout=TIMEOUT, data=(
            b'{"images": ["img000.jpg"], "x": "' + b"\xff" * 1_000_000 + b'"}')), 400, "invalid_json"),
        ("a 1 MB data: URL among 30,000 items", post(f"{url}/v1/classify", headers=JSON, timeout=TIMEOUT, data=(
            json.dumps({"images": ["data:image/jpeg;base64," + "A" * 1_000_000], "x": [1] * 30_000}).encode())),
         413, "json_too_complex"),
        ("a form part with no name, native", post(f"{url}/v1/embeddings", data=nameless, headers=form,
                                                   timeout=TIMEOUT), 400, "unnamed_form_part"),
        ("a form part with no name, TorchServe", post(f"{url}/predictions/{E2E_MODEL}", data=nameless,
                                                       headers=form, timeout=TIMEOUT), 400, "unnamed_form_part"),
        *[(f"Content-Encoding br on {path}", post(f"{url}{path}", data=b'{"images": ["img000.jpg"]}',
                                                  headers={**JSON, "Content-Encoding": "br"}, timeout=TIMEOUT),
           415, "unsupported_content_encoding")
          for path in ("/v1/embeddings", "/v1/classify", f"/v1/models/{E2E_MODEL}:predict",
                       f"/predictions/{E2E_MODEL}")],
        *gzip_cases(url),
        *native_gzip_cases(url),
    ]


def test_hostile_bodies_get_their_codes_and_the_workers_answer_after(server: GunicornServer) -> None:
    pids = server.worker_pids()
    for what, response, status, code in hostile(server.url):
        got = code_of(response) if response.status_code >= 400 else ""
        assert (response.status_code, got) == (status, code), f"{what}: {response.text[:300]}"
        assert int(response.headers["X-Worker-PID"]) in pids, what
    assert server.worker_pids() == pids and server.healthz_pids() == pids
    ok = requests.post(f"{server.url}/v1/embeddings", json={"images": ["img000.jpg"]}, timeout=TIMEOUT)
    assert ok.status_code == 200 and int(ok.headers["X-Worker-PID"]) in pids
    assert "Traceback" not in server.log() and "RecursionError" not in server.log()


@pytest.fixture(scope="module")
def default_cap(weights_file: Path, image_host: ImageHost) -> Iterator[GunicornServer]:
    """One worker at the default body cap (64 MiB): the e2e servers' 8 MiB cannot reach the skeleton's bound."""
    env = e2e_env(weights_file, image_host, GREENSERVE_MAX_BODY_BYTES=str(Settings().max_body_bytes))
    with GunicornServer(env, workers=1) as srv:
        yield srv


def test_a_body_of_strings_just_short_of_long_is_413_and_the_worker_answers_after(default_cap: GunicornServer
                                                                                  ) -> None:
    pids = default_cap.worker_pids()
    body = json.dumps({"images": ["img000.jpg"], "x": ["a" * (LONG - 1)] * (MAX_SKELETON // LONG + 1)}).encode()
    r = requests.post(f"{default_cap.url}/v1/embeddings", data=body, headers=JSON, timeout=TIMEOUT)
    assert (r.status_code, code_of(r)) == (413, "json_too_complex"), r.text[:300]
    assert int(r.headers["X-Worker-PID"]) in pids and default_cap.healthz_pids() == pids
    ok = requests.post(f"{default_cap.url}/v1/embeddings", json={"images": ["img000.jpg"]}, timeout=TIMEOUT)
    assert ok.status_code == 200 and int(ok.headers["X-Worker-PID"]) in pids


def test_long_data_urls_with_escaped_slashes_embed_as_the_plain_ones_on_every_json_route(server: GunicornServer
                                                                                       ) -> None:
    """Long strings skip orjson (see json_body); PHP's json_encode writes every / of the base64 as \\/."""
    b64 = base64.b64encode(images.jpeg(1024, 768, seed=3)).decode()
    assert len(b64) > 200_000 and "/" in b64
    data_url = f"data:image/jpeg;base64,{b64}"
    bodies = {"native": ("/v1/embeddings", {"images": [data_url, "img001.jpg"]}),
              "KServe v1": (f"/v1/models/{E2E_MODEL}:predict", {"instances": [{"b64": b64}]}),
              "OIP": (f"/v2/models/{E2E_MODEL}/infer", oip_body([b64], outputs=[{"name": "EMBEDDING"}]))}
    for what, (path, doc) in bodies.items():
        plain = requests.post(server.url + path, json=doc, timeout=TIMEOUT)
        escaped = requests.post(server.url + path, data=json.dumps(doc).replace("/", "\\/"), headers=JSON,
                                timeout=TIMEOUT)
        assert plain.status_code == escaped.status_code == 200, (what, escaped.text[:300])
        volatile = {"request_id": None, "timings_ms": None, "id": None, "parameters": None}
        assert plain.json() | volatile == escaped.json() | volatile, what


def test_a_newline_in_an_image_url_cannot_forge_a_log_line(server: GunicornServer, image_host: ImageHost) -> None:
    url = f"{image_host.base_url}/missing-{id(server)}.jpg\n{FORGED}"
    r = requests.post(f"{server.url}/v1/embeddings", json={"images": [url]}, timeout=TIMEOUT)
    assert r.status_code == 422
    log = server.log()
    assert f"missing-{id(server)}.jpg" in log  # the fetch failure was logged ...
    assert not any(line.startswith(FORGED) for line in log.splitlines())  # ... on one line, escaped
    assert f"missing-{id(server)}.jpg\\x0a{FORGED}" in log


@pytest.mark.parametrize(("header", "status"), [
    (f"Bearer {GUARD_TOKEN}", 200), (f"bearer {GUARD_TOKEN}", 200), (f"BEARER  {GUARD_TOKEN}", 200),
    (GUARD_TOKEN, 401), (f"Basic {GUARD_TOKEN}", 401), (f"Bearer {GUARD_TOKEN}x", 401), ("Bearer", 401)])
def test_the_token_scheme_is_case_insensitive_and_required(guarded: GunicornServer, header: str,
                                                           status: int) -> None:
    r = requests.post(f"{guarded.url}/v1/embeddings", json={"images": ["img000.jpg"]}, timeout=TIMEOUT,
                      headers={"Authorization": header})
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["error"]["code"] == "unauthorized"
