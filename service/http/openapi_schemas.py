"""The schemas of the native API's bodies, for ``openapi.py``.

Requests are built from the parsers' own field lists (``inputs.OPTION_FIELDS``, ``text_options.TASK_FIELDS``,
``openai.FIELDS``) and this server's limits (``GREENSERVE_MAX_IMAGES`` is ``maxItems``, ...): a field the
parsers accept and this module has no schema for is a ``KeyError`` when the document is built, so none can
go undocumented. Responses describe what the views and the orchestrator write; ``tests/unit/http/test_openapi.py``
validates real responses against them.
"""

from __future__ import annotations

from typing import Any

from service.http.protocols import openai
from service.pipeline.inputs import OPTION_FIELDS
from service.pipeline.requests import DEFAULT_TOP_K
from service.pipeline.text_options import DEFAULT_TEMPLATE, TASK_FIELDS
from service.settings import Settings

Schema = dict[str, Any]

TASKS = tuple(TASK_FIELDS)  # embeddings, classify, rank: one route each
REQUIRED = {"rank": ("query",)}  # besides images: what a task cannot do without
STAGES = ("text", "fetch", "decode", "queue", "inference", "total")  # the keys of timings_ms
CODE_PATTERN = "^[a-z][a-z0-9_]*$"  # error codes are stable snake_case
# an 8x8 PNG: the document's examples run a real decode and forward
EXAMPLE_IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAAFUlEQVR42mM8UaHBgA0"
                 "wMeAAg1MCAB4nAXgllso1AAAAAElFTkSuQmCC")
_NONBLANK = r"\S"  # the parsers strip strings and refuse what is left empty


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(properties: dict[str, Schema], required: tuple[str, ...] | list[str] = (), **extra: Any) -> Schema:
    """A closed object: what it does not list is refused (requests) or never written (responses)."""
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False,
            **extra}


def _integer(minimum: int = 0, **extra: Any) -> Schema:
    return {"type": "integer", "minimum": minimum, **extra}


def _boolean(default: bool, description: str) -> Schema:
    return {"type": "boolean", "default": default, "description": description}


# ---------------------------------------------------------------------- requests


def fields(settings: Settings, task: str) -> dict[str, Schema]:
    """Every field of a native request, by name, for ``task``'s route."""
    return {
        "images": {"type": "array", "items": ref("ImageRef"), "minItems": 1, "maxItems": settings.max_images,
                   "description": "at most GREENSERVE_MAX_IMAGES; more is 413 too_many_images"},
        "top_k": _integer(1, maximum=settings.max_top_k, default=settings.max_top_k if task == "rank" else DEFAULT_TOP_K,
                          description="labels per image (classify), images returned (rank)"),
        "normalize": _boolean(True, "L2-normalise the embeddings"),
        "partial": _boolean(False, "true: 200 with the good images' results and an errors list; false: any "
                                   "unusable image fails the request (422, per-image details)"),
        "texts": {"type": "array", "items": ref("Text"), "minItems": 1, "maxItems": settings.max_texts,
                  "description": "text embeddings instead of images (models with a text tower)"},
        "truncate": _boolean(True, "cut texts past the context length (false: 400 over_context_length)"),
        "labels": {"type": "array", "items": ref("Text"), "minItems": 1, "maxItems": settings.max_labels,
                   "uniqueItems": True, "description": "zero-shot labels (models with a text tower)"},
        "template": {"type": "string", "pattern": r"\{\}", "maxLength": settings.max_text_chars,
                     "default": DEFAULT_TEMPLATE, "description": 'one "{}" where each label goes; only with labels'},
        "query": {**ref("Text"), "description": "the text the images are ranked by"},
        "model": {"type": "string", "pattern": _NONBLANK, "description": "a served model's name (GET /v1/models); "
                  "without it, the default (the first of GREENSERVE_MODELS)"},
    }


def json_request(settings: Settings, task: str) -> Schema:
    """The native JSON body (images, or texts for embeddings; OpenAI's form too on /v1/embeddings)."""
    schemas = fields(settings, task)
    names = ("images", *OPTION_FIELDS, *TASK_FIELDS[task])
    required = REQUIRED.get(task, ())
    alternatives = [obj({n: schemas[n] for n in names if n != "texts"}, ("images", *required))]
    if "texts" in names:
        alternatives.append(obj({n: schemas[n] for n in names if n != "images"}, ("texts", *required)))
    if task == "embeddings":
        alternatives.append(ref("OpenAIEmbeddingsRequest"))
    return alternatives[0] if len(alternatives) == 1 else {"oneOf": alternatives}


def form_request(settings: Settings, task: str) -> Schema:
    """multipart/form-data: files in the field ``images`` (repeated), options as form fields."""
    schemas = fields(settings, task)
    schemas["images"] = {**schemas["images"], "items": {"type": "string", "format": "binary"}}
    names = ("images", *OPTION_FIELDS, *(f for f in TASK_FIELDS[task] if f != "texts"))
    return obj({n: schemas[n] for n in names}, ("images", *REQUIRED.get(task, ())))


def openai_request(settings: Settings, models: list[str], dim: int | None) -> Schema:
    """``POST /v1/embeddings {"model", "input"}``, as the openai SDK sends it, for the ``models`` names served
    and their embedding ``dim`` (None while the model loads: any)."""
    item = {"anyOf": [ref("ImageRef"), ref("InputObject")]}
    schemas = fields(settings, "embeddings")
    properties: dict[str, Schema] = {
        "model": {"enum": models, "default": models[0], "description": "any other name is 404 model_not_found"},
        "input": {"anyOf": [ref("ImageRef"), ref("InputObject"), {
            "type": "array", "items": item, "minItems": 1, "maxItems": max(settings.max_images, settings.max_texts),
            "description": "at most GREENSERVE_MAX_IMAGES images or GREENSERVE_MAX_TEXTS texts"}]},
        "encoding_format": {"enum": list(openai.ENCODINGS), "default": "float"},
        "dimensions": {"type": "integer", **({"enum": [dim]} if dim else {}),
                       "description": "the model's embedding_dim (embeddings are not shortened)"},
        "user": {"type": "string", "description": "accepted and ignored"},
        "modality": {"enum": ["image", "text"],
                     "description": "what the strings in input are; unset, texts on a model with a text tower "
                                    "(CLIP), images otherwise"},
        **{k: schemas[k] for k in ("normalize", "partial", "truncate")},
    }
    return obj({name: properties[name] for name in openai.FIELDS}, ("input",))


def input_object() -> Schema:
    """One OpenAI ``input`` item given as an object: an image under one of its keys, or ``{"text": ...}``."""
    url: Schema = {"type": "string", "pattern": _NONBLANK}
    part = {"anyOf": [url, {"type": "object", "properties": {"url": url}, "required": ["url"]}]}  # chat's form
    images = [obj({key: part if key == "image_url" else url, "type": {"type": "string"}}, (key,))
              for key in openai.IMAGE_KEYS]  # the keys the OpenAI parser reads an image from
    text = obj({"text": ref("Text"), "type": {"const": "text"}}, ("text",))
    return {"oneOf": [*images, text]}


def request_schemas(settings: Settings, models: list[str], dim: int | None = None) -> dict[str, Schema]:
    schemas: dict[str, Schema] = {
        "ImageRef": {"type": "string", "pattern": _NONBLANK, "examples": ["img001.jpg", EXAMPLE_IMAGE],
                     "description": "an http(s) URL, a name relative to GREENSERVE_IMAGE_BASE_URL, or a "
                                    "data: URL (base64)"},
        "Text": {"type": "string", "pattern": _NONBLANK, "maxLength": settings.max_text_chars,
                 "description": "at most GREENSERVE_MAX_TEXT_CHARS characters; more is 413 text_too_long"},
        "InputObject": input_object(),
        "OpenAIEmbeddingsRequest": openai_request(settings, models, dim),
    }
    for task in TASKS:
        schemas[f"{task.capitalize()}Request"] = json_request(settings, task)
        schemas[f"{task.capitalize()}Form"] = form_request(settings, task)
    return schemas


# ---------------------------------------------------------------------- responses


def _items_response(item: str, *, openai_keys: bool = False) -> Schema:
    properties: dict[str, Schema] = {
        "model": {"type": "string"}, "data": {"type": "array", "items": ref(item)},
        "errors": {"type": "array", "items": ref("ImageErrorItem"),
                   "description": "the unusable images (partial: true)"},
        "timings_ms": ref("Timings"), "request_id": {"type": "string"}}
    if openai_keys:
        properties |= {"object": {"const": "list"}, "usage": obj(
            {"prompt_tokens": _integer(), "total_tokens": _integer()}, ("prompt_tokens", "total_tokens"))}
    return obj(properties, tuple(properties))


def _model_card() -> Schema:
    size = obj({"resize": _integer(1), "crop": _integer(1)}, ("resize", "crop"))
    triple = {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3}
    preprocessing = obj({**size["properties"], "resize_mode": {"type": "string"}, "interpolation": {"type": "string"},
                         "mean": triple, "std": triple, "exact": {"type": "boolean"}},
                        ("resize", "crop", "resize_mode", "interpolation", "mean", "std", "exact"))
    text = obj({"context_length": {"type": ["integer", "null"]}, "over_context_length": {"type": "string"},
                "logit_scale": {"type": "number"}, "logit_bias": {"type": "number"}},
               ("context_length", "over_context_length", "logit_scale", "logit_bias"))
    string = {"type": "string"}
    dtypes = {"enum": ["float32", "bfloat16", "float16"]}
    number, numbers = {"type": "number"}, {"type": "array", "items": {"type": "number"}}
    trial = obj({"numerics": string, "sizes": {"type": "array", "items": _integer(1)}, "ms": numbers,
                 "ms_float32": numbers, "speedup": number, "min_cosine": {"type": ["number", "null"]},
                 "top1_same": {"type": ["integer", "null"]}, "compared": _integer(), "agrees": {"type": "boolean"},
                 "error": {"type": ["string", "null"]}, "min_cosine_bound": number},
                ("numerics", "sizes", "ms", "ms_float32", "speedup", "min_cosine", "top1_same", "compared", "agrees",
                 "error", "min_cosine_bound"))
    tower = obj({"numerics": string, "reason": string, "sizes": {"type": "array", "items": _integer(1)},
                 "ms": numbers, "trials": {"type": "array", "items": trial}}, ("numerics", "reason", "sizes", "ms", "trials"),
                description="float32, or a lower dtype by autocast or with the weights cast once")
    precision = obj({"requested": {"enum": ["auto", "float32", "bfloat16", "float16"]}, "chosen": dtypes,
                     "hardware": string, "reason": string,
                     "source": {"enum": ["measured", "server", "fleet", "pinned", "hardware"],
                                "description": "where this worker got the choice: timed here, an earlier worker's "
                                               "of this server, the fleet's record in the shared cache, "
                                               "GREENSERVE_DTYPE, or float32 untried on this hardware"},
                     "measured_by": {"type": "string", "description": "host and pid of the worker that timed it"},
                     "min_cosine": number, "min_speedup": number, "tie_margin": number,
                     "towers": obj({"image": tower, "text": tower}, ("image",))},
                    ("requested", "chosen", "hardware", "reason", "source", "measured_by", "min_cosine", "min_speedup",
                     "tie_margin", "towers"),
                    description="GREENSERVE_DTYPE and what each tower chose on this worker's hardware, and why")
    properties = {
        "id": string, "object": {"const": "model"}, "created": _integer(), "owned_by": string,
        "ready": {"const": True}, "state": {"const": "ready"}, "name": string, "model": string, "family": string,
        "towers": {"type": "array", "items": {"enum": ["image", "text"]}},
        "tasks": {"type": "array", "items": {"enum": list(TASKS)}}, "embedding_dim": {"type": ["integer", "null"]},
        "labels_count": _integer(), "device": string, "dtype": string, "weights": string, "format": string,
        "input": size, "preprocessing": preprocessing, "load_seconds": {"type": "number", "minimum": 0}, "text": text,
        "precision": precision, "jpeg_decode": {"enum": ["pillow", "device"]},
        "residency": _residency(),
        "weights_digest": {"type": "string", "description": "sha256 of the loaded tensors (32 hex digits): the "
                           "embedding cache keys its entries with it"}}
    return obj(properties, [name for name in properties if name not in ("text", "precision")])


def _residency() -> Schema:
    tower = obj({"residency": {"type": "string", "pattern": "^(pinned|lazy|ttl:.+)$"},
                 "state": {"enum": ["resident", "unloaded"]}}, ("residency", "state"))
    return {"type": "object", "additionalProperties": tower,
            "description": "each tower: how it stays in memory (docs/MODELS.md) and whether it is now"}


def _probes() -> dict[str, Schema]:
    pid = _integer(1)
    string = {"type": "string"}
    return {
        "Health": obj({"status": {"const": "ok"}, "pid": pid}, ("status", "pid")),
        "Ready": obj({"status": {"const": "ready"}, "pid": pid, "model": string,
                      "models": {"type": "array", "items": string, "minItems": 1}}, ("status", "pid", "model", "models")),
        "NotReady": obj({"status": {"const": "not_ready"}, "pid": pid, "reason": string}, ("status", "pid", "reason")),
        "ModelList": obj({"object": {"const": "list"}, "models": {"type": "array", "items": string},
                          "data": {"type": "array", "items": {"oneOf": [ref("ModelCard"), ref("ModelCardLoading")]},
                                   "minItems": 1}},
                         ("object", "models", "data")),
        "ModelCardLoading": obj({"id": string, "object": {"const": "model"}, "created": _integer(), "owned_by": string,
                                 "name": string, "model": string, "ready": {"const": False},
                                 "state": {"enum": ["loading", "failed", "unloaded"]}},
                                ("id", "object", "created", "owned_by", "name", "model", "ready", "state"),
                                description="a served model not loaded (yet) on this worker"),
        "ModelListLoading": obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref("ModelCardLoading")},
                                 "models": {"type": "array", "items": string}, "status": {"const": "loading"}},
                                ("object", "data", "models", "status")),
        "Model": obj({"id": string, "object": {"const": "model"}, "created": _integer(), "owned_by": string,
                      "name": string, "ready": {"const": True}},
                     ("id", "object", "created", "owned_by", "name", "ready")),
        "ModelLoading": obj({"id": string, "name": string, "object": {"const": "model"}, "ready": {"const": False},
                             "error": string}, ("id", "name", "object", "ready", "error")),
        "OpenAPI": {"type": "object", "required": ["openapi", "info", "paths"]},
    }


def response_schemas() -> dict[str, Schema]:
    index, string = _integer(), {"type": "string"}
    score = {"type": "number", "minimum": 0, "maximum": 1}
    cosine = {"type": "number", "minimum": -1, "maximum": 1}
    vector = {"oneOf": [{"type": "array", "items": {"type": "number"}},
                        {"type": "string", "contentEncoding": "base64", "description": "little-endian float32"}]}
    return {
        "ImageErrorItem": obj({"index": index, "image": string, "code": {"type": "string", "pattern": CODE_PATTERN},
                               "message": string, "upstream_status": _integer(100, maximum=599)},
                              ("index", "image", "code", "message")),
        "Timings": {"type": "object", "propertyNames": {"enum": list(STAGES)}, "required": ["total"],
                    "additionalProperties": {"type": "number", "minimum": 0}},
        "EmbeddingItem": obj({"index": index, "image": string, "embedding": vector, "object": {"const": "embedding"},
                              "tokens": index, "truncated": {"type": "boolean"}}, ("index", "embedding", "object")),
        "Label": obj({"label": string, "class_id": index, "score": score, "cosine": cosine},
                     ("label", "class_id", "score")),
        "ClassifyItem": obj({"index": index, "image": string, "labels": {"type": "array", "items": ref("Label")}},
                            ("index", "image", "labels")),
        "RankItem": obj({"index": index, "image": string, "score": cosine}, ("index", "image", "score")),
        "EmbeddingsResponse": _items_response("EmbeddingItem", openai_keys=True),
        "ClassifyResponse": _items_response("ClassifyItem"),
        "RankResponse": _items_response("RankItem"),
        "Error": obj({"error": obj({
            "code": {"type": "string", "pattern": CODE_PATTERN}, "message": {"type": "string", "minLength": 1},
            "details": {"type": "array", "items": ref("ImageErrorItem")},
            "type": {"enum": ["invalid_request_error", "server_error"]}, "param": {"type": "null"}},
            ("code", "message", "details", "type", "param")), "request_id": string}, ("error", "request_id")),
        "ModelCard": _model_card(),
        **_probes(),
    }
