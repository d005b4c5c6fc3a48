"""OpenAI-compatible embeddings on the native routes: ``POST /v1/embeddings {"model", "input"}`` and
``GET /v1/models``, answered with supersets of the native bodies so that native callers and the openai SDK
read the same response.

A string is what OpenAI's clients mean by it: on a model with a text tower (CLIP) a text, as in OpenAI's
API, Infinity and vLLM, so LangChain and LlamaIndex embed documents and queries with no extra setting; a
text is never fetched. Images there come as objects (``{"image": ...}``, ``{"type": "image_url", ...}``)
or as strings with ``"modality": "image"`` (Infinity's parameter). On an image-only model a string is an
image reference (a URL, a data: URL or a relative name), as before; ``{"text": ...}`` items are texts
everywhere, and ``"modality": "text"`` says so for strings.
The SDK asks for ``"encoding_format": "base64"`` by default: little-endian float32, base64-encoded.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.engine.types import ModelInfo
from service.errors import RequestError
from service.http import model_names
from service.pipeline.inputs import base64_ref, check_count, is_reference, string_ref
from service.pipeline.requests import ImageRef, InferenceRequest
from service.pipeline.text_options import parse_text_options
from service.settings import Settings

FIELDS = ("model", "input", "encoding_format", "dimensions", "user", "modality", "normalize", "partial", "truncate")
ENCODINGS = ("float", "base64")
CREATED = int(time.time())  # OpenAI's ``created``: when this worker started
IMAGE_KEYS = ("image", "url", "image_url", "image_base64", "bytes", "b64")


@dataclass(frozen=True)
class Options:
    """What an OpenAI-shaped request asked for beyond the native request."""

    encoding_format: str = "float"


def is_openai(doc: Mapping[str, Any]) -> bool:
    return "input" in doc


def parse(doc: Mapping[str, Any], settings: Settings,
          models: Mapping[str, ModelInfo | None]) -> tuple[InferenceRequest, Options]:
    """OpenAI's body; ``models``: the served models' facts by name (None while one loads), the default first."""
    unknown = sorted(set(doc) - set(FIELDS))
    if "images" in doc or "texts" in doc:
        raise RequestError('send "input" (OpenAI) or "images"/"texts" (native), not both')
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(FIELDS)}")
    default = next(iter(models))
    model = model_names.resolve(list(models), doc.get("model", default)).model  # either name embeds; else 404
    info = models[model]
    encoding = doc.get("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise RequestError(f"encoding_format must be one of {', '.join(ENCODINGS)}; got {encoding!r}")
    _check_dimensions(doc.get("dimensions"), info)
    options = {k: doc[k] for k in ("normalize", "partial") if k in doc}
    for key, value in options.items():
        if not isinstance(value, bool):
            raise RequestError(f"{key} must be true or false; got {value!r}")
    items = _items(doc["input"])
    texts = _texts(items, doc.get("modality"), info is not None and "text" in info.towers)
    if texts is not None:
        text = parse_text_options({"texts": texts, **{k: doc[k] for k in ("truncate",) if k in doc}},
                                  "embeddings", settings)
        return InferenceRequest((), **options, text=text, model=model), Options(encoding)
    check_count(len(items), settings)
    refs = tuple(_image_ref(i, item, settings) for i, item in enumerate(items))
    return InferenceRequest(refs, **options, model=model), Options(encoding)


def _items(value: Any) -> list[Any]:
    items = [value] if isinstance(value, (str, dict)) else value
    if not isinstance(items, list) or not items:
        raise RequestError('"input" must be a string or a non-empty list of image URLs, data: URLs or objects')
    if all(isinstance(x, int) and not isinstance(x, bool) for x in items) or any(isinstance(x, list) for x in items):
        raise RequestError("token arrays are not accepted: send texts as strings and images as URLs or data: "
                           "URLs; LangChain's OpenAIEmbeddings sends tokens unless you set "
                           "check_embedding_ctx_length=False", code="token_input_not_supported")
    return items


def _texts(items: list[Any], modality: Any, strings_are_texts: bool) -> list[str] | None:
    """The texts of a request about texts; None for images. ``strings_are_texts``: the model has a text
    tower, so a plain string is a text unless ``"modality": "image"`` says otherwise."""
    if modality not in (None, "image", "text"):
        raise RequestError(f'modality must be "image" or "text"; got {modality!r}')
    if modality == "text":
        if not all(isinstance(x, str) for x in items):
            raise RequestError('with "modality": "text" every input must be a string')
        return list(items)
    text_items = [_text_of(x, strings_are_texts and modality is None) for x in items]
    if all(t is not None for t in text_items):
        if modality == "image":
            raise RequestError('"modality": "image" with {"text": ...} inputs; send images, or modality "text"')
        return [t for t in text_items if t is not None]
    if any(t is not None for t in text_items):
        raise RequestError("inputs mix texts and images; send one kind per request (on a model with a text "
                           'tower a string is a text: send images as {"image": "<url>"} or with "modality": '
                           '"image")')
    return None


def _text_of(item: Any, strings: bool) -> str | None:
    if strings and isinstance(item, str):
        return item
    if isinstance(item, dict) and set(item) - {"type"} == {"text"} and item.get("type", "text") == "text":
        return item["text"] if isinstance(item["text"], str) else ""
    return None


def _image_ref(index: int, item: Any, settings: Settings) -> ImageRef:
    if isinstance(item, str) and item.strip():
        return string_ref(index, item.strip(), settings)
    if isinstance(item, dict):
        keys = [k for k in IMAGE_KEYS if k in item]
        if len(keys) == 1 and set(item) - {"type"} == {keys[0]}:
            value = item[keys[0]]
            if isinstance(value, dict) and keys[0] == "image_url":
                value = value.get("url")  # the chat content-part form: {"image_url": {"url": ...}}
            if isinstance(value, str) and value.strip():
                return _string_or_base64(index, keys[0], value.strip(), settings)
    raise RequestError(f"input[{index}] must be an image URL, a data: URL, a relative name or an object "
                       '{"image": ...}, {"url": ...}, {"type": "image_url", "image_url": {"url": ...}} or '
                       '{"b64": ...}')


def _string_or_base64(index: int, key: str, value: str, settings: Settings) -> ImageRef:
    """``bytes``/``b64`` are always base64; ``image`` is a URL or data: URL, else bare base64 (Jina's form)."""
    if key in ("bytes", "b64"):
        return base64_ref(index, f"input[{index}]", value, settings)
    if key == "image" and not is_reference(value):
        return base64_ref(index, f"input[{index}]", value, settings)
    return string_ref(index, value, settings)


def _check_dimensions(dimensions: Any, info: ModelInfo | None) -> None:
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise RequestError(f"dimensions must be a whole number; got {dimensions!r}")
    if info is not None and info.embedding_dim is not None and dimensions != info.embedding_dim:
        raise RequestError(f"dimensions={dimensions}: {info.name} embeds in exactly {info.embedding_dim} dimensions "
                           "(its features are not shortened); drop dimensions", code="dimensions_not_supported")


def embeddings_body(body: dict[str, Any], req: InferenceRequest, options: Options | None) -> dict[str, Any]:
    """The native body plus OpenAI's ``object``/``usage`` keys (and base64 vectors when asked)."""
    b64 = options is not None and options.encoding_format == "base64"
    tokens = 0
    for item in body["data"]:
        item["object"] = "embedding"
        tokens += item.get("tokens", 0)
        if b64:
            item["embedding"] = base64.b64encode(np.asarray(item["embedding"], "<f4").tobytes()).decode()
    return {"object": "list", **body, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def model_card(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": CREATED, "owned_by": "greenserve"}


def models_body(models: Mapping[str, tuple[str, ModelInfo | None, str]],
                residency: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Native (``data[0]`` describes the default model), OpenAI (``data[].id``) and KServe v1 (``models``), for
    ``models``: each served name's (configured model, facts once loaded, state: ready | loading | failed), with
    each loaded model's towers' ``residency``."""
    data, ids = [], []
    for name, (spec, info, state) in models.items():
        public = {**info.public(), "name": name, "model": info.name, "residency": (residency or {}).get(name, {})} \
            if info else {"name": name, "model": spec}
        names = model_names.names(name, info.tasks) if info else [name]
        ids += names
        data += [{**public, **model_card(model_id), "ready": state == "ready", "state": state} for model_id in names]
    return {"object": "list", "models": ids, "data": data}
