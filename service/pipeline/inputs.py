"""Stage 0: a request body (JSON or multipart fields) → validated options and image references.

Knows nothing of Flask: the view hands over plain values. Problems with the request as a whole are
``RequestError``/``PayloadTooLarge``; problems with one image are attached to its reference as an
``ImageError`` so that ``partial`` can decide what happens to them.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urljoin, urlsplit

from service.errors import FetchError, ImageError, ImageTooLarge, NotAnImage, PayloadTooLarge, RequestError
from service.pipeline.json_body import GIL_STEP, load_json
from service.pipeline.requests import DEFAULT_TOP_K, ImageRef, InferenceRequest
from service.pipeline.text_options import TASK_FIELDS, parse_text_options
from service.settings import Settings

OPTION_FIELDS = ("top_k", "normalize", "partial", "model")
_DATA_URL_RE = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)"
                          r"(?P<b64>;base64)?,", re.IGNORECASE)
_LABEL_MAX = 200
TEXT_FORM_FIELDS = ("template", "query", "model")  # form fields that stay strings

def parse_json(body: bytes, settings: Settings, task: str = "embeddings") -> InferenceRequest:
    """``{"images": [...], "top_k": 5, "normalize": true, "partial": false}`` → request; ``task``'s text
    fields too (``texts`` instead of images for embeddings, ``labels`` for classify, ``query`` for rank)."""
    return parse_doc(load_json(body), settings, task)


def parse_doc(doc: Mapping[str, Any], settings: Settings, task: str = "embeddings") -> InferenceRequest:
    """The native JSON request, already loaded."""
    allowed = ("images", *OPTION_FIELDS, *TASK_FIELDS[task])
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")
    text = parse_text_options(doc, task, settings)
    if text.texts:
        if "images" in doc:
            raise RequestError('send "images" or "texts", not both: one request embeds one kind')
        return InferenceRequest((), **request_options(doc, settings), text=text)
    images = doc.get("images")
    if not isinstance(images, list) or not images:
        raise RequestError('"images" must be a non-empty list of URLs, relative names or data: URLs')
    check_count(len(images), settings)
    refs = []
    for i, item in enumerate(images):
        if not isinstance(item, str) or not item.strip():
            raise RequestError(f"images[{i}] must be a non-empty string (URL, relative name or data: URL)")
        refs.append(string_ref(i, item.strip(), settings))
    return InferenceRequest(tuple(refs), **request_options(doc, settings, task), text=text)


def parse_form(fields: Mapping[str, str], files: Sequence[tuple[str, bytes]], settings: Settings,
               task: str = "embeddings", labels: Sequence[str] = ()) -> InferenceRequest:
    """multipart/form-data: files in the field ``images`` (filename, bytes), options as form fields
    (``labels`` repeated: ``-F labels=cat -F labels=dog``)."""
    allowed = (*OPTION_FIELDS, *(f for f in TASK_FIELDS[task] if f != "texts"))
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise RequestError(f"unknown form field(s) {', '.join(map(repr, unknown))}; send files in the "
                           f"field 'images' and options among {', '.join(allowed)}")
    if not files:
        raise RequestError("no files in the form field 'images'; upload with -F images=@photo.jpg")
    check_count(len(files), settings)
    refs = [bytes_ref(i, filename or f"upload-{i}", data, settings) for i, (filename, data) in enumerate(files)]
    options = {k: v if k in TEXT_FORM_FIELDS else form_value(k, v) for k, v in fields.items()}
    if labels:
        options["labels"] = list(labels)
    text = parse_text_options(options, task, settings)
    return InferenceRequest(tuple(refs), **request_options(options, settings, task), text=text)


def check_count(n: int, settings: Settings) -> None:
    if n > settings.max_images:
        raise PayloadTooLarge(f"{n} images in one request; the limit is {settings.max_images}. Split the "
                              "request or set GREENSERVE_MAX_IMAGES", code="too_many_images")


def bytes_ref(index: int, name: str, data: bytes, settings: Settings) -> ImageRef:
    """An image whose bytes came in the request (an upload, a binary tensor element, base64)."""
    err = _size_error(len(data), settings)
    return ImageRef(index, name[:_LABEL_MAX], data=None if err else data, error=err)


def base64_ref(index: int, name: str, payload: str, settings: Settings) -> ImageRef:
    """Bare base64 (the KServe/TorchServe/TF Serving convention): checked against the byte cap first."""
    data = _decoded(payload, settings, NotAnImage, "not valid base64 ({exc}); send the image's bytes "
                    "base64-encoded, or a URL", "invalid_base64")
    if isinstance(data, ImageError):
        return ImageRef(index, name[:_LABEL_MAX], error=data)
    return bytes_ref(index, name, data, settings)


def is_reference(text: str) -> bool:
    """A string that names an image (http(s) or data: URL) rather than carrying it as bare base64."""
    return text[:8].lower().startswith(("http://", "https://", "data:"))


def string_ref(index: int, item: str, settings: Settings) -> ImageRef:
    """A URL, a relative name (joined to GREENSERVE_IMAGE_BASE_URL) or a data: URL."""
    if item[:5].lower() == "data:":
        return _data_ref(index, item, settings)
    scheme = urlsplit(item).scheme.lower()
    if scheme in ("http", "https"):
        return ImageRef(index, item[:_LABEL_MAX], url=item)
    if scheme:
        return ImageRef(index, item[:_LABEL_MAX], error=FetchError(
            f"scheme {scheme!r} is not fetched; use an http(s) URL, a data: URL or a relative name",
            code="invalid_url"))
    if not settings.image_base_url:
        return ImageRef(index, item[:_LABEL_MAX], error=FetchError(
            f"{item!r} is a relative name but no base URL is configured; send an absolute http(s) URL "
            "or set GREENSERVE_IMAGE_BASE_URL", code="invalid_url"))
    base = settings.image_base_url if settings.image_base_url.endswith("/") else settings.image_base_url + "/"
    return ImageRef(index, item[:_LABEL_MAX], url=urljoin(base, item.lstrip("/")))


def _data_ref(index: int, item: str, settings: Settings) -> ImageRef:
    label = item[:40] + "..." if len(item) > 40 else item
    match = _DATA_URL_RE.match(item)
    if not match or not match.group("b64"):
        return ImageRef(index, label, error=ImageError(
            "malformed data: URL; use data:image/jpeg;base64,<base64 bytes>", code="invalid_data_url"))
    data = _decoded(item[match.end():], settings, ImageError, "the data: URL is not valid base64 ({exc})",
                    "invalid_data_url")
    if isinstance(data, ImageError):
        return ImageRef(index, label, error=data)
    return ImageRef(index, label, data=data)


def _decoded(payload: str, settings: Settings, error: type[ImageError], message: str, code: str) -> bytes | ImageError:
    """Base64 → bytes, or the image's error (``message`` gets the decoder's ``{exc}``)."""
    # base64 inflates by 4/3: refuse before decoding what would exceed the byte cap anyway
    err = _size_error(len(payload) * 3 // 4 - 2, settings)
    if err:
        return err
    try:
        # in GIL_STEP pieces, which decode to the whole (one call would hold the GIL for the whole data: URL)
        return b"".join(base64.b64decode(payload[i:i + GIL_STEP], validate=True)
                        for i in range(0, len(payload), GIL_STEP))
    except (binascii.Error, ValueError) as exc:
        return error(message.format(exc=exc), code=code)


def _size_error(size: int, settings: Settings) -> ImageTooLarge | None:
    if size <= settings.max_image_bytes:
        return None
    return ImageTooLarge(f"image is {size} bytes; the limit is {settings.max_image_bytes} bytes. Send a "
                         "smaller image or set GREENSERVE_MAX_IMAGE_BYTES")


def check_part_names(names: Iterable[str | None]) -> None:
    """Every multipart part has a name (werkzeug files a part without one under None)."""
    if None in names:
        raise RequestError('a form part has no name; give each part one (Content-Disposition: form-data; '
                           'name="images"; filename="a.jpg"), as curl -F images=@a.jpg does', code="unnamed_form_part")


def form_value(name: str, raw: str) -> Any:
    """A form field or query parameter: ``top_k`` a whole number, the rest booleans."""
    if name == "top_k":
        try:
            return int(raw)
        except ValueError:
            raise RequestError(f"top_k={raw!r} is not a whole number") from None
    low = raw.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise RequestError(f"{name}={raw!r} is not a boolean; use true or false")


def request_options(doc: Mapping[str, Any], settings: Settings, task: str = "embeddings") -> dict[str, Any]:
    """``top_k``, ``normalize`` and ``partial``, validated (every protocol's options go through here)."""
    # rank returns every image (ordered) unless asked for fewer
    top_k = doc.get("top_k", settings.max_top_k if task == "rank" else DEFAULT_TOP_K)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= settings.max_top_k:
        raise RequestError(f"top_k must be a whole number from 1 to {settings.max_top_k}; got {top_k!r}")
    out: dict[str, Any] = {"top_k": top_k}
    for name, default in (("normalize", True), ("partial", False)):
        value = doc.get(name, default)
        if not isinstance(value, bool):
            raise RequestError(f"{name} must be true or false; got {value!r}")
        out[name] = value
    model = doc.get("model")
    if model is not None:
        if not isinstance(model, str) or not model.strip():
            raise RequestError(f"model must be a served model's name (GET /v1/models lists them); got {model!r}")
        out["model"] = model.strip()
    return out
