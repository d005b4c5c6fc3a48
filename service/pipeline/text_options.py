"""Stage 0 for texts: the text fields of a request (``texts``, ``labels`` + ``template``, ``query``), validated.

Limits: ``GREENSERVE_MAX_TEXTS`` texts, ``GREENSERVE_MAX_LABELS`` labels, ``GREENSERVE_MAX_TEXT_CHARS``
characters each. Past the model's context length (77 tokens for CLIP, about 300 characters of English)
a text is truncated, as CLIP was trained, and its item says ``"truncated": true``; ``"truncate": false``
refuses it instead (``over_context_length``, once the tokens are counted). The tokenizer computes only the
tokens the context holds (``open_clip_family.ClipText``), so the longest texts these limits allow cost no
more than short ones past the context (docs/SIZING.md, Texts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.errors import PayloadTooLarge, RequestError
from service.settings import Settings

DEFAULT_TEMPLATE = "a photo of a {}."
# the fields each route takes besides images and the shared options
TASK_FIELDS = {"embeddings": ("texts", "truncate"), "classify": ("labels", "template"), "rank": ("query", "truncate")}


@dataclass(frozen=True)
class TextOptions:
    texts: tuple[str, ...] = ()  # /v1/embeddings: texts instead of images
    labels: tuple[str, ...] = ()  # /v1/classify: zero-shot labels
    template: str = DEFAULT_TEMPLATE
    query: str | None = None  # /v1/rank
    truncate: bool = True

    @property
    def prompts(self) -> tuple[str, ...]:
        """What the text tower embeds for this request besides ``texts``: the labels in their template, or
        the query."""
        if self.labels:
            return tuple(self.template.replace("{}", label) for label in self.labels)
        return (self.query,) if self.query is not None else ()


def parse_text_options(doc: Mapping[str, Any], task: str, settings: Settings) -> TextOptions:
    texts = _texts(doc["texts"], "texts", settings.max_texts, "too_many_texts", settings) if "texts" in doc else ()
    labels = (_texts(doc["labels"], "labels", settings.max_labels, "too_many_labels", settings)
              if "labels" in doc else ())
    if len(set(labels)) != len(labels):
        raise RequestError("labels must be distinct; each is a class the images are scored against")
    template = doc.get("template", DEFAULT_TEMPLATE)
    if not isinstance(template, str) or template.count("{}") != 1:
        raise RequestError(f'template must be a string with one "{{}}" where the label goes, like '
                           f'"{DEFAULT_TEMPLATE}"; got {template!r}')
    check_length("template", template, settings)
    if "template" in doc and not labels:
        raise RequestError("template only applies with labels", code="labels_required")
    query = doc.get("query")
    if task == "rank":
        if not isinstance(query, str) or not query.strip():
            raise RequestError('"query" must be a non-empty string: the text the images are ranked by, like '
                               '"a dog on a beach"', code="empty_text")
        check_length("query", query, settings)
    truncate = doc.get("truncate", True)
    if not isinstance(truncate, bool):
        raise RequestError(f"truncate must be true or false; got {truncate!r}")
    return TextOptions(texts, labels, template, query, truncate)


def _texts(value: Any, field: str, limit: int, code: str, settings: Settings) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise RequestError(f'"{field}" must be a non-empty list of strings', code="empty_text")
    if len(value) > limit:
        clients = "" if field == "labels" else (" (LangChain's OpenAIEmbeddings: chunk_size; LlamaIndex: "
                                                "embed_batch_size)")
        raise PayloadTooLarge(f"{len(value)} {field} in one request; the limit is {limit}. Split the request"
                              f"{clients} or set GREENSERVE_MAX_{'LABELS' if field == 'labels' else 'TEXTS'}",
                              code=code)
    out = []
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text.strip():
            raise RequestError(f"{field}[{i}] must be a non-empty string", code="empty_text")
        check_length(f"{field}[{i}]", text, settings)
        out.append(text)
    return tuple(out)


def check_length(where: str, text: str, settings: Settings) -> None:
    """413 ``text_too_long`` past GREENSERVE_MAX_TEXT_CHARS, naming where (a protocol's own text reads it too)."""
    if len(text) > settings.max_text_chars:
        raise PayloadTooLarge(f"{where} has {len(text)} characters; the limit is {settings.max_text_chars} "
                              "(the model reads at most its context length anyway). Shorten it or set "
                              "GREENSERVE_MAX_TEXT_CHARS", code="text_too_long")
