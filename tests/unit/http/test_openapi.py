"""The OpenAPI document: valid, built from the code (routes, parsers' fields, limits, error tree), and true of
real responses (the fake model's app answers, each answer is checked against the document)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import re
from typing import Any

import jsonschema_rs
import pytest
import schemathesis
from flask import Flask
from flask.testing import FlaskClient
from PIL import Image
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.definitions import OPENAPI_31
from werkzeug.test import TestResponse

from harness import images
from harness.fakes import FakeFetcher, FakeModel
from service.app import create_app
from service.engine.types import Precision, TowerChoice, Trial
from service.errors import GreenserveError
from service.http.openapi import build
from service.http.protocols import openai
from service.pipeline.text_options import TASK_FIELDS
from service.settings import Settings

BASE = "http://cdn.test/"
PROTOCOL_BLUEPRINTS = ("oip", "kserve_v1", "torchserve", "immich", "static")  # described by their own specifications
ROUTING_STATUSES = {401, 404, 405}  # answered before a request is parsed, or only where a model is named
FORWARD_STATUSES = {501, 502}  # only immich's /predict answers them (a task forwarded, or none to forward to)


def solid(value: int) -> bytes:
    return images.encode(Image.new("RGB", (40, 40), (value, value, value)), "PNG")


def data_url(blob: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(blob).decode()


@pytest.fixture()
def app() -> Flask:
    fetcher = FakeFetcher({BASE + f"g{v}.png": solid(v) for v in (10, 200)} | {BASE + "html.jpg": images.HTML})
    settings = Settings(image_base_url=BASE, max_images=8, max_body_bytes=64 * 1024)
    return create_app(settings, model=FakeModel(), fetcher=fetcher)


@pytest.fixture()
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture()
def doc(client: FlaskClient) -> dict[str, Any]:
    return client.get("/openapi.json").json


def validator(doc: dict[str, Any], schema: dict[str, Any]) -> Any:
    """A JSON Schema 2020-12 validator for ``schema``, its $refs resolved in the document."""
    return jsonschema_rs.validator_for({**schema, "components": doc["components"]})


def assert_documented(doc: dict[str, Any], path: str, method: str, r: TestResponse) -> None:
    """``r`` is one of the responses the document gives the operation: status, media type, body, headers."""
    documented = doc["paths"][path][method]["responses"]
    assert str(r.status_code) in documented, f"{method} {path} answered an undocumented {r.status_code}"
    response = documented[str(r.status_code)]
    media_type = r.mimetype
    assert media_type in response["content"], f"{media_type} is not documented for {r.status_code}"
    schema = response["content"][media_type]["schema"]
    body = r.json if media_type == "application/json" else r.get_data(as_text=True)
    errors = [e.message for e in validator(doc, schema).iter_errors(body)]
    assert not errors, f"{method} {path} {r.status_code}: {errors}\n{body}"
    for name, header in response["headers"].items():
        spec = doc["components"]["headers"][header["$ref"].rsplit("/", 1)[1]]
        value = r.headers.get(name)
        assert value is not None or not spec["required"], f"{name} missing from a {r.status_code}"
        assert value is None or re.search(spec["schema"]["pattern"], value), f"{name}: {value!r}"


# ---------------------------------------------------------------------- the document itself


def test_document_is_served_and_is_the_built_one(app: Flask, doc: dict[str, Any]) -> None:
    plane = app.extensions["greenserve"]
    assert doc == json.loads(json.dumps(build(plane.settings, plane.info)))
    assert doc["openapi"] == "3.1.0" and doc["info"]["version"]


def test_document_is_valid_openapi_3_1_and_loads_in_schemathesis(doc: dict[str, Any]) -> None:
    errors = [e.message for e in jsonschema_rs.validator_for(OPENAPI_31).iter_errors(doc)]
    assert not errors
    for name, schema in doc["components"]["schemas"].items():
        assert jsonschema_rs.meta.is_valid(schema), name
    operations = list(schemathesis.openapi.from_dict(doc).get_all_operations())
    assert len(operations) == 9 and all(isinstance(op, Ok) for op in operations)


def test_documented_routes_are_the_apps_native_url_rules(app: Flask, doc: dict[str, Any]) -> None:
    rules = {(re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method.lower())
             # the page at / is HTML for people, not part of the API the document describes
             for rule in app.url_map.iter_rules() if rule.endpoint.partition(".")[0] not in (*PROTOCOL_BLUEPRINTS, "ui")
             for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}}
    documented = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert documented == rules


def _allowed(r: TestResponse, after: str) -> set[str]:
    """The field names a parser lists in its "unknown field" error, after ``after``."""
    assert r.status_code == 400, r.json
    return set(r.json["error"]["message"].split(after, 1)[1].split(", "))


def _properties(doc: dict[str, Any], name: str) -> set[str]:
    schema = doc["components"]["schemas"][name]
    alternatives = [s for s in schema.get("oneOf", [schema]) if "$ref" not in s]  # the OpenAI form has its own
    return {p for s in alternatives for p in s["properties"]}


@pytest.mark.parametrize("task", TASK_FIELDS)
def test_documented_request_fields_are_what_the_parsers_accept(client: FlaskClient, doc: dict[str, Any],
                                                               task: str) -> None:
    r = client.post(f"/v1/{task}", json={"images": ["g10.png"], "not_a_field": 1})
    assert _properties(doc, f"{task.capitalize()}Request") == _allowed(r, "allowed: ")
    r = client.post(f"/v1/{task}", data={"images": [(io.BytesIO(solid(10)), "a.png")], "not_a_field": "1"},
                    content_type="multipart/form-data")
    assert _properties(doc, f"{task.capitalize()}Form") - {"images"} == _allowed(r, "options among ")


def test_documented_openai_fields_are_what_its_parser_accepts(client: FlaskClient, doc: dict[str, Any]) -> None:
    r = client.post("/v1/embeddings", json={"input": "g10.png", "not_a_field": 1})
    assert _properties(doc, "OpenAIEmbeddingsRequest") == _allowed(r, "allowed: ") == set(openai.FIELDS)
    model = doc["components"]["schemas"]["OpenAIEmbeddingsRequest"]["properties"]["model"]
    assert model["enum"] == ["fake", "fake-embedding"]
    assert doc["components"]["schemas"]["OpenAIEmbeddingsRequest"]["properties"]["dimensions"]["enum"] == [6]


def test_limits_come_from_the_settings() -> None:
    settings = Settings(max_images=3, max_top_k=7, max_texts=11, max_labels=13, max_text_chars=17, max_body_bytes=4096)
    doc = build(settings)
    schemas = doc["components"]["schemas"]
    images, texts = schemas["EmbeddingsRequest"]["oneOf"][:2]
    assert images["properties"]["images"]["maxItems"] == schemas["ClassifyForm"]["properties"]["images"]["maxItems"] == 3
    assert images["properties"]["top_k"]["maximum"] == 7 and schemas["RankRequest"]["properties"]["top_k"]["default"] == 7
    assert texts["properties"]["texts"]["maxItems"] == 11
    assert schemas["ClassifyRequest"]["properties"]["labels"]["maxItems"] == 13
    assert schemas["Text"]["maxLength"] == schemas["ClassifyRequest"]["properties"]["template"]["maxLength"] == 17
    assert "4096 bytes" in doc["info"]["description"]
    assert schemas["OpenAIEmbeddingsRequest"]["properties"]["model"]["enum"] == ["resnet50", "resnet50-embedding"]


def _error_tree(cls: type[GreenserveError] = GreenserveError) -> set[type[GreenserveError]]:
    return {cls} | {c for sub in cls.__subclasses__() for c in _error_tree(sub)}


@pytest.mark.parametrize("task", TASK_FIELDS)
def test_every_status_of_the_error_tree_is_documented_for_inference(doc: dict[str, Any], task: str) -> None:
    statuses = {cls.status_code for cls in _error_tree()}
    assert {413, 415, 422, 499, 503, 504} <= statuses  # the tree is what this test thinks it is
    documented = {int(s) for s in doc["paths"][f"/v1/{task}"]["post"]["responses"]}
    assert statuses - ROUTING_STATUSES - FORWARD_STATUSES <= documented - {200}
    assert 404 in documented  # every request body may name a model
    assert doc["paths"][f"/v1/{task}"]["post"]["responses"]["503"]["headers"]["Retry-After"]


def test_a_token_adds_bearer_security_and_401_to_v1_routes_only() -> None:
    assert "securitySchemes" not in build(Settings())["components"]
    doc = build(Settings(api_token="s3cret"))
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, item in doc["paths"].items():
        for operation in item.values():
            guarded = path.startswith("/v1/")
            assert ("security" in operation) == guarded == ("401" in operation["responses"]), path


def test_document_needs_no_token_and_the_401_is_documented() -> None:
    client = create_app(Settings(api_token="s3cret"), model=FakeModel(), fetcher=FakeFetcher({})).test_client()
    r = client.get("/openapi.json")
    assert r.status_code == 200 and "bearer" in r.json["components"]["securitySchemes"]
    denied = client.get("/v1/models")
    assert denied.status_code == 401
    assert_documented(r.json, "/v1/models", "get", denied)


# ---------------------------------------------------------------------- real responses against the document

PNG = data_url(solid(200))
EXCHANGES = [
    ("embeddings", "post", "/v1/embeddings", {"json": {"images": ["g10.png", PNG]}}, 200),
    ("embeddings_partial", "post", "/v1/embeddings", {"json": {"images": ["g10.png", "html.jpg", "nope.png"],
                                                               "partial": True}}, 200),
    ("openai_base64", "post", "/v1/embeddings", {"json": {"model": "fake-embedding", "input": [{"image": PNG}],
                                                          "encoding_format": "base64"}}, 200),
    ("openai_wrong_model", "post", "/v1/embeddings", {"json": {"model": "gpt", "input": PNG}}, 404),
    ("openai_model_not_a_string", "post", "/v1/embeddings", {"json": {"model": {}, "input": PNG}}, 400),
    ("native_wrong_model", "post", "/v1/classify", {"json": {"model": "gpt", "images": ["g200.png"]}}, 404),
    ("texts_without_text_tower", "post", "/v1/embeddings", {"json": {"texts": ["a dog"]}}, 400),
    ("classify", "post", "/v1/classify", {"json": {"images": ["g200.png"], "top_k": 3}}, 200),
    ("classify_multipart", "post", "/v1/classify", {"data": {"images": [(io.BytesIO(solid(10)), "a.png")]},
                                                    "content_type": "multipart/form-data"}, 200),
    ("rank_without_text_tower", "post", "/v1/rank", {"json": {"images": ["g10.png"], "query": "a dog"}}, 400),
    ("unusable_images", "post", "/v1/classify", {"json": {"images": ["g10.png", "html.jpg"]}}, 422),
    ("too_many_images", "post", "/v1/embeddings", {"json": {"images": ["g10.png"] * 9}}, 413),
    ("body_too_large", "post", "/v1/embeddings", {"data": b"x" * (65 * 1024), "content_type": "application/json"}, 413),
    ("not_json", "post", "/v1/classify", {"data": b"{", "content_type": "application/json"}, 400),
    ("text_plain", "post", "/v1/rank", {"data": b"hello", "content_type": "text/plain"}, 415),
    ("bad_deadline_header", "post", "/v1/embeddings", {"json": {"images": ["g10.png"]},
                                                       "headers": {"X-Request-Timeout": "soon"}}, 400),
    ("models", "get", "/v1/models", {}, 200),
    ("model", "get", "/v1/models/fake-embedding", {}, 200),
    ("no_such_model", "get", "/v1/models/gpt", {}, 404),
    ("healthz", "get", "/healthz", {"headers": {"X-Request-ID": "<script>"}}, 200),
    ("readyz", "get", "/readyz", {}, 200),
    ("metrics", "get", "/metrics", {}, 200),
    ("openapi", "get", "/openapi.json", {}, 200),
]


def _template(doc: dict[str, Any], url: str) -> str:
    """The documented path that ``url`` is an instance of."""
    return next(p for p in doc["paths"] if re.fullmatch(re.sub(r"\{\w+\}", "[^/]+", p), url))


@pytest.mark.parametrize("method, url, kwargs, status", [e[1:] for e in EXCHANGES], ids=[e[0] for e in EXCHANGES])
def test_real_responses_match_the_document(client: FlaskClient, doc: dict[str, Any], method: str, url: str,
                                           kwargs: dict[str, Any], status: int) -> None:
    r = client.open(url, method=method.upper(), **kwargs)
    assert r.status_code == status, r.get_data(as_text=True)
    assert_documented(doc, _template(doc, url), method, r)


def test_failed_batch_and_passed_deadline_match_the_document() -> None:
    fetcher = FakeFetcher({BASE + "g100.png": solid(100), BASE + "g10.png": solid(10)})
    client = create_app(Settings(image_base_url=BASE), model=FakeModel(fail_when_batch_has=100),
                        fetcher=fetcher).test_client()
    failed = client.post("/v1/embeddings", json={"images": ["g100.png"]})
    assert failed.status_code == 500
    assert_documented(client.get("/openapi.json").json, "/v1/embeddings", "post", failed)
    client = create_app(Settings(image_base_url=BASE), model=FakeModel(delay_s=0.3), fetcher=fetcher).test_client()
    late = client.post("/v1/classify", json={"images": ["g10.png"]}, headers={"X-Request-Timeout": "0.05"})
    assert late.status_code == 504
    assert_documented(client.get("/openapi.json").json, "/v1/classify", "post", late)


def test_a_model_card_with_a_timed_precision_matches_the_document() -> None:
    """A card whose towers were timed (the trials, the served way's times) is documented field by field."""
    model = FakeModel()
    trial = Trial("bfloat16 cast once", (1, 8), (4.0, 20.0), (9.0, 60.0), 0.99999, 2, 9, min_cosine_bound=0.9995)
    image = TowerChoice("image", trial.numerics, "timed", (1, 8), (trial,), trial.ms)
    model.info = dataclasses.replace(model.info, precision=Precision("auto", "bfloat16", "cpu amx_bf16", "why", (image,)))
    client = create_app(Settings(image_base_url=BASE), model=model, fetcher=FakeFetcher({})).test_client()
    card = client.get("/v1/models")
    assert card.json["data"][0]["precision"]["towers"]["image"]["ms"] == [4.0, 20.0]
    assert_documented(client.get("/openapi.json").json, "/v1/models", "get", card)


def test_loading_responses_match_the_document(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the model has loaded (here: it never does), every route answers as documented."""
    def never_loads(*args: object) -> None:
        raise RuntimeError("not in this test")

    monkeypatch.setattr("service.app.load_for_worker", never_loads)
    client = create_app(Settings(model="resnet18", weights="random")).test_client()
    doc = client.get("/openapi.json").json
    assert "enum" not in doc["components"]["schemas"]["OpenAIEmbeddingsRequest"]["properties"]["dimensions"]
    for method, url, kwargs, status in [("post", "/v1/embeddings", {"json": {"images": [PNG]}}, 503),
                                        ("post", "/v1/classify", {"json": {"images": [PNG]}}, 503),
                                        ("get", "/v1/models", {}, 503), ("get", "/v1/models/resnet18", {}, 503),
                                        ("get", "/readyz", {}, 503), ("get", "/healthz", {}, 200)]:
        r = client.open(url, method=method.upper(), **kwargs)
        assert r.status_code == status, (url, r.get_data(as_text=True))
        assert_documented(doc, _template(doc, url), method, r)
