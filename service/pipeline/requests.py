"""What a parsed request is, whichever protocol it came in: its images (each a URL to fetch, bytes in hand,
or its error) and its options. Parsing lives in ``inputs`` (and each protocol's module); the pipeline and
the data plane take these."""

from __future__ import annotations

from dataclasses import dataclass

from service.errors import ImageError
from service.pipeline.text_options import TextOptions

DEFAULT_TOP_K = 5


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: something to fetch (``url``), bytes in hand (``data``), or an ``error``."""

    index: int
    name: str
    url: str | None = None
    data: bytes | None = None
    error: ImageError | None = None


@dataclass(frozen=True)
class InferenceRequest:
    refs: tuple[ImageRef, ...]
    top_k: int = DEFAULT_TOP_K
    normalize: bool = True
    partial: bool = False
    text: TextOptions = TextOptions()
    model: str | None = None  # the served model it asks for (``http.model_names``); None: the default
    urgency: int = 3  # RFC 9218's (the Priority header): 4-7 make it a backfill (``rules.lane``)
